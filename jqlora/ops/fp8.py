"""The optional FP8 base products (`qmatmul(..., numerics="fp8")`): a frozen 4-bit weight's two
products on float8_e4m3fn operands, scaled per row (docs/numerics.md, "FP8 base products").

    forward   y  = (q(x) @ W8.T) * sx[:, None] * sw[None, :]
    backward  dx = (q(dy * sw[None, :]) @ W8) * sg[:, None]

q(a) quantizes each row of `a` to E4M3 with the scale s = rowmax|a| / 448 (`quantize_rows`); W8 =
e4m3(W / sw) with sw[n] = the row's bound / 448, where the bound (`weight_row_bound`) comes from
the 4-bit scales without decoding: |W[n, k]| = |code| * absmax <= max|code| * (the largest
absmax of the blocks row n touches). The dots accumulate in float32; the output is rounded once
to the compute dtype.

The weight stays packed: each product decodes it again (a transient W8, never a residual), as
the compute-dtype path does. On the kernel backends the decode is the `dequant_fp8` kernel and,
for the backward, `dequant_fp8_t`, which writes W8 transposed (K, N): cuBLASLt's FP8 GEMM takes
K-major operands only, and an XLA transpose of W8 costs more than FP8 saves. On the xla backend
the jnp reference decodes; XLA's CPU runs the f8 x f8 dot itself (fp8 values are exact in f32,
the sums are float32).

Only the frozen 4-bit base products use this: the LoRA branch and frozen dense weights stay in
the compute dtype. Below `FP8_MIN_ROWS` rows (generation, small batches) `qmatmul` runs the
compute-dtype product: a decode of the whole weight per call gains nothing over a GEMV there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jqlora.ops.dispatch import Plan
from jqlora.ops.products import after, kernel_operands_4bit
from jqlora.quant import Weight4bit, absmax_f32, dequantize
from pallas_kernels.reference.fourbit import FP8_MAX, saturate_to_fp8

# Fewest rows (per device) an FP8 product runs at; below, qmatmul keeps the compute-dtype product.
# On an H200 FP8 was slower at 256 rows and faster at 2,048 (benchmarks/results/latest/h200_fp8.md);
# the crossover between is not measured.
FP8_MIN_ROWS = 256
_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b.T: both operands K-major, the layout the FP8 GEMM takes
# Precision of the two FP8 dots. On an H200 (benchmarks/results/JOURNAL.md, 2026-11-28) DEFAULT
# (cuBLASLt's fast accumulation) and HIGHEST gave the same error against float32 at the 8B step's
# shapes (3.7% forward, 3.8% dx: the E4M3 rounding of the operands dominates) and DEFAULT was
# 3-9% faster.
DOT_PRECISION = jax.lax.Precision.DEFAULT


def _safe(bound):
    """A row bound with zero rows (all-zero weights or activations) taken as FP8_MAX: scale 1."""
    return jnp.where(bound > 0, bound, jnp.asarray(FP8_MAX, _F32))


def quantize_rows(a):
    """(e4m3 rows, scale (M,) float32): a[m, :] * (448 / rowmax|a[m, :]|) in float32, clipped and
    cast; scale = rowmax / 448, so a ~= q * scale[:, None]."""
    a = a.astype(_F32)
    bound = _safe(jnp.max(jnp.abs(a), axis=1))
    return saturate_to_fp8(a * (FP8_MAX / bound)[:, None]), bound / FP8_MAX


def weight_row_bound(q: Weight4bit):
    """(N,) float32: max|code| times the largest absmax of the scale blocks row n touches, an
    upper bound of |W[n, :]| read from the scales alone. Blocks run over the row-major flattened
    weight; a block that spans two rows (K not a multiple of the blocksize) counts for both."""
    n, k = q.shape
    absmax = absmax_f32(q)
    if k % q.blocksize == 0:
        per_row = absmax.reshape(n, k // q.blocksize).max(axis=1)
    else:
        first = (jnp.arange(n) * k) // q.blocksize  # the blocks of row n: first .. last
        last = ((jnp.arange(n) + 1) * k - 1) // q.blocksize
        span = (k - 1) // q.blocksize + 2  # most blocks one row touches
        blocks = first[:, None] + jnp.arange(span)[None, :]
        per_row = jnp.where(blocks <= last[:, None], absmax[jnp.minimum(blocks, absmax.shape[0] - 1)],
                            0.0).max(axis=1)
    return per_row * jnp.max(jnp.abs(q.code.astype(_F32)))


def weight_row_scales(q: Weight4bit):
    """(sw, inv_sw), both (N,) float32: sw = bound / 448 (1 for an all-zero row), inv_sw = 448 / bound."""
    bound = _safe(weight_row_bound(q))
    return bound / FP8_MAX, FP8_MAX / bound


def fp8_weight(plan: Plan, q: Weight4bit, inv_sw, *, transpose: bool):
    """W8 = e4m3(W * inv_sw[:, None]), (N, K), or (K, N) with `transpose`: the `dequant_fp8` /
    `dequant_fp8_t` kernel on the kernel backends, the jnp reference on xla."""
    if plan.backend == "xla":
        w8 = saturate_to_fp8(dequantize(q, _F32) * inv_sw[:, None])
        return w8.T if transpose else w8
    from pallas_kernels import registry

    kernel = registry.get("dequant_fp8_t" if transpose else "dequant_fp8").fn
    packed, absmax = kernel_operands_4bit(q)
    return kernel(packed, absmax, q.code, inv_sw, blocksize=q.blocksize, interpret=plan.interpret)


def check_fp8_weight(q) -> None:
    if not isinstance(q, Weight4bit):
        what = type(q).__name__ if not hasattr(q, "dtype") else f"a dense {q.dtype} array"
        raise ValueError(f"numerics='fp8' applies to 4-bit weights (Weight4bit) only, got {what}; "
                         "8-bit and dense frozen weights use numerics='weight_only'")


def forward_fp8(plan: Plan, x, q: Weight4bit, *, out_dtype):
    """y = (q(x) @ W8.T) * sx * sw, (M, K) x (N, K) -> (M, N) in out_dtype."""
    x, q = after(x, q)
    sw, inv_sw = weight_row_scales(q)
    xq, sx = quantize_rows(x)
    w8 = fp8_weight(plan, q, inv_sw, transpose=False)
    acc = jax.lax.dot_general(xq, w8, _NT, precision=DOT_PRECISION, preferred_element_type=_F32)
    return (acc * sx[:, None] * sw[None, :]).astype(out_dtype)


def backward_fp8(plan: Plan, dy, q: Weight4bit, *, out_dtype):
    """dx = (q(dy * sw) @ W8) * sg, (M, N) x (N, K) -> (M, K) in out_dtype; W8 decoded again,
    transposed (K, N), so the dot contracts two K-major operands."""
    dy, q = after(dy, q)
    sw, inv_sw = weight_row_scales(q)
    gq, sg = quantize_rows(dy.astype(_F32) * sw[None, :])
    w8t = fp8_weight(plan, q, inv_sw, transpose=True)
    acc = jax.lax.dot_general(gq, w8t, _NT, precision=DOT_PRECISION, preferred_element_type=_F32)
    return (acc * sg[:, None]).astype(out_dtype)
