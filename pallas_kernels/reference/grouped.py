"""The grouped (mixture-of-experts) family's jnp side: rows of the activation sorted by expert.
Operand checks, the tile schedule every grouped kernel shares (`grouped_tiles`), and the oracles
(`jax.lax.ragged_dot_general`; a 4-bit stack dequantized by the 4-bit oracle first).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference.fourbit import check_code, dequantize_4bit_reference, is_pow2


def check_grouped_operands(a, group_sizes, w, *, transpose_w: bool, what: str):
    """a (M, Kc) floating, group_sizes (E,) integer, w (E, N, K) with Kc = K (transpose_w: the
    forward, a @ w[e].T) or Kc = N (a @ w[e]); every error names the operand."""
    if a.ndim != 2:
        raise ValueError(f"{what}: `x` must be 2-D (M, K), got shape {a.shape}")
    if a.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: `x` dtype must be float32/bfloat16/float16, got {a.dtype}")
    if w.ndim != 3:
        raise ValueError(f"{what}: `w` must be the (E, N, K) expert stack, got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{what}: `group_sizes` must be integer of shape ({w.shape[0]},), got "
                         f"{group_sizes.dtype}{group_sizes.shape}")
    kc = w.shape[2] if transpose_w else w.shape[1]
    if a.shape[1] != kc:
        raise ValueError(f"{what}: `x` has {a.shape[1]} columns but the expert stack {w.shape} needs {kc}")


def check_grouped_4bit_operands(a, group_sizes, packed, absmax, code, blocksize: int, *,
                                transpose_w: bool, what: str) -> tuple[int, int, int]:
    """The 4-bit expert stack: packed (E, N, K//2) uint8, absmax (E, N, K//blocksize) float32,
    code (16,); returns (E, N, K)."""
    if packed.ndim != 3 or packed.dtype != jnp.uint8:
        raise ValueError(f"{what}: `packed` must be uint8 (E, N, K//2), got {packed.dtype}{packed.shape}")
    e, n, kb = packed.shape
    k = 2 * kb
    if not (is_pow2(int(blocksize)) and blocksize >= 32) or k % blocksize:
        raise ValueError(f"{what}: blocksize {blocksize} must be a power of two >= 32 dividing K={k}")
    if absmax.shape != (e, n, k // blocksize) or absmax.dtype != jnp.float32:
        raise ValueError(f"{what}: `absmax` must be float32 of shape (E, N, K//blocksize) = "
                         f"{(e, n, k // blocksize)}, got {absmax.dtype}{absmax.shape}")
    check_code(code, what=what)
    check_grouped_operands(a, group_sizes, jax.ShapeDtypeStruct((e, n, k), a.dtype),
                           transpose_w=transpose_w, what=what)
    return e, n, k


@functools.partial(jax.jit, static_argnums=(1, 2))
def grouped_tiles(group_sizes, m: int, block_m: int):
    """The tile schedule of a grouped kernel over M sorted rows: int32 (3, T) rows (group,
    first row, end row) for T = cdiv(M, block_m) + E - 1 tiles (a static bound: each of the E - 1
    group boundaries splits at most one row block). Tile t covers rows [first, end) of `group`,
    all inside row block first // block_m; tiles past the schedule are empty (first == end == 0,
    group 0). Empty groups get no tile; rows past sum(group_sizes) (clipped to M) none either."""
    e = group_sizes.shape[0]
    num = -(-m // block_m) + e - 1
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.minimum(ends - gs, ends)
    starts = jnp.maximum(starts, 0)
    first_block = starts // block_m
    last_block = (ends - 1) // block_m
    count = jnp.where(ends > starts, last_block - first_block + 1, 0)
    cum = jnp.cumsum(count)
    t = jnp.arange(num, dtype=jnp.int32)
    # against all E cumulative counts at once: one fused kernel, where the default binary search is a
    # while loop of small kernels, run in every layer of a MoE step
    group = jnp.minimum(jnp.searchsorted(cum, t, side="right", method="compare_all"), e - 1).astype(jnp.int32)
    block = first_block[group] + t - (cum[group] - count[group])
    lo = jnp.maximum(starts[group], block * block_m)
    hi = jnp.minimum(ends[group], block * block_m + block_m)
    valid = t < cum[-1]
    lo, hi = jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)
    return jnp.stack([jnp.where(valid, group, 0), lo, hi]).astype(jnp.int32)


@jax.jit
def zero_rows_past_groups(y, group_sizes):
    """y with the rows at or past sum(group_sizes) set to zero (kernels leave them unwritten).

    Nothing y-sized here is loop-invariant: inside a scan over layers, XLA hoists a loop-invariant
    value out of the loop and keeps it for the whole loop, so a (rows, cols) iota and a broadcast
    zero were two live y-sized buffers per product (336 MiB through the backward of a
    Qwen3-30B-A3B-shaped step). The row index is a (rows, 1) column and the zero is made from
    `total` (a float product, which XLA does not fold to a constant)."""
    total = jnp.sum(group_sizes.astype(jnp.int32))
    rows = lax.broadcasted_iota(jnp.int32, (y.shape[0],) + (1,) * (y.ndim - 1), 0)
    zero = (total.astype(jnp.float32) * 0.0).astype(y.dtype)
    return jnp.where(rows < total, y, zero)


_RAGGED_NT = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_RAGGED_NN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _ragged(a, group_sizes, w, transpose_w: bool, out_dtype):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    y = lax.ragged_dot_general(a, w, group_sizes.astype(jnp.int32), _RAGGED_NT if transpose_w else _RAGGED_NN,
                               precision=prec, preferred_element_type=jnp.float32)
    return y.astype(a.dtype if out_dtype is None else out_dtype)


def grouped_matmul_reference(x, group_sizes, w, *, out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul`: y[rows of e] = x[rows of e] @ w[e].T (w (E, N, K) used as
    given, in x's dtype), fp32 sums, one rounding to out_dtype; rows past sum(group_sizes) 0."""
    del interpret
    check_grouped_operands(x, group_sizes, w, transpose_w=True, what="grouped_matmul_reference")
    return _ragged(x, group_sizes, w.astype(x.dtype), True, out_dtype)


