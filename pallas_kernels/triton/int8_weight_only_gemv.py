"""`int8_weight_only_gemv`: weight-only int8 GEMV (M <= 4 rows), y = x @ W.T with
W = CB * SCB[:, None] / 127.

Decode-time products are bandwidth-bound: the 1-byte CB must stream at close to the copy rate,
so this kernel uses no tensor-core dot (which would pad M to 16 rows) and no per-call padding or
separate epilogue where it can avoid them:
- grid (N tiles, K splits); each program walks its K range in (block_n, block_k) CB tiles and
  does fp32 multiply-adds against each x row (CB -> fp32 is exact);
- with one K split (the default when N / block_n programs already fill the GPU), SCB/127 is
  applied and the result written in out_dtype inside the kernel: one kernel per call;
- with several splits the fp32 partials are summed and scaled in one small XLA fusion.
Numerics are those of `int8_weight_only(dequant="epilogue")`: exact products, fp32 accumulation,
one scaling and one rounding per output. `matmul_int8_reference` is the oracle.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference.int8 import check_int8_operands, int8_row_scale, matmul_int8_reference
from pallas_kernels.triton.matmul_int8 import pad2, round_up
from pallas_kernels.registry import Variant

reference = matmul_int8_reference

MAX_M = 4
# Enough programs to keep every SM streaming (132 SMs on a Hopper GPU, 2+ programs each).
_TARGET_PROGRAMS = 264


def _gemv_kernel(x_ref, cb_ref, s_ref, o_ref, *, m: int, nk: int, bk: int, scale: bool,
                 reduce_at_end: bool):
    def body(t, accs):
        ks = pl.ds(pl.multiple_of(t * bk, bk), bk)
        w = cb_ref[:, ks].astype(jnp.float32)  # (bn, bk), exact
        out = []
        for r in range(m):
            prod = w * x_ref[r, ks].astype(jnp.float32)[None, :]
            out.append(accs[r] + (prod if reduce_at_end else jnp.sum(prod, axis=1)))
        return tuple(out)

    bn = cb_ref.shape[0]
    acc_shape = (bn, bk) if reduce_at_end else (bn,)
    accs = lax.fori_loop(0, nk, body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(m)))
    s = s_ref[0, :] if scale else None
    for r in range(m):
        acc = jnp.sum(accs[r], axis=1) if reduce_at_end else accs[r]
        if scale:
            acc = acc * s
        o_ref[pl.ds(r, 1), :] = acc[None, :].astype(o_ref.dtype)


def _default_splits(n_tiles: int, nk: int) -> int:
    """Fewest K splits (a divisor of the K tile count) that give ~_TARGET_PROGRAMS programs."""
    for d in range(1, nk + 1):
        if nk % d == 0 and (n_tiles * d >= _TARGET_PROGRAMS or nk // d <= 2):
            return d
    return nk


def _check_pow2(name: str, b: int) -> int:
    if not _compat.is_pow2(int(b)):
        raise ValueError(f"int8_weight_only_gemv: {name}={b} must be a power of two")
    return int(b)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "interpret", "block_n", "block_k", "splits", "num_warps",
                     "num_stages", "reduce_at_end"))
def int8_weight_only_gemv(x, cb, scb, *, out_dtype=None, interpret=False, block_n=None,
                          block_k=None, splits=None, num_warps=4, num_stages=3,
                          reduce_at_end=False):
    """y (M, N) = x (M, K) @ W.T for M <= 4, W = CB * SCB / 127; CB streamed once from memory.

    block_n rows of CB by block_k columns per tile (powers of two); `splits` K splits (must
    divide the K tile count; default: the fewest that fill the GPU); reduce_at_end keeps
    (block_n, block_k) fp32 accumulators and reduces once after the K loop.
    """
    check_int8_operands(x, cb, scb, what="int8_weight_only_gemv")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = cb.shape[0]
    if m > MAX_M:
        raise ValueError(f"int8_weight_only_gemv: M={m} > {MAX_M}; use int8_weight_only_splitk or "
                         "int8_weight_only")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bn = _check_pow2("block_n", block_n or min(16, _compat.next_pow2(n)))
    bk = _check_pow2("block_k", block_k or min(512, max(32, _compat.next_pow2(k))))
    np_, kp = round_up(n, bn), round_up(k, bk)
    n_tiles, nk = np_ // bn, kp // bk
    if splits is None:
        splits = _default_splits(n_tiles, nk)
    elif splits < 1 or nk % splits:
        raise ValueError(f"int8_weight_only_gemv: splits={splits} must divide the {nk} K tiles")
    per = nk // splits
    scale = splits == 1
    xp, cbp = pad2(x, m, kp), pad2(cb, np_, kp)
    s = jnp.pad(int8_row_scale(scb), (0, np_ - n))[None, :]
    out = _compat.pallas_call(
        functools.partial(_gemv_kernel, m=m, nk=per, bk=bk, scale=scale,
                          reduce_at_end=reduce_at_end),
        out_shape=jax.ShapeDtypeStruct((splits * m, np_), out_dtype if scale else jnp.float32),
        grid=(n_tiles, splits),
        in_specs=[
            pl.BlockSpec((m, per * bk), lambda j, sp: (0, sp)),
            pl.BlockSpec((bn, per * bk), lambda j, sp: (j, sp)),
            pl.BlockSpec((1, bn), lambda j, sp: (0, j)),
        ],
        out_specs=pl.BlockSpec((m, bn), lambda j, sp: (sp, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_int8_gemv",
    )(xp, cbp, s)
    if scale:
        return out[:, :n]
    acc = out.reshape(splits, m, np_).sum(axis=0)[:, :n]
    return (acc * int8_row_scale(scb)[None, :]).astype(out_dtype)


def supports(m, n, k, blocksize=None):
    return 0 < m <= MAX_M


VARIANTS = (
    Variant(
        name="int8_weight_only_gemv",
        op="matmul_int8",
        fn=int8_weight_only_gemv,
        reference=matmul_int8_reference,
        supports=supports,
        description="M<=4: fp32 multiply-adds (no dot padding to 16 rows), grid (N tiles, K "
                    "splits); one split scales and writes out_dtype in-kernel (one kernel/call)",
        numerics="int8_weight_only",
        status="experimental",
    ),
)
