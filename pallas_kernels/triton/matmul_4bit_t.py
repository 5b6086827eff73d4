"""The two general forms of the backward product dx = dy @ dequant(W) (Pallas, Triton
lowering): `fused_tiled_t` and `dequant_dot_t`. Their oracle is `reference.matmul_4bit_t_reference`.

`fused_tiled_t`: dy (M, N), W (N, K) -> dx (M, K), without writing dequant(W) to memory.
Grid over (M tiles, K-byte tiles); N is looped inside. Each (block_n, block_k/2) byte tile gives
the high-nibble half W_hi = W[:, 0::2] and the low half W_lo = W[:, 1::2]; the kernel accumulates
dx_even = dy @ W_hi and dx_odd = dy @ W_lo and writes them interleaved (dx[:, 2j] = even[:, j]).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._compat import cdiv
from pallas_kernels.reference.fourbit import (
    check_4bit_operands, check_x, matmul_4bit_t_reference, supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    HIGHEST as _HIGHEST, dequant_tiled, load_code_scalars, pick_block_bytes, resolve_method)
from pallas_kernels.triton.matmul_4bit import absmax_cols, decode_tile, dot_out
from pallas_kernels.registry import Variant

reference = matmul_4bit_t_reference
_NN = (((1,), (0,)), ((), ()))


def _t_kernel(dy_ref, packed_ref, absmax_ref, code_ref, out_ref, *, m: int, n: int, bm: int,
              bn: int, bkb: int, method: str, out_dtype):
    i = pl.program_id(0)
    g = absmax_ref.shape[1]
    table = load_code_scalars(code_ref) if method == "select" else None
    dtype = dy_ref.dtype
    rows_ok = None if m % bm == 0 else (
        (i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m)
    ragged_n = n % bn != 0

    def body(t, carry):
        acc_e, acc_o = carry
        n0 = pl.multiple_of(t * bn, bn)
        if ragged_n:
            ncols = (n0 + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n
            nrows = (n0 + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)) < n
            dmask = ncols if rows_ok is None else (rows_ok & ncols)
        else:
            nrows = None
            dmask = rows_ok
        dy = _compat.load(dy_ref.at[:, pl.ds(n0, bn)], mask=dmask, other=0)
        p = _compat.load(packed_ref.at[pl.ds(n0, bn), :], mask=nrows, other=0)
        am = _compat.load(absmax_ref.at[pl.ds(n0, bn), :], mask=nrows, other=0.0)
        w_hi, w_lo = decode_tile(p, am, code_ref, table, method=method, dtype=dtype)
        acc_e += jnp.dot(dy, w_hi, preferred_element_type=jnp.float32,
                         precision=_HIGHEST)
        acc_o += jnp.dot(dy, w_lo, preferred_element_type=jnp.float32,
                         precision=_HIGHEST)
        return acc_e, acc_o

    zero = jnp.zeros((bm, bkb), jnp.float32)
    acc_e, acc_o = lax.fori_loop(0, cdiv(n, bn), body, (zero, zero))
    out = jnp.stack([acc_e.astype(out_dtype), acc_o.astype(out_dtype)], axis=-1).reshape(bm, 2 * bkb)
    _compat.store(out_ref, out, mask=rows_ok)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_m", "block_n", "block_k", "method",
    "num_warps", "num_stages"))
def fused_tiled_t(dy, packed, absmax, code, *, blocksize: int, out_dtype=None,
                  interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                  block_k: int | None = None, method: str = "auto", num_warps: int | None = None,
                  num_stages: int = 3):
    """dx (M, K) = dy (M, N) @ dequant(W) with W (N, K); the dense weight is never materialized.

    block_k counts weight columns (two per packed byte, output tile is block_m x block_k);
    block_m, block_n powers of two >= 16. M and N edges are masked.
    """
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="fused_tiled_t")
    check_x(dy, n, what="fused_tiled_t", name="dy")
    method = resolve_method(method, "select")
    m = dy.shape[0]
    out_dtype = jnp.dtype(dy.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, k), out_dtype)
    # 256-row tiles with 8 warps from M = 256: chosen by measurement: docs/kernels.md
    big = m >= 256
    bm = block_m or (256 if big else 128 if m >= 128 else max(16, _compat.next_pow2(m)))
    bn = block_n or (64 if n >= 64 else max(16, _compat.next_pow2(n)))
    num_warps = num_warps or (8 if big else 4)
    for name, b in (("block_m", bm), ("block_n", bn)):
        if not (_compat.is_pow2(b) and b >= 16):
            raise ValueError(f"fused_tiled_t: {name} must be a power of two >= 16, got {b}")
    kb = k // 2
    bkb = pick_block_bytes(kb, (block_k or 128) // 2)
    if bkb < 16:
        raise ValueError(f"fused_tiled_t: block_k must be >= 32, got {block_k}")
    span = 2 * bkb
    g = absmax_cols(span, blocksize)
    if span >= blocksize:
        am_spec = pl.BlockSpec((n, g), lambda i, j: (0, j))
    else:
        am_spec = pl.BlockSpec((n, 1), lambda i, j: (0, (j * span) // blocksize))
    kernel = functools.partial(_t_kernel, m=m, n=n, bm=bm, bn=bn, bkb=bkb, method=method,
                               out_dtype=out_dtype)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, k), out_dtype),
        grid=(cdiv(m, bm), kb // bkb),
        in_specs=[
            pl.BlockSpec((bm, n), lambda i, j: (i, 0)),
            pl.BlockSpec((n, bkb), lambda i, j: (0, j)),
            am_spec,
            pl.BlockSpec((16,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((bm, span), lambda i, j: (i, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_t_fused",
    )(dy, packed, absmax, code)


@functools.partial(jax.jit, static_argnames=("blocksize", "out_dtype", "interpret"))
def dequant_dot_t(dy, packed, absmax, code, *, blocksize: int, out_dtype=None,
                  interpret: bool = False):
    """dx = dy @ dequant(W) as the Pallas dequant kernel (transient dense weight) + XLA dot."""
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="dequant_dot_t")
    check_x(dy, n, what="dequant_dot_t", name="dy")
    out_dtype = jnp.dtype(dy.dtype if out_dtype is None else out_dtype)
    w = dequant_tiled(packed, absmax, code, blocksize=blocksize, out_dtype=dy.dtype,
                      interpret=interpret)
    return dot_out(dy, w, _NN, out_dtype)


VARIANTS = (
    Variant(
        name="fused_tiled_t",
        op="matmul_4bit_t",
        fn=fused_tiled_t,
        reference=matmul_4bit_t_reference,
        supports=supports_4bit,
        description="Pallas/Triton fused dy @ dequant(W): grid (M tiles, K/128), N loop of 64 "
                    "(256-row tiles, 8 warps for M >= 256); hi/lo nibble tiles give dx even/odd "
                    "halves, interleaved in registers.",
        numerics="rounded_weight",
        status="experimental",
    ),
    Variant(
        name="dequant_dot_t",
        op="matmul_4bit_t",
        fn=dequant_dot_t,
        reference=matmul_4bit_t_reference,
        supports=supports_4bit,
        description="dequant_tiled kernel to a transient dense weight, then the XLA GEMM dy @ W.",
        numerics="rounded_weight",
        status="default",
    ),
)
