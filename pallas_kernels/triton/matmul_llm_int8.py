"""LLM.int8() inference matmul with bitsandbytes' numerics (`MatMul8bitLt` eval forward).

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

Bias: `Linear8bitLt` casts bias to x.dtype first; `llm_int8_matmul(bias=...)` does the same.

Agreement with bnb 0.50.2 on CPU (tests/test_kernels_int8.py): for fp16/bf16 x, bitwise in the
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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.triton.matmul_int8 import (
    INV127,
    _output_tiles,
    _pad2,
    _precision,
    _round_up,
    _triton_params,
    dequantize_int8_vectorwise_reference,
)
from pallas_kernels.registry import Variant

__all__ = [
    "CPU_DEQUANT_CONSTANT",
    "CUDA_DEQUANT_CONSTANT",
    "quantize_activations_llm_int8",
    "torch_inverse_127_of_f16",
    "llm_int8_matmul",
    "llm_int8_matmul_reference",
    "VARIANTS",
]

CPU_DEQUANT_CONSTANT = 6.200124e-05  # bnb default/CPU int8_mm_dequant
CUDA_DEQUANT_CONSTANT = 1.0 / 16129.0  # ~6.200012e-05 (bnb CUDA kernel: 1/127**2)
_NT = (((1,), (1,)), ((), ()))


def torch_inverse_127_of_f16(s16):
    """torch's `127.0 / s` for float16 values s, as float32, correctly rounded on every backend.

    torch (CPU) evaluates it as fp32 reciprocal(s) * 127, two IEEE roundings, and the result
    decides exact .5 ties of the codes. Computed by XLA on an H200 (even fenced), it differed
    from torch's in the last bit: one code of 26,000 came out off by one (x * 127 / s == -63.5
    in real arithmetic). s holds one of 2**16 float16 values, so the answer is a table lookup,
    computed by numpy's IEEE float32 at trace time.
    (Written twice on purpose, also in `jqlora.quant.int8`: pallas_kernels imports nothing of
    ours; tests hold both to torch bit for bit.)"""
    s = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        table = (np.float32(1.0) / s) * np.float32(127.0)
    bits = lax.bitcast_convert_type(s16.astype(jnp.float16), jnp.uint16).astype(jnp.int32)
    return jnp.asarray(table)[bits]


def quantize_activations_llm_int8(x, threshold: float = 0.0):
    """bnb `int8_vectorwise_quant(x.astype(float16), threshold)` with outliers as a column mask.

    Returns (ca int8 (M, K), sca float32 (M,), outlier_cols bool (K,)). `outlier_cols` is all
    False when threshold <= 0. Rows whose (non-outlier) absmax is 0 give CA = 0 (bnb computes
    127/0 there; its output for such a row is 0 * acc = 0 either way).
    """
    # Fenced: with XLA's default --xla_allow_excess_precision, a GPU fusion may drop the
    # rounding of an fp32 x to float16 (x.astype(f16).astype(f32) -> x), and then CA differs
    # from torch's (seen on an H200 with fp32 x).
    a = lax.optimization_barrier(x.astype(jnp.float16))
    absa = jnp.abs(a)
    if threshold > 0.0:
        outl = absa >= jnp.float16(threshold)
        cols = jnp.any(outl, axis=0)
        a = jnp.where(outl, jnp.float16(0), a)
        absa = jnp.where(outl, jnp.float16(0), absa)
    else:
        cols = jnp.zeros((x.shape[1],), jnp.bool_)
    amax = jnp.max(absa, axis=1) if x.shape[1] else jnp.zeros((x.shape[0],), jnp.float16)
    sca = amax.astype(jnp.float32)
    inv = torch_inverse_127_of_f16(amax)
    q = jnp.round(a.astype(jnp.float32) * inv[:, None])  # round half to even, like torch.round
    q = jnp.where((sca > 0)[:, None], q, 0.0)
    ca = q.astype(jnp.int8)
    if threshold > 0.0:
        ca = jnp.where(cols[None, :], jnp.int8(0), ca)
    return ca, sca, cols


def _prepare_bias(bias, x_dtype, n):
    if bias is None:
        return jnp.zeros((n,), jnp.float32)
    if bias.shape != (n,):
        raise ValueError(f"llm_int8_matmul: bias must have shape ({n},), got {bias.shape}")
    # fenced: XLA GPU drops an f32 -> x.dtype -> f32 round trip under excess precision (seen on
    # an H200: the bias kept its fp32 bits, up to half an ulp of x.dtype off bitsandbytes)
    return lax.optimization_barrier(bias.astype(x_dtype)).astype(jnp.float32)


def _check_inputs(name, x, cb, scb):
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be 2-D, got shape {x.shape}")
    if cb.ndim != 2 or cb.dtype != jnp.int8:
        raise ValueError(f"{name}: cb must be int8 of shape (N, K), got {cb.dtype} {cb.shape}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"{name}: scb must have shape ({cb.shape[0]},), got {scb.shape}")
    if x.shape[1] != cb.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but cb has shape {cb.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: x must be floating point, got {x.dtype}")


def _finish(main_f32, outlier_f32, x_dtype, out_dtype, fp16_first, fence=lambda a: a):
    """main (fp32, incl. bias) -> [fp16] -> x.dtype; + outlier product (fp32) -> x.dtype -> out.

    `fence` keeps each intermediate rounding in XLA (the reference passes an optimization
    barrier: with excess precision allowed, a GPU fusion may skip rounding y to x.dtype before
    the outlier add, 1-4 ulp off bitsandbytes; Triton keeps the roundings by itself)."""
    if fp16_first:
        main_f32 = fence(main_f32.astype(jnp.float16))
    y = fence(main_f32.astype(x_dtype))
    if outlier_f32 is not None:
        y = fence((y.astype(jnp.float32) + outlier_f32).astype(x_dtype))
    return y.astype(out_dtype)


# ----------------------------------------------------------------------------- reference
# Default gather capacity: LLM.int8() outliers sit in few, systematic feature dimensions
# (Dettmers et al. 2022 find those of a 6.7B model in about 6 hidden dimensions). bnb's criterion
# (any |x| >= threshold in any row of the batch) also counts sporadic ones, hence the margin; 256
# slots keep the gathered product small (at K = 4096, 1/16 of the dense one). A layer with more
# outlier columns takes the dense fallback, correct and only slower.
_DEFAULT_OUTLIER_CAPACITY = 256


def _outlier_capacity(k: int, outlier_capacity) -> int:
    """Static slot count for the gathered outlier product (clamped to K: more slots than columns
    can never be filled)."""
    if outlier_capacity is None:
        return min(k, _DEFAULT_OUTLIER_CAPACITY)
    if isinstance(outlier_capacity, bool) or not isinstance(outlier_capacity, (int, np.integer)):
        raise ValueError(
            f"llm_int8_matmul_reference: outlier_capacity must be an int >= 1 or None, got "
            f"{outlier_capacity!r}")
    if outlier_capacity < 1:
        raise ValueError(
            f"llm_int8_matmul_reference: outlier_capacity must be >= 1, got {outlier_capacity}")
    return min(k, int(outlier_capacity))


def _outlier_weight(cb, scb, dtype):
    # fenced: at M = 1 XLA GPU fuses the weight into a reduction and skips its rounding to
    # x.dtype (seen on an H200); bitsandbytes multiplies by the x.dtype weight
    return lax.optimization_barrier(dequantize_int8_vectorwise_reference(cb, scb, dtype))


def _outlier_product_dense(x, cols, cb, scb):
    """x (zeroed outside the outlier columns) @ the whole dequantized weight.T, fp32 (M, N)."""
    xo = jnp.where(cols[None, :], x, jnp.zeros((), x.dtype))
    return lax.dot_general(xo, _outlier_weight(cb, scb, x.dtype), _NT,
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _outlier_product_gathered(x, cols, cb, scb, cap):
    """x[:, idx] @ dequant(CB[:, idx]).T over the first `cap` outlier columns, fp32 (M, N).
    Exact only when the layer has <= cap outlier columns (the caller checks)."""
    idx = jnp.nonzero(cols, size=cap, fill_value=0)[0]
    live = jnp.arange(cap) < jnp.sum(cols, dtype=jnp.int32)  # padding slots point at column 0
    # idx is in range by construction: "clip" skips the out-of-bounds masking of "fill".
    # Fenced: unfenced, XLA:CPU (jax 0.10.2) lays the gather out transposed and hands the
    # bf16 x bf16 -> f32 dot to a DotThunk that rejects it (UNIMPLEMENTED at run time).
    xg = jnp.where(live[None, :], jnp.take(x, idx, axis=1, mode="clip"), jnp.zeros((), x.dtype))
    xg = lax.optimization_barrier(xg)
    wg = _outlier_weight(jnp.take(cb, idx, axis=1, mode="clip"), scb, x.dtype)
    return lax.dot_general(xg, wg, _NT, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


@functools.partial(
    jax.jit, static_argnames=("threshold", "out_dtype", "interpret", "dequant_constant",
                              "fp16_first", "outlier_capacity"))
def llm_int8_matmul_reference(x, cb, scb, *, threshold=0.0, out_dtype=None, interpret=False,
                              bias=None, dequant_constant=CPU_DEQUANT_CONSTANT,
                              fp16_first=False, outlier_capacity=None):
    """jnp oracle for `llm_int8_matmul` (same numerics, XLA int8 dot).

    outlier_capacity: static slot count of the gathered 16-bit outlier product (threshold > 0);
    None = min(K, 256). More outlier columns than that fall back to the dense masked product
    (module docstring, step 5)."""
    del interpret
    _check_inputs("llm_int8_matmul_reference", x, cb, scb)
    cap = _outlier_capacity(x.shape[1], outlier_capacity)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    ca, sca, cols = quantize_activations_llm_int8(x, threshold)
    acc = lax.dot_general(ca, cb, _NT, preferred_element_type=jnp.int32)
    main = acc.astype(jnp.float32) * (sca[:, None] * scb.astype(jnp.float32)[None, :])
    main = main * jnp.float32(dequant_constant) + _prepare_bias(bias, x.dtype, cb.shape[0])[None]
    outl = None
    if threshold > 0.0:
        gathered = functools.partial(_outlier_product_gathered, cap=cap)
        if cap >= x.shape[1]:  # every column fits: no fallback needed
            outl = gathered(x, cols, cb, scb)
        else:
            outl = lax.cond(jnp.sum(cols, dtype=jnp.int32) <= cap, gathered,
                            _outlier_product_dense, x, cols, cb, scb)
    return _finish(main, outl, x.dtype, out_dtype, fp16_first, fence=lax.optimization_barrier)


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
        return acc_f + lax.dot_general(xo_ref[:, ks], w, _NT, precision=_precision(x_dtype),
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
    o_ref[...] = _finish(main, acc_f, x_dtype, o_ref.dtype, fp16_first)


@functools.partial(
    jax.jit,
    static_argnames=("threshold", "out_dtype", "interpret", "dequant_constant", "fp16_first",
                     "skip_clean_tiles", "block_m", "block_n", "block_k", "num_warps",
                     "num_stages"))
def llm_int8_matmul(x, cb, scb, *, threshold=0.0, out_dtype=None, interpret=False, bias=None,
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
    _check_inputs("llm_int8_matmul", x, cb, scb)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m, k = x.shape
    n = cb.shape[0]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = _output_tiles(m, n, k, block_m, block_n, block_k)
    if bk < 32:
        raise ValueError(f"llm_int8_matmul: block_k={bk} must be >= 32 for int8 tiles")
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    nk = kp // bk

    ca, sca, cols = quantize_activations_llm_int8(x, threshold)
    scb32 = scb.astype(jnp.float32)
    bias32 = _prepare_bias(bias, x.dtype, n)
    args = [
        _pad2(ca, mp, kp),
        jnp.pad(sca, (0, mp - m))[:, None],
        _pad2(cb, np_, kp),
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
        args += [_pad2(xo, mp, kp), jnp.pad(scb32, (0, np_ - n))[:, None], flags]
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
        compiler_params=_triton_params(num_warps, num_stages),
        interpret=interpret,
        name="llm_int8_matmul",
    )(*args)
    return out[:m, :n]


def _llm_int8_skip(x, cb, scb, *, threshold, out_dtype=None, interpret=False, **kw):
    return llm_int8_matmul(x, cb, scb, threshold=threshold, out_dtype=out_dtype,
                           interpret=interpret, skip_clean_tiles=True, **kw)


def _supports_all(m, n, k, blocksize=None):
    return True


VARIANTS = (
    Variant(
        name="llm_int8_tiled",
        op="llm_int8",
        fn=llm_int8_matmul,
        reference=llm_int8_matmul_reference,
        supports=_supports_all,
        description="bnb LLM.int8: jnp row quant; int8xint8->int32 tiles; fp16 outlier mask product",
        numerics="llm_int8",
        status="default",  # backend="pallas" with llm_int8 numerics
    ),
    Variant(
        name="llm_int8_tiled_skip",
        op="llm_int8",
        fn=_llm_int8_skip,
        reference=llm_int8_matmul_reference,
        supports=_supports_all,
        description="llm_int8_tiled, skipping the 16-bit product on K tiles with no outlier column",
        numerics="llm_int8",
        status="experimental",
    ),
)
