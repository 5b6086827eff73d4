"""`gemv_block_scaled`: 4-bit GEMV (M <= 4) with block-wise scaling: y = x @ dequant(W).T in fp32.

At decode time the product is bound by the per-weight decode (its instructions and their
latency), not by bytes. The split-K kernel (`splitk_small_m`) rebuilds every weight as the
reference does (code * absmax in fp32, rounded to x's dtype, widened again) before its
multiply-add; this kernel uses the block structure instead:

    y[m, n] = sum_b absmax[n, b] * sum_{k in block b} x[m, k] * code[q[n, k]]

so each weight costs one table load and one multiply-add, and the scale one multiply per
(row, block). The table has 16 entries on purpose: a warp's gather from 16 fp32 codes stays in
one 64-byte region, while a 256-entry table of both nibbles' codes per byte value (one load per
byte, no nibble extraction) touches up to 8 cache lines, each a separate L1 wavefront, and
measured slower (docs/kernels.md).

The packed weight is viewed as (N, K / 2c, c) chunks of c bytes that never cross a scale block
(a free reshape in the wrapper), so the block sums are a reduction over the last axis of a 3-D
tile: no in-kernel reshape. x is viewed as (M, K / 2c, c, 2) and its even/odd
columns (high/low nibbles) are split in registers.

Numerics: the weight is never rounded to x's dtype. The oracle `matmul_4bit_gemv_reference` is
x (as fp32) @ the fp32 dequantized weight, fp32 accumulation, one rounding of the output. For
fp32 x this equals `matmul_4bit_reference`; for bf16/fp16 x that reference rounds each weight
first, and the two differ by up to half an ulp of x's dtype per product (this one is the closer
to the exact product).

Grid (N tiles, K splits) as in the split-K kernel; with one split the kernel writes out_dtype
itself, else the fp32 partials are summed by XLA. Double-quantized scales are de-nested
in-kernel (`nested=`), one gather pair per (row, block).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat, nibble_lookup
from pallas_kernels._compat import cdiv
from pallas_kernels.reference.fourbit import (
    check_4bit_weight, check_x, matmul_4bit_gemv_reference, matmul_4bit_rounded_codes_reference,
    supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    kernel_scale_refs, nested_kernel_inputs, scale_block_chunks)
from pallas_kernels.registry import Variant

reference = matmul_4bit_gemv_reference

MAX_M = 4
# Default K splits: one K tile per program (a grid of N tiles x K tiles, fp32 partials summed
# by XLA): a K loop per program serialises the latency-bound decode; more, shorter programs
# overlap it. (block_n, block_k, num_warps): 64x256 with 8 warps up to a 4096x4096 weight,
# 32x512 with 4 warps above. Both chosen by measurement: docs/kernels.md
_SMALL_WEIGHT = 4096 * 4096


def default_tiles(n: int, k: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) by default for an (n, k) weight (comment above)."""
    return (64, 256, 8) if n * k <= _SMALL_WEIGHT else (32, 512, 4)


def supports(m: int, n: int, k: int, blocksize: int) -> bool:
    return m <= MAX_M and supports_4bit(m, n, k, blocksize)


def _gemv_kernel(*refs, m: int, n: int, bn: int, gc: int, per_block: int, tps: int,
                 nested: bool, fma: bool, prmt: bool, interpret: bool):
    x_ref, packed_ref, absmax_ref, code_ref, *rest = refs
    denest, out_ref = kernel_scale_refs(rest, nested, absmax_ref.shape[1])
    j, s = pl.program_id(0), pl.program_id(1)
    ragged = n % bn != 0
    rows = j * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)
    wmask3 = (rows < n)[:, :, None] if ragged else None
    amask = (rows < n) if ragged else None
    # per_block > 1: each chunk is a part of one scale block and a tile (gc = 1) has one scale.
    g = gc if per_block == 1 else 1
    # prmt: code_ref holds the 8 words of nibble_lookup.table_words (x's dtype), read once
    words = [code_ref[i] for i in range(8)] if prmt else None

    def body(t, accs):
        u0 = pl.multiple_of((s * tps + t) * gc, gc)  # first chunk of this tile
        p = _compat.load(packed_ref.at[:, pl.ds(u0, gc), :], mask=wmask3, other=0)
        if prmt:
            v_hi, v_lo = (nibble_lookup.lookup(p, words, x_ref.dtype, half, interpret=interpret)
                          .astype(jnp.float32) for half in ("hi", "lo"))
        else:
            p = p.astype(jnp.int32)
            v_hi = code_ref[p >> 4]  # (bn, gc, c) fp32: x[2j] pairs with the high nibble
            v_lo = code_ref[p & 15]
        c0 = u0 // per_block
        am = _compat.load(absmax_ref.at[:, pl.ds(c0, g)], mask=amask, other=0)
        am = denest(am, j * bn, c0)
        out = []
        for r in range(m):
            xe, xo = lax.unstack(x_ref[r, pl.ds(u0, gc), :, :].astype(jnp.float32), axis=2)
            if fma:  # one FMUL + one FFMA per byte instead of two FMUL + one FADD
                hi = v_hi * xe[None]
                pair = _compat.fma_f32(v_lo, jnp.broadcast_to(xo[None], hi.shape), hi,
                                       interpret=interpret)
            else:
                pair = v_hi * xe[None] + v_lo * xo[None]
            block_sums = jnp.sum(pair, axis=2)  # (bn, gc)
            out.append(accs[r] + block_sums * am)
        return tuple(out)

    accs = lax.fori_loop(0, tps, body, tuple(jnp.zeros((bn, g), jnp.float32) for _ in range(m)))
    cmask = None
    if ragged:
        cmask = (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n
    for r in range(m):
        y = jnp.sum(accs[r], axis=1)
        _compat.store(out_ref.at[pl.ds(r, 1), :], y[None, :].astype(out_ref.dtype), mask=cmask)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_n", "block_k", "splits", "num_warps",
    "num_stages", "fma", "lookup"))
