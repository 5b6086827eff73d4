"""The general forms of the weight-only int8 (LLM.int8 row-wise) products y = x @ W.T and
dx = dy @ W: the `int8_weight_only` kernels and `int8_dequant_dot` (Pallas, Triton lowering).

A weight is CB int8 (N, K) plus SCB float32 (N,) (row absmax);
W ~= CB * SCB[:, None] / 127, N = out_features, K = in_features.

Reference numerics (`reference.matmul_int8_reference`, `matmul_int8_t_reference`) follow
bitsandbytes' weight-only path (`MatMul8bitFp` forward and the `MatMul8bitLt` / `MatMul8bitFp` backward):
    W_c = (CB.f32 * (SCB * f32(1/127))[:, None]).astype(compute_dtype)   (bnb: CB.to(dtype).mul_(SCB*(1/127)))
    y   = x @ W_c.T, float32 accumulation, one rounding to out_dtype.
`dequantize_int8_reference(cb, scb, dtype)` gives W_c (bit-exact with that bnb expression).
Note bnb's `int8_vectorwise_dequant` (used by transformers/PEFT and by the LLM.int8 outlier path)
associates differently: (CB * SCB) * f32(1/127); `dequantize_int8_vectorwise_reference` gives that.

Kernels (Pallas, Triton lowering on GPU, interpret mode on CPU):
- `int8_weight_only`: tiled (bm, bn) programs, K loop inside; by default (`dequant="epilogue"`) it
  computes acc = x @ CB_tile.astype(x.dtype).T in fp32 (int8 -> 16-bit is exact) and multiplies
  acc by SCB/127 per output column in the epilogue. This is mathematically equal to the reference
  but not bitwise (the reference rounds each W element to x.dtype; the epilogue form does not, so
  it is if anything closer to the exact product). `dequant="tile"` dequantizes each CB tile in
  registers exactly like the reference (fp32 math, one rounding to x.dtype) and differs from the
  reference only by accumulation order.
- `int8_weight_only_splitk`: small M (<= 64): grid over (N tiles, K splits), each program
  streams its CB slice once; with one split the kernel scales and writes the result, with several the fp32
  partials are summed and scaled in a small XLA epilogue.
- `int8_dequant_dot(_t)`: large M: W_c written once per call by the streaming
  `dequantize_int8` kernel (bit-identical to the reference's W_c), then the vendor GEMM.
- `int8_weight_only_t`: dx = dy @ W without W in memory: dy tile columns are scaled by SCB/127 in
  fp32, rounded to dy.dtype, then dy_scaled @ CB_tile (CB cast to dy.dtype), fp32 accumulation.

Default N and K blocks are the largest power of two (within each kernel's range) that divides N and
K, so checkpoint dimensions such as K = 11008 (43 tiles of 256) are not copied into a padded CB;
only a dimension with no power-of-two divisor >= 16 (N) or 32 (K) is zero-padded in the wrapper (a
copy of CB per call, which costs more than the product at small M: docs/kernels.md).
Block sizes are powers of two; int8 tiles are used with K-blocks >= 32.
fp32 inputs use an IEEE fp32 dot (Precision.HIGHEST, no TF32).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import load as _masked_load
from pallas_kernels.reference.int8 import (
    INV127, check_int8_operands, check_int8_weight, int8_row_scale, matmul_int8_reference,
    matmul_int8_t_reference)
from pallas_kernels.triton.matmul_4bit import dot_out
from pallas_kernels.registry import Variant

__all__ = [
    "dequantize_int8",
    "int8_weight_only",
    "int8_weight_only_dq",
    "int8_weight_only_splitk",
    "int8_dequant_dot",
    "int8_dequant_dot_t",
    "int8_weight_only_t",
    "reference",
    "VARIANTS",
]

reference = matmul_int8_reference
_NT = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: a @ b.T
_NN = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------- small helpers
def triton_params(num_warps, num_stages):
    """Triton compiler params (pallas_kernels._compat's shim; the class is `CompilerParams` in jax
    0.10.2 and 0.11.2). Passing them explicitly also keeps pallas_call on the Triton lowering
    whatever `jax_pallas_use_mosaic_gpu` says. Ignored in interpret mode."""
    try:
        from pallas_kernels._compat import compiler_params

        return compiler_params(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # pragma: no cover - fallback if the shim moves
        pass
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except Exception:  # pragma: no cover - a jax without the Triton backend
        return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _clamp_block(n: int, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, _next_pow2(n))))


def _divisor_block(n: int, lo: int, hi: int) -> int:
    """The largest power of two in [lo, hi] that divides n, so that an operand of extent n is not
    copied into a padded buffer on every call (a (4096, 11008) CB padded to 11264 columns was a
    45 MB copy per product); without one, the clamped power of two (the operand is padded)."""
    b = hi
    while b >= lo:
        if n % b == 0:
            return int(b)
        b //= 2
    return _clamp_block(n, lo, hi)


def _check_block(name: str, b: int) -> int:
    b = int(b)
    if b < 16 or b & (b - 1):
        raise ValueError(f"{name}={b}: block sizes must be powers of two >= 16")
    return b


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def output_tiles(m: int, n: int, k: int, block_m, block_n, block_k):
    """(bm, bn, bk) of the (M tiles, N tiles) kernels with a K loop: the caller's blocks, checked,
    or defaults from the problem size (shared by the weight-only and LLM.int8 kernels)."""
    return (_check_block("block_m", block_m or _clamp_block(m, 16, 128)),
            _check_block("block_n", block_n or _divisor_block(n, 16, 128)),
            _check_block("block_k", block_k or _divisor_block(k, 32, 64)))


def pad2(a, rows: int, cols: int):
    pr, pc = rows - a.shape[0], cols - a.shape[1]
    if pr == 0 and pc == 0:
        return a
    return jnp.pad(a, ((0, pr), (0, pc)))


def _pad1(a, size: int):
    return a if a.shape[0] == size else jnp.pad(a, (0, size - a.shape[0]))


def dot_precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ----------------------------------------------------------------------------- y = x @ W.T
def _oriented_dot(x, w, weight_left: bool, precision):
    """x (bm, bk) . w (bn, bk)^T in fp32, as (bm, bn), or as (bn, bm) with the weight as the left
    operand (`weight_left`). The weight is converted in registers; on Hopper only the left
    operand of a warpgroup MMA may come from registers, so the weight-left form lets the MMA take
    it there instead of through shared memory. The caller transposes the accumulator at the end."""
    lhs, rhs = (w, x) if weight_left else (x, w)
    return lax.dot_general(lhs, rhs, _NT, precision=precision, preferred_element_type=jnp.float32)


def _wo_kernel(x_ref, cb_ref, s_ref, o_ref, *, nk, bk, dequant, weight_left):
    bm, bn = o_ref.shape
    cdt = x_ref.dtype
    prec = dot_precision(cdt)
    if dequant == "tile":
        s_col = s_ref[...]  # (bn, 1) f32

    def body(k, acc):
        ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
        x = x_ref[:, ks]
        cbt = cb_ref[:, ks]
        if dequant == "tile":
            w = (cbt.astype(jnp.float32) * s_col).astype(cdt)
        else:
            w = cbt.astype(cdt)  # exact: |cb| <= 127
        return acc + _oriented_dot(x, w, weight_left, prec)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bn, bm) if weight_left else (bm, bn), jnp.float32))
    if weight_left:
        acc = acc.T
    if dequant == "epilogue":
        acc = acc * s_ref[...]  # (1, bn) f32
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "interpret", "dequant", "block_m", "block_n", "block_k",
                     "num_warps", "num_stages", "weight_left"))
def int8_weight_only(x, cb, scb, *, out_dtype=None, interpret=False, dequant="epilogue",
                     block_m=None, block_n=None, block_k=None, num_warps=None, num_stages=3,
                     weight_left=False):
    """y = x @ W.T with W = CB * SCB[:, None] / 127; x (M, K) float, cb (N, K) int8, scb (N,) f32.

    Compute in x.dtype (bf16/fp16 matrix product, or IEEE fp32 for fp32 x), fp32 accumulation,
    one rounding to out_dtype (default x.dtype). dequant="epilogue" (default, faster): SCB/127 is
    applied per output column after the K loop; dequant="tile": each CB tile is dequantized to
    x.dtype in registers like the reference. Both agree with `matmul_int8_reference` to within
    rounding (not bitwise). weight_left: the tile product is CB_tile . x_tile^T (see
    `_oriented_dot`), same numerics.
    """
    check_int8_operands(x, cb, scb, what="int8_weight_only")
    if dequant not in ("epilogue", "tile"):
        raise ValueError(f"int8_weight_only: dequant must be 'epilogue' or 'tile', got {dequant!r}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = cb.shape[0]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = output_tiles(m, n, k, block_m, block_n, block_k)
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    nk = kp // bk
    xp = pad2(x, mp, kp)
    cbp = pad2(cb, np_, kp)
    s = jnp.pad(int8_row_scale(scb), (0, np_ - n))
    if dequant == "tile":
        s_arr, s_spec = s[:, None], pl.BlockSpec((bn, 1), lambda i, j: (j, 0))
    else:
        s_arr, s_spec = s[None, :], pl.BlockSpec((1, bn), lambda i, j: (0, j))
    if num_warps is None:
        num_warps = 8 if bm * bn >= 128 * 128 else 4
    out = pl.pallas_call(
        functools.partial(_wo_kernel, nk=nk, bk=bk, dequant=dequant, weight_left=weight_left),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
            s_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="matmul_int8",
    )(xp, cbp, s_arr)
    return out[:m, :n]


# ----------------------------------------------------------------------------- small M, split K
def _splitk_kernel(x_ref, cb_ref, s_ref, o_ref, *, per, nk, bk, m, scale, weight_left):
    """x_ref (bm, K) is a block over the unpadded (m, K) x: rows >= m are masked to zero in the
    load (no padded copy of x). K split s takes K tiles [s * per, min((s + 1) * per, nk)): the
    last split is shorter when `per` does not divide the nk tiles (a dynamic trip count, so CB
    is not padded to splits * per tiles). scale: multiply by SCB * f32(1/127) (s_ref holds SCB)
    and write out_dtype here (one K split) instead of fp32 partials."""
    cdt = x_ref.dtype
    prec = dot_precision(cdt)
    bm = x_ref.shape[0]
    xmask = None if m == bm else lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < m
    first = pl.program_id(1) * per
    trips = per if nk % per == 0 else jnp.minimum(per, nk - first)

    def body(t, acc):
        ks = pl.ds(pl.multiple_of((first + t) * bk, bk), bk)
        w = cb_ref[:, ks].astype(cdt)
        if xmask is None:
            x = x_ref[:, ks]
        else:
            x = _masked_load(x_ref.at[:, ks], mask=xmask, other=jnp.zeros((), cdt))
        return acc + _oriented_dot(x, w, weight_left, prec)

    bn = o_ref.shape[1]
    acc = lax.fori_loop(0, trips, body,
                        jnp.zeros((bn, bm) if weight_left else (bm, bn), jnp.float32))
    if weight_left:
        acc = acc.T
    if scale:
        acc = acc * (s_ref[...] * INV127)  # (1, bn) f32, as int8_row_scale
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "interpret", "block_n", "block_k", "splits", "num_warps",
                     "num_stages", "weight_left"))
def int8_weight_only_splitk(x, cb, scb, *, out_dtype=None, interpret=False, block_n=None,
                            block_k=None, splits=None, num_warps=4, num_stages=3,
                            weight_left=False):
    """Small-M (M <= 64) form of `int8_weight_only` (epilogue scaling): grid (N tiles, K splits),
    each program streams its (block_n, K/splits) slice of CB once against all M rows (x padded to
    16..64 rows in registers: rows beyond M are masked in the load). With one split, SCB/127 is applied and out_dtype written in the kernel; with
    several, the fp32 partial sums are added and scaled in XLA. Same numerics class as
    `int8_weight_only(dequant="epilogue")` (different summation order).

    Defaults: 64 x 256 tiles; one split once N / 64 >= 128 tiles (a wave of programs), else ~256
    programs (chosen by measurement: docs/kernels.md). When the split count does not divide the
    K tiles the last split is shorter (CB is not padded). `weight_left` (CB tile as the MMA's
    left operand) measured slower at M <= 16; kept as an option for comparison.
    """
    check_int8_operands(x, cb, scb, what="int8_weight_only_splitk")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = cb.shape[0]
    if m > 64:
        raise ValueError(f"int8_weight_only_splitk: M={m} > 64; use int8_weight_only")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm = _clamp_block(m, 16, 64)
    bn = _check_block("block_n", block_n or _divisor_block(n, 16, 64))
    bk = _check_block("block_k", block_k or _divisor_block(k, 32, 256))
    np_ = round_up(n, bn)
    n_tiles = np_ // bn
    nk_total = -(-k // bk)
    if splits is None:
        splits = 1 if n_tiles >= 128 else max(1, min(nk_total // 2, -(-256 // n_tiles)))
    splits = int(max(1, min(int(splits), nk_total)))
    per = -(-nk_total // splits)
    splits = -(-nk_total // per)  # drop empty splits; the last may hold fewer than `per` tiles
    kp = nk_total * bk  # == K unless block_k does not divide K
    scale = splits == 1
    xp = pad2(x, m, kp)  # rows stay unpadded: the kernel masks rows >= m
    cbp = pad2(cb, np_, kp)
    s = _pad1(scb.astype(jnp.float32), np_)[None, :]
    part = pl.pallas_call(
        functools.partial(_splitk_kernel, per=per, nk=nk_total, bk=bk, m=m, scale=scale,
                          weight_left=weight_left),
        out_shape=jax.ShapeDtypeStruct((splits * bm, np_), out_dtype if scale else jnp.float32),
        grid=(n_tiles, splits),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda j, s: (0, 0)),
            pl.BlockSpec((bn, kp), lambda j, s: (j, 0)),
            pl.BlockSpec((1, bn), lambda j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda j, s: (s, j)),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="matmul_int8_splitk",
    )(xp, cbp, s)
    if scale:
        return part[:m, :n]
    acc = part.reshape(splits, bm, np_).sum(axis=0)[:m, :n]
    return (acc * int8_row_scale(scb)[None, :]).astype(out_dtype)


# ----------------------------------------------------------------------------- dx = dy @ W
def _t_kernel(dy_ref, cb_ref, s_ref, o_ref, *, nn, bn):
    bm, bk = o_ref.shape
    cdt = dy_ref.dtype
    prec = dot_precision(cdt)

    def body(j, acc):
        ns = pl.ds(pl.multiple_of(j * bn, bn), bn)
        dys = (dy_ref[:, ns].astype(jnp.float32) * s_ref[:, ns]).astype(cdt)  # (bm, bn)
        w = cb_ref[ns, :].astype(cdt)  # (bn, bk), exact
        return acc + lax.dot_general(dys, w, _NN, precision=prec,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nn, body, jnp.zeros((bm, bk), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps",
                     "num_stages"))
def int8_weight_only_t(dy, cb, scb, *, out_dtype=None, interpret=False, block_m=None, block_n=None,
                       block_k=None, num_warps=None, num_stages=3):
    """dx = dy @ W (M, K) for dy (M, N), without materializing W: each dy tile is scaled per column
    by SCB/127 in fp32 and rounded to dy.dtype, then multiplied by CB (cast to dy.dtype, exact),
    fp32 accumulation, one rounding to out_dtype (default dy.dtype). block_n is the reduction
    block (over N), block_k the output-column block (over K)."""
    check_int8_operands(dy, cb, scb, what="int8_weight_only_t", name="dy", dim=0)
    out_dtype = dy.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, n = dy.shape
    k = cb.shape[1]
    if m == 0 or k == 0:
        return jnp.zeros((m, k), out_dtype)
    bm = _check_block("block_m", block_m or _clamp_block(m, 16, 128))
    bn = _check_block("block_n", block_n or _divisor_block(n, 32, 64))
    bk = _check_block("block_k", block_k or _divisor_block(k, 16, 128))
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    dyp = pad2(dy, mp, np_)
    cbp = pad2(cb, np_, kp)
    s = jnp.pad(int8_row_scale(scb), (0, np_ - n))[None, :]
    if num_warps is None:
        num_warps = 8 if bm * bk >= 128 * 128 else 4
    out = pl.pallas_call(
        functools.partial(_t_kernel, nn=np_ // bn, bn=bn),
        out_shape=jax.ShapeDtypeStruct((mp, kp), out_dtype),
        grid=(mp // bm, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, np_), lambda i, j: (i, 0)),
            pl.BlockSpec((np_, bk), lambda i, j: (0, j)),
            pl.BlockSpec((1, np_), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="matmul_int8_t",
    )(dyp, cbp, s)
    return out[:m, :k]


# ----------------------------------------------------------------------------- large M: dense W + GEMM
def _dequant_kernel(cb_ref, scb_ref, o_ref):
    s = scb_ref[...] * INV127  # (bn, 1) f32, as int8_row_scale: no separate XLA kernel for it
    o_ref[...] = (cb_ref[...].astype(jnp.float32) * s).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k"))
def dequantize_int8(cb, scb, *, out_dtype=jnp.float32, interpret=False, block_n=32, block_k=512):
    """W_c = CB * (SCB * f32(1/127)) in fp32, one rounding to out_dtype: bit-identical to
    `dequantize_int8_reference`, as one streaming Pallas kernel (1 byte read, 2 written per weight
    for 16-bit out_dtype) that XLA cannot fuse into a consumer GEMM."""
    check_int8_weight(cb, scb, what="dequantize_int8")
    n, k = cb.shape
    if n == 0 or k == 0:
        return jnp.zeros((n, k), out_dtype)
    bn = _divisor_block(n, 16, _check_block("block_n", block_n))
    bk = _divisor_block(k, 32, _check_block("block_k", block_k))
    np_, kp = round_up(n, bn), round_up(k, bk)
    s = _pad1(scb.astype(jnp.float32), np_)[:, None]
    out = pl.pallas_call(
        _dequant_kernel,
        out_shape=jax.ShapeDtypeStruct((np_, kp), out_dtype),
        grid=(np_ // bn, kp // bk),
        in_specs=[pl.BlockSpec((bn, bk), lambda i, j: (i, j)),
                  pl.BlockSpec((bn, 1), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((bn, bk), lambda i, j: (i, j)),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="dequantize_int8",
    )(pad2(cb, np_, kp), s)
    return out[:n, :k]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def int8_dequant_dot(x, cb, scb, *, out_dtype=None, interpret=False):
    """y = x @ W.T for large M: W is written once in x.dtype (exactly the reference's W_c, by the
    `dequantize_int8` kernel), then the vendor GEMM. A separate kernel also keeps XLA from fusing
    the int8 convert into a slower generated GEMM; W lives for this call only (never a residual)."""
    check_int8_operands(x, cb, scb, what="int8_dequant_dot")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    w = dequantize_int8(cb, scb, out_dtype=x.dtype, interpret=interpret)
    return dot_out(x, w, _NT, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def int8_dequant_dot_t(dy, cb, scb, *, out_dtype=None, interpret=False):
    """dx = dy @ W for large M, as `int8_dequant_dot` (transient W, vendor GEMM)."""
    check_int8_operands(dy, cb, scb, what="int8_dequant_dot_t", name="dy", dim=0)
    out_dtype = dy.dtype if out_dtype is None else jnp.dtype(out_dtype)
    w = dequantize_int8(cb, scb, out_dtype=dy.dtype, interpret=interpret)
    return dot_out(dy, w, _NN, out_dtype)


def int8_weight_only_dq(x, cb, scb, *, out_dtype=None, interpret=False):
    return int8_weight_only(x, cb, scb, out_dtype=out_dtype, interpret=interpret, dequant="tile")


def supports(m, n, k, blocksize=None):
    return True


def supports_splitk(m, n, k, blocksize=None):
    return 0 < m <= 64


VARIANTS = (
    Variant(
        name="int8_weight_only",
        op="matmul_int8",
        fn=int8_weight_only,
        reference=matmul_int8_reference,
        supports=supports,
        description="tiled (bm,bn) x K-loop; CB tile cast to x.dtype, SCB/127 in the epilogue",
        numerics="int8_weight_only",
        status="experimental",
    ),
    Variant(
        name="int8_weight_only_dq",
        op="matmul_int8",
        fn=int8_weight_only_dq,
        reference=matmul_int8_reference,
        supports=supports,
        description="tiled; CB tile dequantized in registers (fp32 math, one rounding) like bnb",
        numerics="int8_weight_only",
        status="experimental",
    ),
    Variant(
        name="int8_weight_only_splitk",
        op="matmul_int8",
        fn=int8_weight_only_splitk,
        reference=matmul_int8_reference,
        supports=supports_splitk,
        description="M<=64: grid (N tiles, K splits), CB streamed once, fp32 partials summed",
        numerics="int8_weight_only",
        status="default",
    ),
    Variant(
        name="int8_dequant_dot",
        op="matmul_int8",
        fn=int8_dequant_dot,
        reference=matmul_int8_reference,
        supports=supports,
        description="large M: W_c written once per call (dequantize_int8 kernel), vendor GEMM",
        numerics="int8_weight_only",
        status="default",
    ),
    Variant(
        name="int8_dequant_dot_t",
        op="matmul_int8_t",
        fn=int8_dequant_dot_t,
        reference=matmul_int8_t_reference,
        supports=supports,
        description="dy @ W for large M: W_c written once per call (dequantize_int8), vendor GEMM",
        numerics="int8_weight_only",
        status="default",
    ),
    Variant(
        name="int8_weight_only_t",
        op="matmul_int8_t",
        fn=int8_weight_only_t,
        reference=matmul_int8_t_reference,
        supports=supports,
        description="dy @ W: dy columns scaled by SCB/127 in-tile, then dy_s @ CB, no W in memory",
        numerics="int8_weight_only",
        status="experimental",
    ),
)
