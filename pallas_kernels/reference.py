"""The jnp side of the kernels: reference oracles, operand checks, and the jnp steps a kernel
shares with its oracle. No Pallas here: both lowerings (`triton/`, `mosaic/`) and
`jqlora.ops.products` (the xla path of LLM.int8) import from this module, and nothing in it
needs a GPU.

4-bit layout (bitsandbytes): logical W is (N, K); `packed` is uint8 (N, K//2) holding the
row-major codes two per byte, element 2j in the HIGH nibble, 2j+1 in the LOW nibble; `absmax`
is float32 (N, K//blocksize) (already de-nested); `code` is the float32 (16,) table (NF4 or FP4).
    W[n, k] = float32(code[nibble]) * absmax[n, k // blocksize]      (fp32), then cast once.
Double-quantized ("nested") scales, for the kernels that de-nest in-kernel: `absmax` is the uint8
(N, K//blocksize) code array and nested = (nested_absmax, nested_code, offset); scale block
b = n * (K//blocksize) + c is  round(nested_code[absmax[b]] * nested_absmax[b // 256]) + offset.

int8 layout: a weight is CB int8 (N, K) plus SCB float32 (N,) (row absmax);
W ~= CB * SCB[:, None] / 127, N = out_features, K = in_features.

Each oracle names the numerics class it defines (`registry.NUMERICS`, docs/numerics.md); each
kernel module re-exports the oracles of its variants, so a kernel still sits beside its
reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NESTED_BLOCKSIZE = 256  # bitsandbytes' double-quantization block (jqlora.quant.tables)
_NT = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: a @ b.T
_NN = (((1,), (0,)), ((), ()))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# ----------------------------------------------------------------------------------------------
# 4-bit operand checks and shape support (shared by every 4-bit kernel)
# ----------------------------------------------------------------------------------------------
def supports_4bit(m: int, n: int, k: int, blocksize: int) -> bool:
    """Shapes every 4-bit kernel accepts: K even, blocksize a power of two >= 32 dividing K."""
    return (
        m >= 0 and n >= 1 and k >= 2 and k % 2 == 0
        and _is_pow2(blocksize) and blocksize >= 32 and k % blocksize == 0
    )


def check_x(x, k: int, *, what: str, name: str = "x"):
    """The activation operand of a 4-bit product: 2-D, `k` columns, a float dtype a kernel takes."""
    if x.ndim != 2:
        raise ValueError(f"{what}: `{name}` must be 2-D, got shape {x.shape}")
    if x.shape[1] != k:
        raise ValueError(f"{what}: `{name}` has {x.shape[1]} columns but the weight needs {k}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: `{name}` dtype must be float32/bfloat16/float16, got {x.dtype}")


def _check_packed(packed, blocksize: int, *, what: str) -> tuple[int, int]:
    if packed.ndim != 2:
        raise ValueError(f"{what}: `packed` must be 2-D (N, K//2) uint8, got shape {packed.shape}")
    if packed.dtype != jnp.uint8:
        raise ValueError(f"{what}: `packed` must be uint8, got {packed.dtype}")
    n, kb = packed.shape
    k = 2 * kb
    if not (_is_pow2(int(blocksize)) and blocksize >= 32):
        raise ValueError(f"{what}: blocksize must be a power of two >= 32, got {blocksize}")
    if k == 0 or k % blocksize != 0:
        raise ValueError(
            f"{what}: in_features K={k} (from packed {packed.shape}) must be a positive multiple of "
            f"blocksize={blocksize}")
    return n, k


def _check_code(code, *, what: str):
    if code.shape != (16,) or code.dtype != jnp.float32:
        raise ValueError(f"{what}: `code` must be float32 of shape (16,), got {code.dtype}{code.shape}")


def check_4bit_operands(packed, absmax, code, blocksize: int, *, what: str) -> tuple[int, int]:
    """Validate the quantized weight operands; return the logical weight shape (N, K)."""
    n, k = _check_packed(packed, blocksize, what=what)
    if absmax.shape != (n, k // blocksize):
        raise ValueError(
            f"{what}: `absmax` must have shape (N, K//blocksize) = {(n, k // blocksize)}, got "
            f"{absmax.shape} (de-nest double-quantized scales before calling)")
    if absmax.dtype != jnp.float32:
        raise ValueError(f"{what}: `absmax` must be float32, got {absmax.dtype}")
    _check_code(code, what=what)
    return n, k


def check_4bit_nested_operands(packed, absmax, code, nested, blocksize: int, *,
                               what: str) -> tuple[int, int]:
    """`check_4bit_operands` for double-quantized scales: `absmax` holds the uint8 codes and
    nested = (nested_absmax, nested_code, offset); every error names the operand."""
    n, k = _check_packed(packed, blocksize, what=what)
    _check_code(code, what=what)
    if not (isinstance(nested, (tuple, list)) and len(nested) == 3):
        got = f"{len(nested)} items" if isinstance(nested, (tuple, list)) else type(nested).__name__
        raise ValueError(f"{what}: `nested` must be (nested_absmax, nested_code, offset), got {got}")
    nblocks = n * (k // blocksize)
    expected = (
        ("absmax", absmax, (n, k // blocksize), jnp.uint8,
         "the double-quantized scale codes, bitsandbytes' flat absmax reshaped (N, K//blocksize)"),
        ("nested_absmax", nested[0], (-(-nblocks // NESTED_BLOCKSIZE),), jnp.float32,
         f"one per {NESTED_BLOCKSIZE} scales: ceil({nblocks} / {NESTED_BLOCKSIZE})"),
        ("nested_code", nested[1], (NESTED_BLOCKSIZE,), jnp.float32, "the 8-bit dynamic map"),
        ("offset", nested[2], (), jnp.float32, "a scalar"),
    )
    for name, arr, shape, dtype, why in expected:
        if jnp.shape(arr) != shape or jnp.result_type(arr) != dtype:
            raise ValueError(f"{what}: `{name}` must be {jnp.dtype(dtype).name} of shape {shape} "
                             f"({why}), got {jnp.result_type(arr)}{jnp.shape(arr)}")
    return n, k


def check_4bit_weight(packed, absmax, code, blocksize: int, nested, *, what: str):
    """`check_4bit_operands`, or `check_4bit_nested_operands` when `nested` is given."""
    if nested is None:
        return check_4bit_operands(packed, absmax, code, blocksize, what=what)
    return check_4bit_nested_operands(packed, absmax, code, nested, blocksize, what=what)


# ----------------------------------------------------------------------------------------------
# 4-bit oracles
# ----------------------------------------------------------------------------------------------
def unfused(x):
    """x, opaque to multiply-add contraction: in `unfused(a * b) + c` XLA cannot fuse an FMA (one
    rounding) where bitsandbytes rounds the product first (same trick as jqlora.quant.fourbit)."""
    return jnp.where(x == x, x, jnp.nan)


def dequantize_4bit_reference(packed, absmax, code, *, blocksize: int, out_dtype=jnp.float32,
                              interpret: bool = False):
    """Oracle: (N, K) dequantized weight, fp32 math then one cast to out_dtype. `interpret` is ignored."""
    del interpret
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="dequantize_4bit_reference")
    p = packed.astype(jnp.int32)
    q = jnp.stack([p >> 4, p & 15], axis=-1).reshape(n, k)
    vals = jnp.take(code, q, axis=0)
    scale = jnp.repeat(absmax, blocksize, axis=1)
    return (vals * scale).astype(out_dtype)


def denest_absmax_reference(codes, nested_absmax, nested_code, offset):
    """Double-quantized scales -> fp32, as bitsandbytes (and jqlora.quant.absmax_f32) de-nests
    them: round(nested_code[code] * nested_absmax[b // 256]) then + offset, two roundings, eager
    or under jit. `codes` is uint8 of any shape, flattened row-major into blocks b."""
    flat = codes.reshape(-1).astype(jnp.int32)
    block = jnp.arange(flat.shape[0]) // NESTED_BLOCKSIZE
    return (unfused(nested_code[flat] * nested_absmax[block]) + offset).reshape(codes.shape)


def matmul_4bit_reference(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                          interpret: bool = False):
    """Oracle of `rounded_weight`: dot(x, dequant(W).astype(x.dtype).T, fp32 accumulate)
    .astype(out_dtype)."""
    del interpret
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="matmul_4bit_reference")
    check_x(x, k, what="matmul_4bit_reference")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize_4bit_reference(packed, absmax, code, blocksize=blocksize, out_dtype=x.dtype)
    y = jnp.dot(x, w.T, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def matmul_4bit_t_reference(dy, packed, absmax, code, *, blocksize: int, out_dtype=None,
                            interpret: bool = False):
    """Oracle of the backward product: dot(dy, dequant(W).astype(dy.dtype), fp32 accumulate)
    .astype(out_dtype)."""
    del interpret
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what="matmul_4bit_t_reference")
    check_x(dy, n, what="matmul_4bit_t_reference", name="dy")
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    w = dequantize_4bit_reference(packed, absmax, code, blocksize=blocksize, out_dtype=dy.dtype)
    dx = jnp.dot(dy, w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return dx.astype(out_dtype)


def matmul_4bit_small_m_reference(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                                  interpret: bool = False, nested=None):
    """Same oracle as `matmul_4bit_reference`; with `nested`, the scales are de-nested first."""
    if nested is not None:
        check_4bit_nested_operands(packed, absmax, code, nested, blocksize,
                                   what="matmul_4bit_small_m_reference")
        absmax = denest_absmax_reference(absmax, *nested)
    return matmul_4bit_reference(x, packed, absmax, code, blocksize=blocksize,
                                 out_dtype=out_dtype, interpret=interpret)


def matmul_4bit_gemv_reference(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                               interpret: bool = False, nested=None):
    """Oracle of `fp32_weight`: dot(x as fp32, fp32 dequant(W).T, fp32 accumulate)
    .astype(out_dtype). For fp32 x this equals `matmul_4bit_reference`; for bf16/fp16 x that
    reference rounds each weight first, and the two differ by up to half an ulp of x's dtype per
    product (this one is the closer to the exact product)."""
    del interpret
    what = "matmul_4bit_gemv_reference"
    if nested is not None:
        check_4bit_nested_operands(packed, absmax, code, nested, blocksize, what=what)
        absmax = denest_absmax_reference(absmax, *nested)
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what=what)
    check_x(x, k, what=what)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize_4bit_reference(packed, absmax, code, blocksize=blocksize,
                                  out_dtype=jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), w.T, preferred_element_type=jnp.float32,
                precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def matmul_4bit_rounded_codes_reference(x, packed, absmax, code, *, blocksize: int,
                                        out_dtype=None, interpret: bool = False, nested=None):
    """Oracle of `rounded_codes`: `matmul_4bit_gemv_reference` with the code table rounded to
    x's dtype first (effective weight round(code) * absmax)."""
    fi = jnp.finfo(x.dtype)
    code = lax.reduce_precision(jnp.asarray(code, jnp.float32), exponent_bits=fi.nexp,
                                mantissa_bits=fi.nmant)
    return matmul_4bit_gemv_reference(x, packed, absmax, code, blocksize=blocksize,
                                      out_dtype=out_dtype, interpret=interpret, nested=nested)


def split_code_table(code, dtype, exact: bool = True):
    """Code tables in x's dtype: (hi, lo) with hi + lo = code, or (hi,) for exact=False; (code,)
    for fp32 x.

    hi is code rounded to dtype; lo is the fp32 remainder rounded to dtype. Each product x * hi
    and x * lo is exact in fp32, so two dots carry the fp32 code. The rounded table is made here
    (one tiny XLA op per call), not in-kernel: gathering fp32 codes and converting them in the
    kernel measured slower (docs/kernels.md).
    """
    code = code.astype(jnp.float32)
    if jnp.dtype(dtype) == jnp.float32:
        return (code,)
    fi = jnp.finfo(dtype)
    # reduce_precision, not a convert round trip: XLA drops f32 -> bf16 -> f32 pairs under its
    # default --xla_allow_excess_precision, which made lo = 0 on the GPU.
    hi = lax.reduce_precision(code, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if not exact:
        return (hi.astype(dtype),)
    return hi.astype(dtype), (code - hi).astype(dtype)


def matmul_4bit_block_dot_reference(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                                    interpret: bool = False, nested=None,
                                    exact_codes: bool = True):
    """Oracle: x as fp32 @ (code' [q] * absmax).T in fp32, code' = code (exact_codes) or code
    rounded to x's dtype. With exact codes this is `matmul_4bit_gemv_reference`."""
    if not exact_codes:
        return matmul_4bit_rounded_codes_reference(
            x, packed, absmax, code, blocksize=blocksize, out_dtype=out_dtype,
            interpret=interpret, nested=nested)
    return matmul_4bit_gemv_reference(x, packed, absmax, code, blocksize=blocksize,
                                      out_dtype=out_dtype, interpret=interpret, nested=nested)


def matmul_4bit_decoded_dot_reference(x, packed, absmax, code, *, blocksize: int,
                                      out_dtype=None, interpret: bool = False, nested=None,
                                      lookup: str = "prmt"):
    """Oracle of `rounded_codes_twice` (lookup="prmt"): the dense weight round(code' * absmax)
    in x's dtype (code' = code, or code rounded to x's 16-bit dtype for lookup="prmt"), then an
    fp32-accumulated dot."""
    if nested is not None:
        absmax = denest_absmax_reference(absmax, *nested)
    if lookup == "prmt" and jnp.dtype(x.dtype).itemsize == 2:
        (rounded,) = split_code_table(code, x.dtype, exact=False)
        code = rounded.astype(jnp.float32)
    return matmul_4bit_reference(x, packed, absmax, code, blocksize=blocksize,
                                 out_dtype=out_dtype, interpret=interpret)


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


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def matmul_int8_reference(x, cb, scb, *, out_dtype=None, interpret=False):
    """Oracle of `int8_weight_only`: x @ dequantize_int8_reference(cb, scb, x.dtype).T, fp32
    accumulation."""
    del interpret
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize_int8_reference(cb, scb, x.dtype)
    y = lax.dot_general(x, w, _NT, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def matmul_int8_t_reference(dy, cb, scb, *, out_dtype=None, interpret=False):
    """Oracle of the int8 backward product: dy @ dequantize_int8_reference(cb, scb, dy.dtype),
    fp32 accumulation."""
    del interpret
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    w = dequantize_int8_reference(cb, scb, dy.dtype)
    y = lax.dot_general(dy, w, _NN, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


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


# ----------------------------------------------------------------------------------------------
# grouped (mixture-of-experts) products: rows of the activation sorted by expert
# ----------------------------------------------------------------------------------------------
def check_grouped_operands(a, group_sizes, w, *, transpose_w: bool, what: str):
    """a (M, Kc) floating, group_sizes (E,) integer, w (E, N, K) with Kc = K (transpose_w: the
    forward, a @ w[e].T) or Kc = N (a @ w[e]); every error names the operand."""
    if a.ndim != 2:
        raise ValueError(f"{what}: `x` must be 2-D (M, K), got shape {a.shape}")
    if a.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: `x` dtype must be float32/bfloat16/float16, got {a.dtype}")
    if w.ndim != 3:
        raise ValueError(f"{what}: `w` must be the (E, N, K) expert stack, got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{what}: `group_sizes` must be integer of shape ({w.shape[0]},), got "
                         f"{group_sizes.dtype}{group_sizes.shape}")
    kc = w.shape[2] if transpose_w else w.shape[1]
    if a.shape[1] != kc:
        raise ValueError(f"{what}: `x` has {a.shape[1]} columns but the expert stack {w.shape} needs {kc}")


def check_grouped_4bit_operands(a, group_sizes, packed, absmax, code, blocksize: int, *,
                                transpose_w: bool, what: str) -> tuple[int, int, int]:
    """The 4-bit expert stack: packed (E, N, K//2) uint8, absmax (E, N, K//blocksize) float32,
    code (16,); returns (E, N, K)."""
    if packed.ndim != 3 or packed.dtype != jnp.uint8:
        raise ValueError(f"{what}: `packed` must be uint8 (E, N, K//2), got {packed.dtype}{packed.shape}")
    e, n, kb = packed.shape
    k = 2 * kb
    if not (_is_pow2(int(blocksize)) and blocksize >= 32) or k % blocksize:
        raise ValueError(f"{what}: blocksize {blocksize} must be a power of two >= 32 dividing K={k}")
    if absmax.shape != (e, n, k // blocksize) or absmax.dtype != jnp.float32:
        raise ValueError(f"{what}: `absmax` must be float32 of shape (E, N, K//blocksize) = "
                         f"{(e, n, k // blocksize)}, got {absmax.dtype}{absmax.shape}")
    _check_code(code, what=what)
    check_grouped_operands(a, group_sizes, jax.ShapeDtypeStruct((e, n, k), a.dtype),
                           transpose_w=transpose_w, what=what)
    return e, n, k


@functools.partial(jax.jit, static_argnums=(1, 2))
def grouped_tiles(group_sizes, m: int, block_m: int):
    """The tile schedule of a grouped kernel over M sorted rows: int32 (3, T) rows (group,
    first row, end row) for T = cdiv(M, block_m) + E - 1 tiles (a static bound: each of the E - 1
    group boundaries splits at most one row block). Tile t covers rows [first, end) of `group`,
    all inside row block first // block_m; tiles past the schedule are empty (first == end == 0,
    group 0). Empty groups get no tile; rows past sum(group_sizes) (clipped to M) none either."""
    e = group_sizes.shape[0]
    num = -(-m // block_m) + e - 1
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.minimum(ends - gs, ends)
    starts = jnp.maximum(starts, 0)
    first_block = starts // block_m
    last_block = (ends - 1) // block_m
    count = jnp.where(ends > starts, last_block - first_block + 1, 0)
    cum = jnp.cumsum(count)
    t = jnp.arange(num, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, t, side="right"), e - 1).astype(jnp.int32)
    block = first_block[group] + t - (cum[group] - count[group])
    lo = jnp.maximum(starts[group], block * block_m)
    hi = jnp.minimum(ends[group], block * block_m + block_m)
    valid = t < cum[-1]
    lo, hi = jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)
    return jnp.stack([jnp.where(valid, group, 0), lo, hi]).astype(jnp.int32)


@jax.jit
def zero_rows_past_groups(y, group_sizes):
    """y with the rows at or past sum(group_sizes) set to zero (kernels leave them unwritten)."""
    total = jnp.sum(group_sizes.astype(jnp.int32))
    rows = lax.broadcasted_iota(jnp.int32, y.shape, 0)
    return jnp.where(rows < total, y, jnp.zeros((), y.dtype))


_RAGGED_NT = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_RAGGED_NN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _ragged(a, group_sizes, w, transpose_w: bool, out_dtype):
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    y = lax.ragged_dot_general(a, w, group_sizes.astype(jnp.int32), _RAGGED_NT if transpose_w else _RAGGED_NN,
                               precision=prec, preferred_element_type=jnp.float32)
    return y.astype(a.dtype if out_dtype is None else out_dtype)


def grouped_matmul_reference(x, group_sizes, w, *, out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul`: y[rows of e] = x[rows of e] @ w[e].T (w (E, N, K) used as
    given, in x's dtype), fp32 sums, one rounding to out_dtype; rows past sum(group_sizes) 0."""
    del interpret
    check_grouped_operands(x, group_sizes, w, transpose_w=True, what="grouped_matmul_reference")
    return _ragged(x, group_sizes, w.astype(x.dtype), True, out_dtype)


def grouped_matmul_t_reference(dy, group_sizes, w, *, out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_t`: y[rows of e] = dy[rows of e] @ w[e] (the backward dx)."""
    del interpret
    check_grouped_operands(dy, group_sizes, w, transpose_w=False, what="grouped_matmul_t_reference")
    return _ragged(dy, group_sizes, w.astype(dy.dtype), False, out_dtype)


def _dequantize_stack(packed, absmax, code, blocksize, dtype):
    e = packed.shape[0]
    return jax.vmap(lambda p, a: dequantize_4bit_reference(p, a, code, blocksize=blocksize, out_dtype=dtype)
                    )(packed, absmax).reshape(e, packed.shape[1], 2 * packed.shape[2])


def grouped_matmul_4bit_reference(x, group_sizes, packed, absmax, code, *, blocksize: int,
                                  out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_4bit` (`rounded_weight`): each expert dequantized (fp32 math,
    one rounding to x's dtype), then `grouped_matmul_reference`."""
    del interpret
    check_grouped_4bit_operands(x, group_sizes, packed, absmax, code, blocksize, transpose_w=True,
                                what="grouped_matmul_4bit_reference")
    w = _dequantize_stack(packed, absmax, code, blocksize, x.dtype)
    return _ragged(x, group_sizes, w, True, out_dtype)


def grouped_matmul_4bit_t_reference(dy, group_sizes, packed, absmax, code, *, blocksize: int,
                                    out_dtype=None, interpret: bool = False):
    """Oracle of `grouped_matmul_4bit_t`: dy[rows of e] @ dequant(W_e) in dy's dtype."""
    del interpret
    check_grouped_4bit_operands(dy, group_sizes, packed, absmax, code, blocksize, transpose_w=False,
                                what="grouped_matmul_4bit_t_reference")
    w = _dequantize_stack(packed, absmax, code, blocksize, dy.dtype)
    return _ragged(dy, group_sizes, w, False, out_dtype)
