"""LLM.int8 row-wise weight quantization (bitsandbytes' Int8Params), reference in pure JAX."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jqlora.quant.weights import Int8Weight

# bitsandbytes multiplies by this constant instead of dividing by 127 (int8_vectorwise_dequant).
INV_127 = 7.874015718698502e-3


def torch_style_inverse_127(s: jax.Array) -> jax.Array:
    """torch's `127.0 / s` for s holding float16 values: fp32 reciprocal, then * 127 (two IEEE
    roundings). This value decides exact .5 ties of the codes, and XLA's GPU value of it can
    differ from torch's in the last bit, so it is looked up in a table of all 2**16 float16
    values computed by numpy's IEEE float32 (the same table as
    `pallas_kernels.reference.int8.torch_inverse_127_of_f16`; this package imports no kernels)."""
    table_in = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        table = (np.float32(1.0) / table_in) * np.float32(127.0)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(s).astype(jnp.float16), jnp.uint16)
    return jnp.asarray(table)[bits.astype(jnp.int32)]


def quantize_int8(w: jax.Array, threshold: float = 0.0) -> Int8Weight:
    """Quantize a (out, in) weight like bitsandbytes: cast to float16 first, then per row
    SCB = max|w|, CB = round_half_even(w * (127 / SCB)). An all-zero row gives CB = 0
    (bitsandbytes leaves that case undefined)."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"int8 quantization takes a 2-D (out, in) weight, got shape {w.shape}")
    # fenced: XLA's excess-precision rule may otherwise drop the float16 rounding inside a fusion
    w16 = jax.lax.optimization_barrier(w.astype(jnp.float16)).astype(jnp.float32)
    scb = jnp.max(jnp.abs(w16), axis=1)
    # torch evaluates 127.0 / SCB as reciprocal(SCB) * 127: one more rounding, which decides
    # exact .5 ties; copy it so CB matches bitsandbytes bit for bit (each rounding fenced).
    inv = torch_style_inverse_127(scb)
    scaled = w16 * inv[:, None]
    cb = jnp.where(scb[:, None] > 0, jnp.round(scaled), 0.0).astype(jnp.int8)
    return Int8Weight(cb=cb, scb=scb, threshold=float(threshold), stored_dtype=np.dtype(w.dtype).name)


def dequantize_int8(q: Int8Weight, dtype=jnp.float32) -> jax.Array:
    """CB * SCB * (1/127) in fp32, then one rounding to dtype (as transformers/PEFT dequantize)."""
    return (q.cb.astype(jnp.float32) * q.scb[:, None] * jnp.float32(INV_127)).astype(dtype)
