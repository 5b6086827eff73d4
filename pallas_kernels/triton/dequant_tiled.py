"""4-bit (NF4/FP4) blockwise dequantization (`dequant_tiled`): a Pallas (Triton lowering) kernel.

The layout, the operand checks and the oracle (`dequantize_4bit_reference`) are in
`pallas_kernels.reference.fourbit`. This module also holds the tile decode the fused matmul kernels
share (scale blocks, nibble decode, in-kernel de-nesting).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._compat import cdiv
from pallas_kernels.reference.fourbit import (
    NESTED_BLOCKSIZE, check_4bit_operands, dequantize_4bit_reference, supports_4bit, unfused)
from pallas_kernels.registry import Variant

reference = dequantize_4bit_reference
DECODE_METHODS = ("select", "gather")
# In-kernel dots: HIGHEST so float32 inputs are not rounded to TF32 by the Triton lowering
# (bf16/fp16 inputs are unaffected).
HIGHEST = jax.lax.Precision.HIGHEST


def resolve_method(method: str, auto: str) -> str:
    """'auto' -> the per-kernel default picked by measurement (see each kernel); else validated."""
    method = auto if method == "auto" else method
    if method not in DECODE_METHODS:
        raise ValueError(f"unknown decode method {method!r}; expected 'auto' or one of {DECODE_METHODS}")
    return method


def nested_kernel_inputs(nested):
    """(operands, BlockSpecs) that hand the double-quantization tables whole to every program of
    a grid of any rank; ((), []) for fp32 scales. The offset scalar travels as a (1,) array."""
    if nested is None:
        return (), []
    nested_absmax, nested_code, offset = nested
    ops = (nested_absmax, nested_code, jnp.reshape(offset, (1,)))
    return ops, [pl.BlockSpec(a.shape, lambda *program_ids: (0,)) for a in ops]


def scale_block_chunks(k: int, blocksize: int, block_k: int) -> tuple[int, int, int, int, int]:
    """Tiling of a row of K/2 packed bytes into chunks that never cross a scale block.

    Returns (c, gc, per_block, u, nk): c bytes per chunk, gc chunks per K tile of block_k
    weight columns (rounded down to a power of two dividing K/2), per_block chunks per scale
    block, u = K / 2c chunks per row, nk K tiles per row. The packed weight viewed as (N, u, c)
    is a free reshape (used by the block-scaled kernels).
    """
    half_block = blocksize // 2  # bytes per scale block in a row; K / 2 is a multiple of it
    bkb = _compat.largest_pow2_divisor(k // 2, min(block_k // 2, k // 2))  # bytes per K tile
    c = min(half_block, bkb)
    u = k // (2 * c)
    gc = bkb // c  # 1 when a tile is at most one block
    return c, gc, half_block // c, u, u // gc


# ----------------------------------------------------------------------------------------------
# In-kernel decode helpers
# ----------------------------------------------------------------------------------------------
def load_code_scalars(code_ref):
    """The 16 table values as scalars (load once per program, outside the K loop)."""
    return tuple(code_ref[i] for i in range(16))


def decode_nibbles(p, code_ref, table, *, high: bool, method: str):
    """float32 code[nibble] for every byte of `p` (int32 tile of byte values 0..255).

    method "select": a 4-level select tree over the nibble bits with the 16 table values as
    scalars (15 selects, no gather, pure ALU). method "gather": a pointer load `code[q]`
    (one cached L1 load per element).
    """
    if method == "gather":
        q = (p >> 4) if high else (p & 15)
        return code_ref[q]
    if method != "select":
        raise ValueError(f"unknown decode method {method!r}; expected one of {DECODE_METHODS}")
    shift = 4 if high else 0
    level = list(table)
    for bit in range(4):
        b = (p & (1 << (shift + bit))) != 0
        level = [jnp.where(b, level[2 * j + 1], level[2 * j]) for j in range(len(level) // 2)]
    (v,) = level
    return v


def denest_tile(codes, row0, col0, nested_absmax_ref, nested_code_ref, offset, *, ncols: int):
    """fp32 scales of a tile of double-quantized codes, as `denest_absmax_reference` computes them.

    codes (R, G) uint8 = absmax[row0 : row0+R, col0 : col0+G] of the (N, ncols) code array; scale
    block b = row * ncols + col uses nested_absmax[b // 256]. Two table gathers, no fp32 scale
    array in memory. Rows past N (masked loads) clamp to the last nested block: no out-of-bounds
    read, and their values are never stored. The select in `unfused` keeps bitsandbytes' two
    roundings under XLA (interpret mode); Triton/LLVM may still contract to an FMA, a <= 1 ulp
    difference in a scale that is fine for a matmul.
    """
    r, g = codes.shape
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (r, 1), 0)
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, g), 1)
    last = nested_absmax_ref.shape[0] - 1
    block = jnp.minimum(jax.lax.div(rows * ncols + cols, NESTED_BLOCKSIZE), last)  # (R, G), >= 0
    return unfused(nested_code_ref[codes.astype(jnp.int32)] * nested_absmax_ref[block]) + offset


def kernel_scale_refs(rest, nested: bool, ncols: int):
    """A 4-bit kernel's refs after its inputs -> (denest, out_ref). With double quantization
    `rest` is (nested_absmax, nested_code, offset, out) and `denest(am, row0, col0)` turns a
    loaded tile of scale codes into fp32 scales (`denest_tile`, the offset read once, here);
    without, `rest` is (out,) and `denest` returns the tile unchanged."""
    if not nested:
        (out_ref,) = rest
        return (lambda am, row0, col0: am), out_ref
    nested_absmax_ref, nested_code_ref, offset_ref, out_ref = rest
    offset = offset_ref[0]

    def denest(am, row0, col0):
        return denest_tile(am, row0, col0, nested_absmax_ref, nested_code_ref, offset,
                           ncols=ncols)
    return denest, out_ref


def apply_scales(vals, am):
    """vals (R, C) float32, am (R, G) float32 with C % G == 0: vals[r, c] * am[r, c // (C//G)]."""
    r, c = vals.shape
    g = am.shape[1]
    if g == 1:
        return vals * am
    return (vals.reshape(r, g, c // g) * am[:, :, None]).reshape(r, c)


def row_mask(start, size: int, limit: int):
    """(size, 1) bool mask: which of the rows start..start+size-1 are < limit."""
    return (start + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)) < limit


def pick_block_bytes(kb: int, target: int) -> int:
    """Byte-columns per tile: a power of two dividing K//2, <= target (>= 16 since 32 | K)."""
    return _compat.largest_pow2_divisor(kb, max(1, target))


# ----------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------
def _dequant_kernel(packed_ref, absmax_ref, code_ref, out_ref, *, n_rows: int, bn: int,
                    out_dtype, method: str):
    i = pl.program_id(0)
    mask = None if n_rows % bn == 0 else row_mask(i * bn, bn, n_rows)
    p = _compat.load(packed_ref, mask=mask, other=0).astype(jnp.int32)
    am = _compat.load(absmax_ref, mask=mask, other=0.0)
    table = load_code_scalars(code_ref) if method == "select" else None
    hi = apply_scales(decode_nibbles(p, code_ref, table, high=True, method=method), am)
    lo = apply_scales(decode_nibbles(p, code_ref, table, high=False, method=method), am)
    hi = hi.astype(out_dtype)
    lo = lo.astype(out_dtype)
    out = jnp.stack([hi, lo], axis=-1).reshape(bn, 2 * hi.shape[1])  # interleave: hi -> 2j
    _compat.store(out_ref, out, mask=mask)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_n", "block_k", "method", "num_warps"))
def dequant_tiled(packed, absmax, code, *, blocksize: int, out_dtype=jnp.float32,
                  interpret: bool = False, block_n: int | None = None,
                  block_k: int | None = None, method: str = "auto", num_warps: int = 4):
    """Dequantize bitsandbytes 4-bit weights to (N, K) out_dtype with a tiled Pallas kernel.

    Bit-exact with `dequantize_4bit_reference`. Grid over (row tiles, byte-column tiles);
    block_k counts weight columns (2 per byte). method "auto" = "gather" (chosen by
    measurement: docs/kernels.md).
    """
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="dequant_tiled")
    method = resolve_method(method, "gather")
    out_dtype = jnp.dtype(out_dtype)
    kb = k // 2
    bkb = pick_block_bytes(kb, (block_k or 512) // 2)
    # 16-row tiles: chosen by measurement: docs/kernels.md
    bn = block_n or min(16, _compat.next_pow2(n))
    if not _compat.is_pow2(bn):
        raise ValueError(f"dequant_tiled: block_n must be a power of two, got {bn}")
    span = 2 * bkb  # weight columns per tile
    if span >= blocksize:
        g = span // blocksize
        am_spec = pl.BlockSpec((bn, g), lambda i, j: (i, j))
    else:
        am_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, (j * span) // blocksize))
    kernel = functools.partial(_dequant_kernel, n_rows=n, bn=bn, out_dtype=out_dtype, method=method)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, k), out_dtype),
        grid=(cdiv(n, bn), kb // bkb),
        in_specs=[
            pl.BlockSpec((bn, bkb), lambda i, j: (i, j)),
            am_spec,
            pl.BlockSpec((16,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((bn, span), lambda i, j: (i, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=1,
        name="dequantize_4bit",
    )(packed, absmax, code)


VARIANTS = (
    Variant(
        name="dequant_tiled",
        op="dequantize_4bit",
        fn=dequant_tiled,
        reference=dequantize_4bit_reference,
        supports=supports_4bit,
        description="Pallas/Triton tiled 4-bit dequant: (16 rows x 256 bytes) tiles, table-load "
                    "decode, hi/lo nibbles interleaved in registers; bit-exact with the reference.",
        numerics="rounded_weight",
        status="default",  # inside dequant_dot / dequant_dot_t
    ),
)
