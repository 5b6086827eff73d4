"""The two general forms of the 4-bit product y = x @ dequant(W).T (Pallas, Triton lowering):
`fused_tiled` (dequant fused into a tiled matmul) and `dequant_dot` (the `dequant_tiled` kernel,
then the vendor GEMM). Their oracle is `reference.matmul_4bit_reference`.

In `fused_tiled`, x is split once per call into its even and odd columns; byte j of a packed row
holds W[:, 2j] (high nibble) and W[:, 2j+1] (low nibble), so
    y = x[:, 0::2] @ W_hi.T + x[:, 1::2] @ W_lo.T
and the kernel never interleaves nibbles. Grid over (M tiles, N tiles); K is looped inside;
each (block_n, block_k/2) byte tile is decoded in registers (fp32 code * absmax, cast to
x.dtype) and fed to two dots with fp32 accumulation.
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
    check_4bit_operands, check_x, matmul_4bit_reference, supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    HIGHEST as _HIGHEST, apply_scales, decode_nibbles, dequant_tiled, load_code_scalars,
    pick_block_bytes, resolve_method, row_mask)
from pallas_kernels.registry import Variant

reference = matmul_4bit_reference
_NT = (((1,), (1,)), ((), ()))  # contract last dims: a (m, k) . b (n, k) -> (m, n)


def split_even_odd(x):
    """(M, K) -> (x[:, 0::2], x[:, 1::2])."""
    m, k = x.shape
    x2 = x.reshape(m, k // 2, 2)
    return x2[:, :, 0], x2[:, :, 1]


def decode_tile(p_u8, am, code_ref, table, *, method: str, dtype):
    """(R, C) packed byte tile + (R, G) scales -> (W_hi, W_lo), each (R, C) in dtype."""
    p = p_u8.astype(jnp.int32)
    hi = apply_scales(decode_nibbles(p, code_ref, table, high=True, method=method), am)
    lo = apply_scales(decode_nibbles(p, code_ref, table, high=False, method=method), am)
    return hi.astype(dtype), lo.astype(dtype)


def absmax_cols(span: int, blocksize: int) -> int:
    """Scale columns covering `span` consecutive weight columns (span, blocksize powers of 2)."""
    return max(1, span // blocksize)


def _fused_kernel(xe_ref, xo_ref, packed_ref, absmax_ref, code_ref, out_ref, *, m: int, n: int,
                  bm: int, bn: int, bkb: int, nk: int, blocksize: int, method: str, out_dtype):
    i, j = pl.program_id(0), pl.program_id(1)
    xmask = None if m % bm == 0 else row_mask(i * bm, bm, m)
    wmask = None if n % bn == 0 else row_mask(j * bn, bn, n)
    span = 2 * bkb
    g = absmax_cols(span, blocksize)
    table = load_code_scalars(code_ref) if method == "select" else None
    dtype = xe_ref.dtype

    def body(t, acc):
        kb0 = pl.multiple_of(t * bkb, bkb)
        xe = _compat.load(xe_ref.at[:, pl.ds(kb0, bkb)], mask=xmask, other=0)
        xo = _compat.load(xo_ref.at[:, pl.ds(kb0, bkb)], mask=xmask, other=0)
        p = _compat.load(packed_ref.at[:, pl.ds(kb0, bkb)], mask=wmask, other=0)
        am = _compat.load(absmax_ref.at[:, pl.ds((t * span) // blocksize, g)], mask=wmask, other=0.0)
        w_hi, w_lo = decode_tile(p, am, code_ref, table, method=method, dtype=dtype)
        acc += lax.dot_general(xe, w_hi, _NT, preferred_element_type=jnp.float32,
                                   precision=_HIGHEST)
        acc += lax.dot_general(xo, w_lo, _NT, preferred_element_type=jnp.float32,
                                   precision=_HIGHEST)
        return acc

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
    omask = None
    if xmask is not None or wmask is not None:
        cols = (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n
        rows = (i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m
        omask = rows & cols
    _compat.store(out_ref, acc.astype(out_dtype), mask=omask)


def default_blocks(m: int, n: int, k: int):
    """(block_m, block_n, block_k, num_warps) defaults; 256x128x64 tiles with 8 warps at
    M >= 256 (chosen by measurement: docs/kernels.md)."""
    if m >= 256:
        return 256, (128 if n >= 128 else max(16, _compat.next_pow2(n))), 64, 8
    bm = 128 if m >= 128 else max(16, _compat.next_pow2(m))
    bn = 128 if n >= 128 else max(16, _compat.next_pow2(n))
    return bm, bn, 128, 4


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_m", "block_n", "block_k", "method",
    "num_warps", "num_stages"))
def fused_tiled(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None, method: str = "auto", num_warps: int | None = None,
                num_stages: int = 3):
    """y (M, N) = x (M, K) @ dequant(W).T, fused: no dense weight is written to memory.

    block_k counts weight columns (two per packed byte); all blocks are powers of two, block_m
    and block_n >= 16 (Triton dot minimum). M and N edges are masked; K is a multiple of blocksize.
    """
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="fused_tiled")
    check_x(x, k, what="fused_tiled")
    method = resolve_method(method, "select")
    m = x.shape[0]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    dbm, dbn, dbk, dnw = default_blocks(m, n, k)
    bm, bn = block_m or dbm, block_n or dbn
    num_warps = num_warps or dnw
    for name, b in (("block_m", bm), ("block_n", bn)):
        if not (_compat.is_pow2(b) and b >= 16):
            raise ValueError(f"fused_tiled: {name} must be a power of two >= 16, got {b}")
    kb = k // 2
    bkb = pick_block_bytes(kb, (block_k or dbk) // 2)
    if bkb < 16:
        raise ValueError(f"fused_tiled: block_k must be >= 32, got {block_k}")
    xe, xo = split_even_odd(x)
    kernel = functools.partial(
        _fused_kernel, m=m, n=n, bm=bm, bn=bn, bkb=bkb, nk=kb // bkb, blocksize=blocksize,
        method=method, out_dtype=out_dtype)
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(cdiv(m, bm), cdiv(n, bn)),
        in_specs=[
            pl.BlockSpec((bm, kb), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, kb), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, kb), lambda i, j: (j, 0)),
            pl.BlockSpec((bn, k // blocksize), lambda i, j: (j, 0)),
            pl.BlockSpec((16,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_fused",
    )(xe, xo, packed, absmax, code)


def dot_out(a, b, dims, out_dtype):
    """XLA dot with fp32 accumulation; fp32 inputs at HIGHEST (no TF32); result in out_dtype."""
    prec = _HIGHEST if a.dtype == jnp.float32 else None
    if out_dtype == a.dtype:  # the vendor GEMM accumulates in fp32 and rounds once
        return lax.dot_general(a, b, dims, precision=prec)
    return lax.dot_general(a, b, dims, precision=prec,
                           preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("blocksize", "out_dtype", "interpret"))
def dequant_dot(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                interpret: bool = False):
    """y = x @ dequant(W).T as the Pallas dequant kernel (dense x.dtype weight, transient) + XLA dot.

    Large-M path: the dense weight exists only inside this call (it is never a residual).
    """
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="dequant_dot")
    check_x(x, k, what="dequant_dot")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    w = dequant_tiled(packed, absmax, code, blocksize=blocksize, out_dtype=x.dtype,
                      interpret=interpret)
    return dot_out(x, w, _NT, out_dtype)


def default_config(m: int, n: int, k: int, blocksize: int) -> dict:
    """The tile keywords `fused_tiled` uses by default at this shape (`default_blocks`)."""
    del blocksize
    bm, bn, bk, nw = default_blocks(m, n, k)
    return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw)


VARIANTS = (
    Variant(
        name="fused_tiled",
        op="matmul_4bit",
        fn=fused_tiled,
        reference=matmul_4bit_reference,
        supports=supports_4bit,
        description="Pallas/Triton fused dequant-matmul: grid (M tiles, N tiles), K loop inside "
                    "(256x128x64 tiles, 8 warps for M >= 256); x split even/odd so hi/lo nibble "
                    "tiles feed two dots; fp32 acc. Decode-bound at large M.",
        numerics="rounded_weight",
        status="experimental",
        default_config=default_config,
    ),
    Variant(
        name="dequant_dot",
        op="matmul_4bit",
        fn=dequant_dot,
        reference=matmul_4bit_reference,
        supports=supports_4bit,
        description="dequant_tiled kernel to a transient dense x.dtype weight, then the XLA "
                    "(vendor) GEMM; the weight exists only inside the call.",
        numerics="rounded_weight",
        status="default",
    ),
)
