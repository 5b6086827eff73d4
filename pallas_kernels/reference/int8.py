"""The int8 family's jnp side: operand checks and oracles of the weight-only product and of
LLM.int8() (activation quantization, epilogue, outlier product).

Layout: a weight is CB int8 (N, K) plus SCB float32 (N,) (row absmax);
W ~= CB * SCB[:, None] / 127, N = out_features, K = in_features.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_NT = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: a @ b.T
_NN = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------------------------
# int8 operand checks and weight-only oracles
# ----------------------------------------------------------------------------------------------
# float32(1/127): bnb's 1.0/127.0 and 7.874015718698502e-3 are both this value in fp32.
INV127 = np.float32(1.0 / 127.0)


def check_int8_weight(cb, scb, *, what: str):
    """The int8 weight operands: CB int8 (N, K), SCB of shape (N,)."""
    if cb.ndim != 2 or cb.dtype != jnp.int8:
        raise ValueError(f"{what}: cb must be int8 of shape (N, K), got {cb.dtype} {cb.shape}")
    if scb.shape != (cb.shape[0],):
        raise ValueError(f"{what}: scb must have shape ({cb.shape[0]},), got {scb.shape}")


def check_int8_operands(x, cb, scb, *, what: str, name: str = "x", dim: int = 1):
    """The operands of an int8 product: `x` (named `name`) 2-D floating point, with as many
    columns as CB's dimension `dim` (1: y = x @ W.T; 0: dx = dy @ W), and the weight."""
    if x.ndim != 2:
        raise ValueError(f"{what}: {name} must be 2-D, got shape {x.shape}")
    check_int8_weight(cb, scb, what=what)
    if x.shape[1] != cb.shape[dim]:
        raise ValueError(
            f"{what}: {name} has {x.shape[1]} columns but cb has shape {cb.shape} "
            f"(expected dim {dim} to match)")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: {name} must be floating point, got {x.dtype}")


def int8_row_scale(scb):
    """SCB * f32(1/127) in float32, as bitsandbytes' `SCB.mul(1.0 / 127.0)`."""
    return scb.astype(jnp.float32) * INV127


def dequantize_int8_reference(cb, scb, dtype=jnp.float32):
    """W = CB * (SCB * f32(1/127)) in fp32, one rounding to `dtype` (bnb `MatMul8bitFp` / backward)."""
    w = cb.astype(jnp.float32) * int8_row_scale(scb)[:, None]
    return w.astype(dtype)


def dequantize_int8_vectorwise_reference(cb, scb, dtype=jnp.float32):
    """W = (CB * SCB) * f32(1/127) in fp32, then `dtype` (bnb `int8_vectorwise_dequant` + cast)."""
    w = (cb.astype(jnp.float32) * scb.astype(jnp.float32)[:, None]) * INV127
    return w.astype(dtype)


def _dequantized_product(a, cb, scb, dims, out_dtype):
    """a times W = dequantize_int8_reference(cb, scb, a.dtype), contracted by `dims` (_NT:
    a @ W.T, _NN: a @ W), fp32 accumulation, then out_dtype (None: a's dtype)."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    w = dequantize_int8_reference(cb, scb, a.dtype)
    y = lax.dot_general(a, w, dims, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def matmul_int8_reference(x, cb, scb, *, out_dtype=None, interpret=False):
    """Oracle of `int8_weight_only`: x @ dequantize_int8_reference(cb, scb, x.dtype).T, fp32
    accumulation."""
    del interpret
    return _dequantized_product(x, cb, scb, _NT, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def matmul_int8_t_reference(dy, cb, scb, *, out_dtype=None, interpret=False):
    """Oracle of the int8 backward product: dy @ dequantize_int8_reference(cb, scb, dy.dtype),
    fp32 accumulation."""
    del interpret
    return _dequantized_product(dy, cb, scb, _NN, out_dtype)


# ----------------------------------------------------------------------------------------------
# LLM.int8(): activation quantization, epilogue and oracle (numerics: triton/llm_int8_tiled.py)
# ----------------------------------------------------------------------------------------------
CPU_DEQUANT_CONSTANT = 6.200124e-05  # bnb default/CPU int8_mm_dequant
CUDA_DEQUANT_CONSTANT = 1.0 / 16129.0  # ~6.200012e-05 (bnb CUDA kernel: 1/127**2)


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


def llm_int8_bias(bias, x_dtype, n, *, what: str):
    """The (N,) fp32 bias of the LLM.int8 epilogue: zeros, or `bias` rounded to x's dtype first
    as `Linear8bitLt` does."""
    if bias is None:
        return jnp.zeros((n,), jnp.float32)
    if bias.shape != (n,):
        raise ValueError(f"{what}: bias must have shape ({n},), got {bias.shape}")
    # fenced: XLA GPU drops an f32 -> x.dtype -> f32 round trip under excess precision (seen on
    # an H200: the bias kept its fp32 bits, up to half an ulp of x.dtype off bitsandbytes)
    return lax.optimization_barrier(bias.astype(x_dtype)).astype(jnp.float32)


def llm_int8_epilogue(main_f32, outlier_f32, x_dtype, out_dtype, fp16_first, fence=lambda a: a):
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
    """Oracle of `llm_int8` (bitsandbytes' `MatMul8bitLt` eval forward; the same numerics as the
    `llm_int8_tiled` kernel, XLA int8 dot).

    outlier_capacity: static slot count of the gathered 16-bit outlier product (threshold > 0);
    None = min(K, 256). More outlier columns than that fall back to the dense masked product
    (triton/llm_int8_tiled.py module docstring, step 5)."""
    del interpret
    check_int8_operands(x, cb, scb, what="llm_int8_matmul_reference")
    cap = _outlier_capacity(x.shape[1], outlier_capacity)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    ca, sca, cols = quantize_activations_llm_int8(x, threshold)
    acc = lax.dot_general(ca, cb, _NT, preferred_element_type=jnp.int32)
    main = acc.astype(jnp.float32) * (sca[:, None] * scb.astype(jnp.float32)[None, :])
    bias32 = llm_int8_bias(bias, x.dtype, cb.shape[0], what="llm_int8_matmul_reference")
    main = main * jnp.float32(dequant_constant) + bias32[None]
    outl = None
    if threshold > 0.0:
        gathered = functools.partial(_outlier_product_gathered, cap=cap)
        if cap >= x.shape[1]:  # every column fits: no fallback needed
            outl = gathered(x, cols, cb, scb)
        else:
            outl = lax.cond(jnp.sum(cols, dtype=jnp.int32) <= cap, gathered,
                            _outlier_product_dense, x, cols, cb, scb)
    return llm_int8_epilogue(main, outl, x.dtype, out_dtype, fp16_first,
                             fence=lax.optimization_barrier)
