"""`decoded_dot`: 4-bit matmul for mid-size M (33 to 64 rows by default), y = x @ dequant(W).T,
each weight tile decoded in registers (code * absmax, rounded once to x's dtype) and fed to a
tensor-core dot (Pallas, Triton lowering). Oracle: `reference.matmul_4bit_decoded_dot_reference`.

Between the block-scaled dot (`block_scaled_dot`) and `dequant_dot` (a dense bf16 weight
written, then cuBLAS) the block-scaled form pays for its scale placement: it multiplies each
scale block's (block_n, M) partial product by the block's scales, about M / 32 fp32
multiply-adds per weight, and its dots are 32 columns deep.
Here the scale goes into the weight instead (one fp32 multiply and half a convert per weight)
and each dot is block_k deep:

    acc (block_n, block_m) += W (block_n, block_k) . x (block_m, block_k)^T

W is the left operand, so the weight rows fill the MMA's M side; the two nibbles of each byte
are decoded separately and interleaved in registers (byte j -> columns 2j, 2j+1), so x is read
as stored; the (block_m, block_n) output is stored transposed. Grid (N tiles, M tiles, K
splits); with several splits XLA sums the fp32 partials. Double-quantized scales are de-nested
in-kernel (`nested=`).

The code lookup: `lookup="prmt"` (default; byte permutes in registers, `nibble_lookup`) finds
the code rounded to x's 16-bit dtype, so the weight is round(round(code) * absmax), at most
about one ulp of x's dtype from bitsandbytes' round(code * absmax) (half an ulp); oracle: the
reference on the rounded table. `lookup="gather"` loads the fp32 code (the weight is then bit
for bit `dequantize_4bit_reference`'s) but is far slower.

Limits: the decode and the warpgroup MMA do not overlap, and each weight is decoded once per M
tile, so at large M `dequant_dot` is faster. Where each form wins: docs/kernels.md.
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
    check_4bit_weight, check_x, matmul_4bit_decoded_dot_reference, split_code_table, supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    HIGHEST, apply_scales, kernel_scale_refs, nested_kernel_inputs, pick_block_bytes, row_mask)
from pallas_kernels.triton.matmul_4bit import _NT
from pallas_kernels.registry import Variant

reference = matmul_4bit_decoded_dot_reference

LOOKUPS = ("gather", "prmt")
# (block_n, block_m, block_k, num_warps, num_stages, K splits): chosen by measurement:
# docs/kernels.md
DEFAULT_CONFIG = (64, 64, 64, 4, 3, 4)


def _decoded_dot_kernel(*refs, m: int, n: int, bm: int, bn: int, bkb: int, tps: int,
                        blocksize: int, nested: bool, prmt: bool, interpret: bool):
    x_ref, packed_ref, absmax_ref, table_ref, *rest = refs
    denest, out_ref = kernel_scale_refs(rest, nested, absmax_ref.shape[1])
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    wmask = row_mask(j * bn, bn, n) if n % bn else None
    xmask = row_mask(i * bm, bm, m) if m % bm else None
    span = 2 * bkb  # weight columns per K tile
    g = max(1, span // blocksize)  # scale columns per K tile
    words = [table_ref[w] for w in range(8)] if prmt else None
    dtype = x_ref.dtype

    def codes(p, half):
        """fp32 code values of one nibble half of the (bn, bkb) byte tile."""
        if prmt:
            return nibble_lookup.lookup(p, words, dtype, half,
                                        interpret=interpret).astype(jnp.float32)
        q = p.astype(jnp.int32)
        return table_ref[(q >> 4) if half == "hi" else (q & 15)]

    def body(t, acc):
        kb0 = pl.multiple_of((s * tps + t) * bkb, bkb)
        p = _compat.load(packed_ref.at[:, pl.ds(kb0, bkb)], mask=wmask, other=0)
        col0 = (2 * kb0) // blocksize
        am = _compat.load(absmax_ref.at[:, pl.ds(col0, g)], mask=wmask, other=0)
        am = denest(am, j * bn, col0).astype(jnp.float32)
        hi = apply_scales(codes(p, "hi"), am).astype(dtype)
        lo = apply_scales(codes(p, "lo"), am).astype(dtype)
        # byte j -> columns 2j, 2j+1. (Splitting x's tile into even and odd columns instead,
        # for two dots, is far slower: a bank-conflicted shared-memory shuffle.)
        w = jnp.stack([hi, lo], axis=-1).reshape(bn, span)
        xt = _compat.load(x_ref.at[:, pl.ds(2 * kb0, span)], mask=xmask, other=0)
        return acc + lax.dot_general(w, xt, _NT, preferred_element_type=jnp.float32,
                                     precision=HIGHEST)  # (bn, bm)

    acc = lax.fori_loop(0, tps, body, jnp.zeros((bn, bm), jnp.float32))
    omask = None
    if wmask is not None or xmask is not None:
        rows = (i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m
        cols = (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n
        omask = rows & cols
    _compat.store(out_ref, acc.T.astype(out_ref.dtype), mask=omask)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_n", "block_m", "block_k", "splits",
    "num_warps", "num_stages", "lookup"))
def decoded_dot(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                interpret: bool = False, block_n: int | None = None,
                block_m: int | None = None, block_k: int | None = None,
                splits: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, nested=None,
                lookup: str = "prmt"):
    """y (M, N) = x (M, K) @ dequant(W).T with the weight decoded in registers per tile.

    block_n / block_m: powers of two >= 16 (block_m defaults to M rounded up to a power of two,
    at most DEFAULT_CONFIG's); block_k weight columns per K tile (two per byte, a power of two
    >= 32, rounded down to divide K). `splits` K splits (must divide the K tile count; default:
    the largest divisor of it up to DEFAULT_CONFIG's). lookup "prmt" (codes rounded to x's
    16-bit dtype; fp32 x gathers) or "gather" (exact: W as `dequantize_4bit_reference`).
    nested = (nested_absmax, nested_code, offset) with `absmax` the uint8 codes of
    double-quantized scales: de-nested in-kernel.
    """
    what = "decoded_dot"
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what=what)
    check_x(x, k, what=what)
    if lookup not in LOOKUPS:
        raise ValueError(f"{what}: lookup must be one of {LOOKUPS}, got {lookup!r}")
    m = x.shape[0]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    dbn, dbm, dbk, dnw, dns, dsplits = DEFAULT_CONFIG
    bn = block_n or dbn
    bm = block_m or min(dbm, max(16, _compat.next_pow2(m)))
    num_warps, num_stages = num_warps or dnw, num_stages or dns
    for name, b in (("block_n", bn), ("block_m", bm)):
        if not (_compat.is_pow2(b) and b >= 16):
            raise ValueError(f"{what}: {name} must be a power of two >= 16, got {b}")
    bk = block_k or dbk
    if not (_compat.is_pow2(bk) and bk >= 32):
        raise ValueError(f"{what}: block_k must be a power of two >= 32, got {bk}")
    kb = k // 2
    bkb = pick_block_bytes(kb, bk // 2)
    nk = kb // bkb
    if splits is None:
        splits = _compat.largest_divisor_at_most(nk, dsplits)
    elif splits < 1 or nk % splits:
        raise ValueError(f"{what}: splits={splits} must divide the {nk} K tiles")
    prmt = lookup == "prmt" and jnp.dtype(x.dtype).itemsize == 2
    if prmt:
        (rounded,) = split_code_table(code, x.dtype, exact=False)
        table = nibble_lookup.table_words(rounded)
    else:
        table = code.astype(jnp.float32)
    part_dtype = out_dtype if splits == 1 else jnp.float32
    kernel = functools.partial(
        _decoded_dot_kernel, m=m, n=n, bm=bm, bn=bn, bkb=bkb, tps=nk // splits,
        blocksize=blocksize, nested=nested is not None, prmt=prmt,
        interpret=_compat.resolve_interpret(interpret))
    nested_ops, nested_specs = nested_kernel_inputs(nested)
    partial = _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, m, n), part_dtype),
        grid=(cdiv(n, bn), cdiv(m, bm), splits),
        in_specs=[
            pl.BlockSpec((bm, k), lambda j, i, s: (i, 0)),
            pl.BlockSpec((bn, kb), lambda j, i, s: (j, 0)),
            pl.BlockSpec((bn, k // blocksize), lambda j, i, s: (j, 0)),
            pl.BlockSpec(table.shape, lambda j, i, s: (0,)),
            *nested_specs,
        ],
        out_specs=pl.BlockSpec((_compat.SQUEEZED, bm, bn), lambda j, i, s: (s, i, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_decoded_dot",
    )(x, packed, absmax, table, *nested_ops)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0)
    return y.astype(out_dtype)


def default_config(m: int, n: int, k: int, blocksize: int) -> dict:
    """The tile keywords `decoded_dot` uses by default at this shape (from
    DEFAULT_CONFIG; `splits` is left to the kernel, which derives it from K and block_k)."""
    del n, k, blocksize
    bn, bm, bk, nw, ns, _ = DEFAULT_CONFIG
    return dict(block_n=bn, block_m=min(bm, max(16, _compat.next_pow2(m))), block_k=bk,
                num_warps=nw, num_stages=ns)


VARIANTS = (
    Variant(
        name="decoded_dot_prmt",
        op="matmul_4bit",
        fn=decoded_dot,
        reference=matmul_4bit_decoded_dot_reference,
        supports=supports_4bit,
        description="Pallas/Triton 4-bit matmul for mid-size M: each weight tile decoded in "
                    "registers (codes by byte permutes, rounded to x's dtype, times absmax, "
                    "rounded once) and fed as the left operand of a tensor-core dot against x "
                    "as stored; 64x64x64 tiles, 4 K splits.",
        accepts_nested=True,
        numerics="rounded_codes_twice",
        status="default",
        default_config=default_config,
    ),
    Variant(
        name="decoded_dot_gather",
        op="matmul_4bit",
        fn=functools.partial(decoded_dot, lookup="gather"),
        reference=functools.partial(matmul_4bit_decoded_dot_reference, lookup="gather"),
        supports=supports_4bit,
        description="decoded_dot with the fp32 codes gathered from the table: the weight is "
                    "bit for bit the dequant kernel's; far slower than the byte-permute lookup, "
                    "kept for comparison.",
        accepts_nested=True,
        numerics="rounded_weight",
        status="experimental",
        default_config=default_config,
    ),
)
