"""`splitk_small_m`: small-M (M <= 64, bandwidth-bound) 4-bit matmul y = x @ dequant(W).T, split-K.

The packed weight is streamed exactly once. Grid = (N tiles, K splits): enough programs to fill
every SM even at N = 4096; each program walks its K range in (block_n x block_k/2) byte tiles,
decodes them in registers and writes an fp32 partial sum; the wrapper sums the (splits, M, N)
partials and casts. x is split into even/odd columns (hi/lo nibble halves, no interleaving).
M <= `rowwise_max_m` uses broadcast-multiply + row reductions (no tensor-core padding); larger M
pads x to a power of two >= 16 rows and uses dots.

Double-quantized scales can be de-nested in-kernel (`nested=`): each program gathers its few
(block_n x G) scales from the uint8 codes and the two small tables, so no XLA de-nest kernel
runs before the call and the scale read is 1 byte instead of 4 per block (at M=1 both are a
large share of the time).
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
    check_4bit_weight, check_x, matmul_4bit_small_m_reference, supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    HIGHEST as _HIGHEST, denest_tile, load_code_scalars, nested_kernel_inputs, pick_block_bytes,
    resolve_method, row_mask)
from pallas_kernels.triton.matmul_4bit import _NT, absmax_cols, decode_tile, split_even_odd
from pallas_kernels.registry import Variant

reference = matmul_4bit_small_m_reference

MAX_M = 64
ROWWISE_MAX_M = 4
# Where x is split into even/odd columns, per path (row-wise: True): "kernel" (tt.split in
# registers, no extra XLA kernel) or "wrapper" (x[:, 0::2], x[:, 1::2] once per call).
SPLIT_X_AUTO = {True: "kernel", False: "wrapper"}
_TARGET_PROGRAMS = 1024  # ~8 per SM on a 132-SM Hopper GPU


def supports(m: int, n: int, k: int, blocksize: int) -> bool:
    return m <= MAX_M and supports_4bit(m, n, k, blocksize)


def _splitk_kernel(*refs, n: int, mp: int, bn: int, bkb: int, tps: int, blocksize: int,
                   method: str, rowwise: bool, split_in_kernel: bool, nested: bool,
                   reduce_at_end: bool = False):
    *in_refs, out_ref = refs
    if nested:  # absmax_ref holds uint8 codes; de-nested per tile (see denest_tile)
        *in_refs, nested_absmax_ref, nested_code_ref, offset_ref = in_refs
    if split_in_kernel:  # x (mp, K): de-interleave even/odd columns in registers (tt.split)
        x_ref, packed_ref, absmax_ref, code_ref = in_refs
        dtype = x_ref.dtype
    else:  # x pre-split by the wrapper: xe, xo (mp, K//2)
        xe_ref, xo_ref, packed_ref, absmax_ref, code_ref = in_refs
        dtype = xe_ref.dtype
    j, s = pl.program_id(0), pl.program_id(1)
    wmask = None if n % bn == 0 else row_mask(j * bn, bn, n)
    span = 2 * bkb
    g = absmax_cols(span, blocksize)
    table = load_code_scalars(code_ref) if method == "select" else None
    offset = offset_ref[0] if nested else None

    def weights(t):
        kt = s * tps + t
        kb0 = pl.multiple_of(kt * bkb, bkb)
        c0 = (kt * span) // blocksize
        p = _compat.load(packed_ref.at[:, pl.ds(kb0, bkb)], mask=wmask, other=0)
        am = _compat.load(absmax_ref.at[:, pl.ds(c0, g)], mask=wmask, other=0)
        if nested:
            am = denest_tile(am, j * bn, c0, nested_absmax_ref, nested_code_ref, offset,
                             ncols=absmax_ref.shape[1])
        w_hi, w_lo = decode_tile(p, am, code_ref, table, method=method, dtype=dtype)
        return kb0, w_hi, w_lo

    def x_tile(rows, kb0):
        """x[rows, 2*kb0 : 2*kb0 + span] as (even, odd) halves, each (..., bkb)."""
        if split_in_kernel:
            k0 = pl.multiple_of(2 * kb0, span)
            xt = x_ref[rows, pl.ds(k0, span)]
            return lax.unstack(xt.reshape(*xt.shape[:-1], bkb, 2), axis=xt.ndim)
        return xe_ref[rows, pl.ds(kb0, bkb)], xo_ref[rows, pl.ds(kb0, bkb)]

    cmask = None if wmask is None else (
        (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n)
    if rowwise:
        def body(t, accs):
            kb0, w_hi, w_lo = weights(t)
            w_hi = w_hi.astype(jnp.float32)
            w_lo = w_lo.astype(jnp.float32)
            out = []
            for r in range(mp):
                xe, xo = x_tile(r, kb0)
                xe = xe.astype(jnp.float32)
                xo = xo.astype(jnp.float32)
                prod = w_hi * xe[None, :] + w_lo * xo[None, :]
                out.append(accs[r] + (prod if reduce_at_end else jnp.sum(prod, axis=1)))
            return tuple(out)

        # reduce_at_end: (bn, bkb) accumulators, one cross-thread reduction after the K loop
        # instead of one per tile (more registers, no per-tile shuffles / shared memory).
        acc_shape = (bn, bkb) if reduce_at_end else (bn,)
        accs = lax.fori_loop(0, tps, body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(mp)))
        for r in range(mp):
            acc = jnp.sum(accs[r], axis=1) if reduce_at_end else accs[r]
            _compat.store(out_ref.at[pl.ds(r, 1), :], acc[None, :].astype(out_ref.dtype),
                          mask=cmask)
    else:
        def body(t, acc):
            kb0, w_hi, w_lo = weights(t)
            xe, xo = x_tile(slice(None), kb0)
            acc += lax.dot_general(xe, w_hi, _NT, preferred_element_type=jnp.float32,
                                   precision=_HIGHEST)
            acc += lax.dot_general(xo, w_lo, _NT, preferred_element_type=jnp.float32,
                                   precision=_HIGHEST)
            return acc

        acc = lax.fori_loop(0, tps, body, jnp.zeros((mp, bn), jnp.float32))
        _compat.store(out_ref, acc.astype(out_ref.dtype), mask=cmask)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_n", "block_k", "splits", "method",
    "rowwise_max_m", "split_x", "num_warps", "num_stages", "reduce_at_end"))
def splitk_small_m(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                   interpret: bool = False, block_n: int | None = None,
                   block_k: int | None = None, splits: int | None = None,
                   method: str = "auto", rowwise_max_m: int = ROWWISE_MAX_M,
                   split_x: str = "auto", num_warps: int = 4, num_stages: int = 3,
                   block_m: int | None = None, nested=None, reduce_at_end: bool = False):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 64 (split-K, weight streamed once).

    block_k counts weight columns per tile (two per byte); `splits` K splits (must divide the
    number of K tiles; default: enough programs to fill the GPU). block_m is accepted for
    signature compatibility and ignored (all M rows are in every program).
    nested = (nested_absmax (ceil(N*K/bs / 256),), nested_code (256,), offset ()) float32, with
    `absmax` the uint8 (N, K//bs) codes of double-quantized scales: de-nested in-kernel.
    """
    del block_m
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what="splitk_small_m")
    check_x(x, k, what="splitk_small_m")
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"splitk_small_m: M={m} > {MAX_M}; use fused_tiled")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    rowwise = m <= rowwise_max_m
    # table loads on the row-wise path, the select tree on the dot path: chosen by
    # measurement: docs/kernels.md
    method = resolve_method(method, "gather" if rowwise else "select")
    mp = m if rowwise else max(16, _compat.next_pow2(m))
    # tile defaults: chosen by measurement: docs/kernels.md
    bn = block_n or (32 if rowwise or mp >= 64 else 64)
    if not _compat.is_pow2(bn) or (not rowwise and bn < 16):
        raise ValueError(f"splitk_small_m: block_n must be a power of two (>= 16 when M > "
                         f"{rowwise_max_m}), got {bn}")
    kb = k // 2
    bkb = pick_block_bytes(kb, (block_k or (128 if 16 <= mp <= 32 else 256)) // 2)
    nk = kb // bkb
    n_tiles = cdiv(n, bn)
    if splits is None:
        cap = max(1, min(_TARGET_PROGRAMS // n_tiles, k // (32 * mp)))
        splits = _compat.largest_divisor_at_most(nk, cap)
    elif nk % splits != 0:
        raise ValueError(f"splitk_small_m: splits={splits} must divide the {nk} K tiles")
    split_x = SPLIT_X_AUTO[rowwise] if split_x == "auto" else split_x
    if split_x not in ("kernel", "wrapper"):
        raise ValueError(f"splitk_small_m: split_x must be 'auto', 'kernel' or 'wrapper', "
                         f"got {split_x!r}")
    if mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if split_x == "kernel":
        xs = (x,)
        x_specs = [pl.BlockSpec((mp, k), lambda j, s: (0, 0))]
    else:
        xs = split_even_odd(x)
        x_specs = [pl.BlockSpec((mp, kb), lambda j, s: (0, 0))] * 2
    # One split: write out_dtype directly (single kernel); else fp32 partials summed below.
    part_dtype = out_dtype if splits == 1 else jnp.float32
    kernel = functools.partial(
        _splitk_kernel, n=n, mp=mp, bn=bn, bkb=bkb, tps=nk // splits, blocksize=blocksize,
        method=method, rowwise=rowwise, split_in_kernel=split_x == "kernel",
        reduce_at_end=reduce_at_end and rowwise,
        nested=nested is not None)
    nested_ops, nested_specs = nested_kernel_inputs(nested)
    partial = _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, mp, n), part_dtype),
        grid=(n_tiles, splits),
        in_specs=[
            *x_specs,
            pl.BlockSpec((bn, kb), lambda j, s: (j, 0)),
            pl.BlockSpec((bn, k // blocksize), lambda j, s: (j, 0)),
            pl.BlockSpec((16,), lambda j, s: (0,)),
            *nested_specs,
        ],
        out_specs=pl.BlockSpec((_compat.SQUEEZED, mp, bn), lambda j, s: (s, 0, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_splitk",
    )(*xs, packed, absmax, code, *nested_ops)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0)
    return y[:m].astype(out_dtype)


VARIANTS = (
    Variant(
        name="splitk_small_m",
        op="matmul_4bit",
        fn=splitk_small_m,
        reference=matmul_4bit_small_m_reference,
        supports=supports,
        description="Pallas/Triton split-K small-M (M <= 64) dequant-matmul: grid (N tiles, K "
                    "splits), fp32 partials summed in the wrapper; M <= 4: row-wise FMA + table-"
                    "load decode, x split in-kernel; else dots + select decode. De-nests "
                    "double-quantized scales in-kernel (nested=).",
        accepts_nested=True,
        numerics="rounded_weight",
        status="experimental",
    ),
)
