"""`llm_int8_tiled`: LLM.int8() inference matmul with bitsandbytes' numerics (`MatMul8bitLt` eval
forward), Pallas (Triton lowering). Its jnp half (activation quantization, epilogue) and its
oracle `llm_int8_matmul_reference` are in `pallas_kernels.reference.int8`; the numerics of both:

bitsandbytes 0.50.2, default/CPU ops (`backends/default/ops.py`):
1. A16 = x.astype(float16) (MatMul8bitLt casts before quantizing).
2. `int8_vectorwise_quant(A16, threshold)`:
   - threshold > 0: outlier elements |A16| >= threshold are zeroed before the row absmax;
     outlier_cols = columns holding any outlier.
   - SCA[r] = max_c |A16[r, c]| (float32); CA = round_half_even(A16.f32 * (127 / SCA[r])) int8,
     where torch computes 127 / SCA as fp32 (1 / SCA) * 127 (reproduced: it decides .5 ties).
   - rows > 1: whole outlier columns are zeroed in CA (rows == 1: only the outlier elements, which
     are then exactly the outlier columns, so a column mask is the same thing).
3. acc = CA @ CB.T in int32.
4. `int8_mm_dequant`: out = acc.f32 * (SCA[:, None] * SCB[None, :]) * c (+ bias, float32 add),
   then cast to x.dtype. c = 6.200124e-05 in the default/CPU op (a typo of 1/127**2, ~1.8e-5
   relative too large); the CUDA kernel uses 1/16129 = 6.2000124e-05 (`CUDA_DEQUANT_CONSTANT`)
   and writes float16 first, then casts (`fp16_first=True` emulates that; the CUDA kernel's
   fused-bias rounding is not reproduced exactly).
5. threshold > 0 and any outliers (`int8_mixed_scaled_mm`):
   out = out.addmm(subA, subB), subA = x[:, cols] in x's own dtype (not fp16),
   subB = ((CB[:, cols] * SCB) * f32(1/127)).astype(x.dtype).T  (int8-dequantized weight).
   The reference (XLA) gathers too, into cap = `outlier_capacity` slots (default min(K, 256)) so
   shapes stay static: `jnp.nonzero(cols, size=cap)` gives cap column indices (ascending, padded
   with column 0), x[:, idx] with the padding slots zeroed and CB[:, idx] dequantized as above,
   one (M, cap) x (cap, N) fp32 product; padding slots add exact zeros. If cap < K, a `lax.cond`
   falls back to the dense masked product x_masked @ subB_full.T (x zeroed outside the outlier
   columns, the whole weight dequantized) when the layer has more than cap outlier columns:
   always correct, only slower. Both sum the same nonzero terms; fp32 summation order may differ
   (a few fp32 ulps of the outlier product). On GPU, XLA's conditional (ConditionalThunk, outside
   command buffers) copies its predicate to the host and waits for it, a stream sync per call
   that device time hides.
   The Pallas kernel keeps the dense mask (see below).
   The addition is done as one fp32 add of the rounded int8 part and the fp32 outlier product,
   then one rounding to x.dtype.
The result is finally cast to `out_dtype` (bnb returns x.dtype).

Bias: `Linear8bitLt` casts bias to x.dtype first; `llm_int8_tiled(bias=...)` does the same.

Agreement with bnb 0.50.2 on CPU (tests/kernels/test_kernels_int8.py): for fp16/bf16 x, bitwise in the
cases tested, and at most 1 ulp of the output dtype. XLA (CPU) and Triton may contract the
epilogue's multiply + bias add into an FMA where torch rounds twice, and fp32 sums (int8 -> fp32
conversion, outlier product) run in another order, so fp32 outputs differ by a few fp32 ulps.

Activation quantization is plain jnp (`quantize_activations_llm_int8`); the Pallas kernel does the
int8 x int8 -> int32 GEMM (K loop over int8 tiles), the dequant epilogue, and (threshold > 0) the
outlier product with the CB tile dequantized in registers. Variant "llm_int8_tiled" computes the
16-bit outlier product for every K tile; "llm_int8_tiled_skip" skips K tiles that hold no outlier
column (a `lax.cond` on a per-tile flag).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference.int8 import (
    CPU_DEQUANT_CONSTANT, CUDA_DEQUANT_CONSTANT, INV127, check_int8_operands, llm_int8_bias,
    llm_int8_epilogue, llm_int8_matmul_reference, quantize_activations_llm_int8)
from pallas_kernels.triton.matmul_int8 import (
    dot_precision, output_tiles, pad2, round_up, triton_params)
from pallas_kernels.registry import Variant

__all__ = [
    "CPU_DEQUANT_CONSTANT",
    "CUDA_DEQUANT_CONSTANT",
    "llm_int8_tiled",
    "llm_int8_tiled_skip",
    "reference",
    "VARIANTS",
]

reference = llm_int8_matmul_reference

_NT = (((1,), (1,)), ((), ()))


# ----------------------------------------------------------------------------- kernel
def _llm_int8_kernel(*refs, nk, bk, c, has_outliers, skip, fp16_first, x_dtype):
    if has_outliers:
        ca_ref, sca_ref, cb_ref, scbr_ref, bias_ref, xo_ref, scbc_ref, flag_ref, o_ref = refs
    else:
        ca_ref, sca_ref, cb_ref, scbr_ref, bias_ref, o_ref = refs
    bm, bn = o_ref.shape

    def outlier_part(acc_f, cbt, ks):
        # bnb int8_vectorwise_dequant: (CB * SCB) * f32(1/127), then .to(x.dtype)
        w = ((cbt.astype(jnp.float32) * scbc_ref[...]) * INV127).astype(x_dtype)
        return acc_f + lax.dot_general(xo_ref[:, ks], w, _NT, precision=dot_precision(x_dtype),
                                       preferred_element_type=jnp.float32)

    def body(k, carry):
        acc_i, acc_f = carry
        ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
        cbt = cb_ref[:, ks]  # (bn, bk) int8
        acc_i = acc_i + lax.dot_general(ca_ref[:, ks], cbt, _NT,
                                        preferred_element_type=jnp.int32)
        if has_outliers:
            if skip:
                acc_f = lax.cond(flag_ref[k] != 0,
                                 lambda a: outlier_part(a, cbt, ks), lambda a: a, acc_f)
            else:
                acc_f = outlier_part(acc_f, cbt, ks)
        return acc_i, acc_f

    acc_i = jnp.zeros((bm, bn), jnp.int32)
    acc_f = jnp.zeros((bm, bn), jnp.float32) if has_outliers else None
    acc_i, acc_f = lax.fori_loop(0, nk, body, (acc_i, acc_f))
    main = acc_i.astype(jnp.float32) * (sca_ref[...] * scbr_ref[...])  # (bm,1)*(1,bn)
    main = main * jnp.float32(c) + bias_ref[...]
    o_ref[...] = llm_int8_epilogue(main, acc_f, x_dtype, o_ref.dtype, fp16_first)


@functools.partial(
    jax.jit,
    static_argnames=("threshold", "out_dtype", "interpret", "dequant_constant", "fp16_first",
                     "skip_clean_tiles", "block_m", "block_n", "block_k", "num_warps",
                     "num_stages"))
def llm_int8_tiled(x, cb, scb, *, threshold=0.0, out_dtype=None, interpret=False, bias=None,
                   dequant_constant=CPU_DEQUANT_CONSTANT, fp16_first=False,
                   skip_clean_tiles=False, block_m=None, block_n=None, block_k=None,
                   num_warps=None, num_stages=3):
    """LLM.int8() y = x @ W.T for x (M, K) float, cb (N, K) int8, scb (N,) float32.

    Reproduces bitsandbytes' `MatMul8bitLt` eval forward (default/CPU ops; see module docstring).
    threshold: static float; 0 = no outlier decomposition (bnb Linear8bitLt default), 6.0 is
    transformers' default. bias: optional (N,), cast to x.dtype first as Linear8bitLt does.
    dequant_constant: the CPU op's 6.200124e-05 by default; CUDA_DEQUANT_CONSTANT for the CUDA op.
    fp16_first: round the int8 part to float16 before x.dtype, as the CUDA op does.
    skip_clean_tiles: skip the 16-bit outlier product on K tiles without outlier columns.
    Output dtype: out_dtype (default x.dtype).
    """
    check_int8_operands(x, cb, scb, what="llm_int8_tiled")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = cb.shape[0]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = output_tiles(m, n, k, block_m, block_n, block_k)
    if bk < 32:
        raise ValueError(f"llm_int8_tiled: block_k={bk} must be >= 32 for int8 tiles")
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    nk = kp // bk

    ca, sca, cols = quantize_activations_llm_int8(x, threshold)
    scb32 = scb.astype(jnp.float32)
    bias32 = llm_int8_bias(bias, x.dtype, n, what="llm_int8_tiled")
    args = [
        pad2(ca, mp, kp),
        jnp.pad(sca, (0, mp - m))[:, None],
        pad2(cb, np_, kp),
        jnp.pad(scb32, (0, np_ - n))[None, :],
        jnp.pad(bias32, (0, np_ - n))[None, :],
    ]
    specs = [
        pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
        pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
        pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
        pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        pl.BlockSpec((1, bn), lambda i, j: (0, j)),
    ]
    has_outliers = threshold > 0.0
    if has_outliers:
        colsp = jnp.pad(cols, (0, kp - k))
        xo = jnp.where(cols[None, :], x, jnp.zeros((), x.dtype))
        flags = jnp.any(colsp.reshape(nk, bk), axis=1).astype(jnp.int32)
        args += [pad2(xo, mp, kp), jnp.pad(scb32, (0, np_ - n))[:, None], flags]
        specs += [
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, 1), lambda i, j: (j, 0)),
            pl.BlockSpec((nk,), lambda i, j: (0,)),
        ]
    kernel = functools.partial(_llm_int8_kernel, nk=nk, bk=bk, c=float(dequant_constant),
                               has_outliers=has_outliers, skip=skip_clean_tiles,
                               fp16_first=fp16_first, x_dtype=x.dtype)
    if num_warps is None:
        num_warps = 8 if bm * bn >= 128 * 128 else 4
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="llm_int8_matmul",
    )(*args)
    return out[:m, :n]


def llm_int8_tiled_skip(x, cb, scb, *, threshold, out_dtype=None, interpret=False, **kw):
    return llm_int8_tiled(x, cb, scb, threshold=threshold, out_dtype=out_dtype,
                          interpret=interpret, skip_clean_tiles=True, **kw)


def supports(m, n, k, blocksize=None):
    return True


VARIANTS = (
    Variant(
        name="llm_int8_tiled",
        op="llm_int8",
        fn=llm_int8_tiled,
        reference=llm_int8_matmul_reference,
        supports=supports,
        description="bnb LLM.int8: jnp row quant; int8xint8->int32 tiles; fp16 outlier mask product",
        numerics="llm_int8",
        status="default",  # backend="pallas" with llm_int8 numerics
    ),
    Variant(
        name="llm_int8_tiled_skip",
        op="llm_int8",
        fn=llm_int8_tiled_skip,
        reference=llm_int8_matmul_reference,
        supports=supports,
        description="llm_int8_tiled, skipping the 16-bit product on K tiles with no outlier column",
        numerics="llm_int8",
        status="experimental",
    ),
)