def gemv_block_scaled(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                      interpret: bool = False, block_n: int | None = None,
                      block_k: int | None = None, splits: int | None = None,
                      num_warps: int | None = None, num_stages: int = 3, nested=None,
                      fma: bool = True, lookup: str = "gather"):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 4, scaled per block in fp32 (see module doc).

    block_k counts weight columns per tile (two per byte; a power of two); `splits` K splits
    (must divide the number of K tiles; default: one K tile per program). Unset
    block_n/block_k/num_warps come from `default_tiles`. fma: one fused multiply-add per byte
    (inline PTX; chosen by measurement: docs/kernels.md).
    nested = (nested_absmax, nested_code, offset) with `absmax` the uint8 (N, K//bs) codes of
    double-quantized scales: de-nested in-kernel.
    lookup: "gather" (fp32 codes loaded from the table per weight) or "prmt" (the codes rounded
    to x's dtype, found by byte permutes in registers: `nibble_lookup`; the effective weight is
    then round(code) * absmax, oracle `matmul_4bit_rounded_codes_reference`; fp32 x gathers,
    which is the same product).
    """
    what = "gemv_block_scaled"
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what=what)
    check_x(x, k, what=what)
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"{what}: M={m} > {MAX_M}; use splitk_small_m or fused_tiled")
    if lookup not in ("gather", "prmt"):
        raise ValueError(f"{what}: lookup must be 'gather' or 'prmt', got {lookup!r}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    dflt = default_tiles(n, k)
    bn = block_n or dflt[0]
    bk = block_k or dflt[1]
    num_warps = num_warps or dflt[2]
    if not (_compat.is_pow2(bn) and _compat.is_pow2(bk) and bk >= 2):
        raise ValueError(f"{what}: block_n and block_k must be powers of two, got {bn}, {bk}")
    c, gc, per_block, u, nk = scale_block_chunks(k, blocksize, bk)
    n_tiles = cdiv(n, bn)
    if splits is None:
        splits = nk  # one K tile per program (measured: the comment above default_tiles)
    elif splits < 1 or nk % splits != 0:
        raise ValueError(f"{what}: splits={splits} must divide the {nk} K tiles")
    part_dtype = out_dtype if splits == 1 else jnp.float32
    prmt = lookup == "prmt" and jnp.dtype(x.dtype).itemsize == 2
    table = nibble_lookup.table_words(code.astype(x.dtype)) if prmt else code
    kernel = functools.partial(_gemv_kernel, m=m, n=n, bn=bn, gc=gc, per_block=per_block,
                               tps=nk // splits, nested=nested is not None, fma=fma, prmt=prmt,
                               interpret=_compat.resolve_interpret(interpret))
    nested_ops, nested_specs = nested_kernel_inputs(nested)
    partial = _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, m, n), part_dtype),
        grid=(n_tiles, splits),
        in_specs=[
            pl.BlockSpec((m, u, c, 2), lambda j, s: (0, 0, 0, 0)),
            pl.BlockSpec((bn, u, c), lambda j, s: (j, 0, 0)),
            pl.BlockSpec((bn, k // blocksize), lambda j, s: (j, 0)),
            pl.BlockSpec(table.shape, lambda j, s: (0,)),
            *nested_specs,
        ],
        out_specs=pl.BlockSpec((_compat.SQUEEZED, m, bn), lambda j, s: (s, 0, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_gemv",
    )(x.reshape(m, u, c, 2), packed.reshape(n, u, c), absmax, table, *nested_ops)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0)
    return y.astype(out_dtype)


def default_config(m: int, n: int, k: int, blocksize: int) -> dict:
    """The tile keywords `gemv_block_scaled` uses by default at this shape (`default_tiles`)."""
    del m, blocksize
    bn, bk, nw = default_tiles(n, k)
    return dict(block_n=bn, block_k=bk, num_warps=nw)


VARIANTS = (
    Variant(
        name="gemv_block_scaled",
        op="matmul_4bit",
        fn=gemv_block_scaled,
        reference=matmul_4bit_gemv_reference,
        supports=supports,
        description="Pallas/Triton 4-bit GEMV for M <= 4: fp32 code[q] * x summed per scale "
                    "block, then one multiply by the block's absmax; the weight is not rounded "
                    "to x's dtype. Grid (N tiles, K splits). De-nests double-quantized scales "
                    "in-kernel (nested=).",
        accepts_nested=True,
        numerics="fp32_weight",
        status="default",
        default_config=default_config,
    ),
    Variant(
        name="gemv_block_scaled_prmt",
        op="matmul_4bit",
        fn=functools.partial(gemv_block_scaled, lookup="prmt"),
        reference=matmul_4bit_rounded_codes_reference,
        supports=supports,
        description="gemv_block_scaled with the code table rounded to x's dtype and looked up "
                    "by byte permutes in registers (nibble_lookup, no load) instead of an fp32 "
                    "table gather; effective weight round(code) * absmax.",
        accepts_nested=True,
        numerics="rounded_codes",
        status="alternative",
        default_config=default_config,
    ),
)
