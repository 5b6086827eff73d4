"""The 4-bit (NF4/FP4) family's jnp side: operand checks, shape support, oracles, and the code
tables the kernels look up in x's dtype.

Layout (bitsandbytes): logical W is (N, K); `packed` is uint8 (N, K//2) holding the row-major
codes two per byte, element 2j in the HIGH nibble, 2j+1 in the LOW nibble; `absmax` is float32
(N, K//blocksize) (already de-nested); `code` is the float32 (16,) table (NF4 or FP4).
    W[n, k] = float32(code[nibble]) * absmax[n, k // blocksize]      (fp32), then cast once.
Double-quantized ("nested") scales, for the kernels that de-nest in-kernel: `absmax` is the uint8
(N, K//blocksize) code array and nested = (nested_absmax, nested_code, offset); scale block
b = n * (K//blocksize) + c is  round(nested_code[absmax[b]] * nested_absmax[b // 256]) + offset.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

NESTED_BLOCKSIZE = 256  # bitsandbytes' double-quantization block (jqlora.quant.tables)


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# ----------------------------------------------------------------------------------------------
# 4-bit operand checks and shape support (shared by every 4-bit kernel)
# ----------------------------------------------------------------------------------------------
def supports_4bit(m: int, n: int, k: int, blocksize: int) -> bool:
    """Shapes every 4-bit kernel accepts: K even, blocksize a power of two >= 32 dividing K."""
    return (
        m >= 0 and n >= 1 and k >= 2 and k % 2 == 0
        and is_pow2(blocksize) and blocksize >= 32 and k % blocksize == 0
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
    if not (is_pow2(int(blocksize)) and blocksize >= 32):
        raise ValueError(f"{what}: blocksize must be a power of two >= 32, got {blocksize}")
    if k == 0 or k % blocksize != 0:
        raise ValueError(
            f"{what}: in_features K={k} (from packed {packed.shape}) must be a positive multiple of "
            f"blocksize={blocksize}")
    return n, k


def check_code(code, *, what: str):
    """The code table operand: float32 of shape (16,)."""
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
    check_code(code, what=what)
    return n, k


def check_4bit_nested_operands(packed, absmax, code, nested, blocksize: int, *,
                               what: str) -> tuple[int, int]:
    """`check_4bit_operands` for double-quantized scales: `absmax` holds the uint8 codes and
    nested = (nested_absmax, nested_code, offset); every error names the operand."""
    n, k = _check_packed(packed, blocksize, what=what)
    check_code(code, what=what)
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
# FP8 (E4M3) weights for the optional FP8 base products (jqlora.ops.fp8)
# ----------------------------------------------------------------------------------------------
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def saturate_to_fp8(v):
    """float32 values as float8_e4m3fn, clipped to +-448 first: e4m3fn has no infinity, and a
    value that rounds past 448 converts to NaN on XLA's CPU (the GPU's cvt saturates)."""
    return jnp.clip(v, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def check_fp8_row_scales(inv_scale, n: int, *, what: str):
    """The per-row reciprocal scale operand of the FP8 dequant: float32 (N,)."""
    if inv_scale.shape != (n,) or inv_scale.dtype != jnp.float32:
        raise ValueError(f"{what}: `inv_scale` must be float32 of shape (N,) = ({n},) (448 / the "
                         f"row's bound), got {inv_scale.dtype}{inv_scale.shape}")


def dequantize_4bit_fp8_reference(packed, absmax, code, inv_scale, *, blocksize: int,
                                  transpose: bool = False, interpret: bool = False):
    """Oracle of the FP8 dequant: the fp32 weight code * absmax (as `dequantize_4bit_reference`),
    times the row's reciprocal scale inv_scale[n] in fp32, clipped to +-448 and cast to
    float8_e4m3fn; (N, K), or its transpose (K, N) with `transpose`. `interpret` is ignored."""
    del interpret
    what = "dequantize_4bit_fp8_reference"
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what=what)
    check_fp8_row_scales(inv_scale, n, what=what)
    w = dequantize_4bit_reference(packed, absmax, code, blocksize=blocksize, out_dtype=jnp.float32)
    w8 = saturate_to_fp8(w * inv_scale[:, None])
    return w8.T if transpose else w8
