"""Quantized weights (NF4/FP4 4-bit, LLM.int8) as JAX pytrees, with reference quantize/dequantize."""
from __future__ import annotations

import jax.numpy as jnp

from jqlora.quant.experts import ExpertWeights, dequantize_experts, quantize_experts
from jqlora.quant.fourbit import absmax_f32, dequantize_4bit, quantize_4bit, unpack_codes
from jqlora.quant.int8 import dequantize_int8, quantize_int8
from jqlora.quant.tables import BLOCKSIZES_4BIT, QUANT_TYPES, code_4bit, dynamic_map, fp4_code, nf4_code
from jqlora.quant.weights import Int8Weight, Weight4bit

QuantizedWeight = Weight4bit | Int8Weight


def dequantize(q, dtype=jnp.bfloat16):
    """Dense (out, in) weight in `dtype` for a Weight4bit or an Int8Weight (a plain array is cast)."""
    if isinstance(q, Weight4bit):
        return dequantize_4bit(q, dtype)
    if isinstance(q, Int8Weight):
        return dequantize_int8(q, dtype)
    if hasattr(q, "dtype") and hasattr(q, "shape"):
        return jnp.asarray(q).astype(dtype)
    raise TypeError(f"dequantize takes a Weight4bit, an Int8Weight or an array, got {type(q).__name__}")


__all__ = [
    "Weight4bit", "Int8Weight", "QuantizedWeight", "quantize_4bit", "quantize_int8", "dequantize",
    "dequantize_4bit", "dequantize_int8", "absmax_f32", "unpack_codes", "nf4_code", "fp4_code",
    "code_4bit", "dynamic_map", "QUANT_TYPES", "BLOCKSIZES_4BIT",
    "ExpertWeights", "quantize_experts", "dequantize_experts",
]