def grouped_matmul_t_reference(dy, group_sizes, w, *, out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_t`: y[rows of e] = dy[rows of e] @ w[e] (the backward dx)."""
    del interpret
    check_grouped_operands(dy, group_sizes, w, transpose_w=False, what="grouped_matmul_t_reference")
    return _ragged(dy, group_sizes, w.astype(dy.dtype), False, out_dtype)


def _dequantize_stack(packed, absmax, code, blocksize, dtype):
    e = packed.shape[0]
    return jax.vmap(lambda p, a: dequantize_4bit_reference(p, a, code, blocksize=blocksize, out_dtype=dtype)
                    )(packed, absmax).reshape(e, packed.shape[1], 2 * packed.shape[2])


def grouped_matmul_4bit_reference(x, group_sizes, packed, absmax, code, *, blocksize: int,
                                  out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_4bit` (`rounded_weight`): each expert dequantized (fp32 math,
    one rounding to x's dtype), then `grouped_matmul_reference`."""
    del interpret
    check_grouped_4bit_operands(x, group_sizes, packed, absmax, code, blocksize, transpose_w=True,
                                what="grouped_matmul_4bit_reference")
    w = _dequantize_stack(packed, absmax, code, blocksize, x.dtype)
    return _ragged(x, group_sizes, w, True, out_dtype)


def grouped_matmul_4bit_t_reference(dy, group_sizes, packed, absmax, code, *, blocksize: int,
                                    out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_4bit_t`: dy[rows of e] @ dequant(W_e) in dy's dtype."""
    del interpret
    check_grouped_4bit_operands(dy, group_sizes, packed, absmax, code, blocksize, transpose_w=False,
                                what="grouped_matmul_4bit_t_reference")
    w = _dequantize_stack(packed, absmax, code, blocksize, dy.dtype)
    return _ragged(dy, group_sizes, w, False, out_dtype)
