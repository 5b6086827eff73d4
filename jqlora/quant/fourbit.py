"""Reference NF4/FP4 quantize and dequantize in pure JAX, bit-exact with bitsandbytes.

These are the oracles for the kernels and the fallback on machines without a GPU.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jqlora.quant.blockwise8 import blockwise_scale, dequantize_blockwise, quantize_blockwise
from jqlora.quant.tables import BLOCKSIZES_4BIT, NESTED_BLOCKSIZE, QUANT_TYPES, code_4bit, dynamic_map
from jqlora.quant.weights import STORED_DTYPES, Weight4bit


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _codes_for(scaled: jax.Array, quant_type: str) -> jax.Array:
    """4-bit code of each scaled value: nearest table entry, ties to the lower value."""
    table = code_4bit(quant_type)
    order = np.argsort(table, kind="stable")  # fp4 is unsorted; +0 sorts before -0, like torch
    sorted_table = table[order]
    bounds = (sorted_table[:-1] + sorted_table[1:]) / np.float32(2)
    pos = jnp.zeros(scaled.shape, jnp.int32)
    for b in bounds:  # 15 compares: pos = #bounds < x  (== torch.bucketize, right=False)
        pos = pos + (scaled > b).astype(jnp.int32)
    if quant_type == "nf4":
        return pos.astype(jnp.uint8)
    return jnp.asarray(order.astype(np.uint8))[pos]


def quantize_4bit(
    w: jax.Array,
    quant_type: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = True,
) -> Weight4bit:
    """Quantize `w` (any shape; a linear weight is (out, in)) the way bitsandbytes does.

    Blocks run over the row-major flattened tensor (a block may span rows); the packed bytes and
    fp32 absmax equal bitsandbytes'. With double quantization, absmax - mean(absmax) is quantized
    with the 8-bit dynamic map in blocks of 256 (nested codes may differ from bitsandbytes' CPU
    kernel by one at near-ties: it uses a lookup table, this uses the exact nearest entry).
    Compiled once per (shape, dtype, format); callable under jit too.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown quant_type {quant_type!r}; expected one of {QUANT_TYPES}")
    if blocksize not in BLOCKSIZES_4BIT:
        raise ValueError(f"blocksize {blocksize} not allowed; expected one of {BLOCKSIZES_4BIT}")
    return _quantize_4bit_jit(jnp.asarray(w), quant_type, blocksize, bool(double_quant))


def _quantize_4bit_impl(w: jax.Array, quant_type: str, blocksize: int, double_quant: bool) -> Weight4bit:
    """The traced body of `quantize_4bit` (arguments already checked there)."""
    w = jnp.asarray(w)
    if _dtype_name(w.dtype) not in STORED_DTYPES:
        raise ValueError(f"4-bit quantization takes float16/bfloat16/float32, got {w.dtype}")
    shape = tuple(int(d) for d in w.shape)
    n = math.prod(shape)
    if n == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {shape}")
    absmax, scaled = blockwise_scale(w.reshape(-1).astype(jnp.float32), blocksize)
    codes = _codes_for(scaled[: n + n % 2], quant_type)  # odd n: the pad element is 0.0
    packed = (codes[0::2] << 4) | codes[1::2]
    common = dict(
        packed=packed,
        code=jnp.asarray(code_4bit(quant_type)),
        shape=shape,
        quant_type=quant_type,
        blocksize=blocksize,
        stored_dtype=_dtype_name(w.dtype),
    )
    if not double_quant:
        return Weight4bit(absmax=absmax, **common)
    # the stored offset must be the one subtracted: XLA computes the mean as sum * (1 / n) and,
    # unfenced, contracts that product into the subtraction (one rounding), so the nested stats
    # described an offset up to an ulp away from the stored one (70 of 300 random weights)
    offset = _unfused(jnp.mean(absmax))
    qabsmax, nested_absmax = quantize_blockwise(absmax - offset, NESTED_BLOCKSIZE)
    return Weight4bit(
        absmax=qabsmax,
        nested_absmax=nested_absmax,
        nested_code=jnp.asarray(dynamic_map()),
        offset=offset,
        **common,
    )


def _unfused(x: jax.Array) -> jax.Array:
    """x, but opaque to multiply-add contraction. Under jit, XLA fuses `a * b + c` into one FMA
    (one rounding), while bitsandbytes rounds the product first; a select between the product and
    the add keeps the two roundings (an optimization barrier or reduce_precision does not)."""
    return jnp.where(x == x, x, jnp.nan)


_quantize_4bit_jit = jax.jit(_quantize_4bit_impl, static_argnums=(1, 2, 3))


def absmax_f32(q: Weight4bit) -> jax.Array:
    """The per-block fp32 scales; de-nests double-quantized absmax as bitsandbytes does:
    round(dyn[code] * nested_absmax) then + offset, two roundings, eager or under jit."""
    if not q.nested:
        return q.absmax
    return _unfused(dequantize_blockwise(q.absmax, q.nested_absmax, q.nested_code, NESTED_BLOCKSIZE)) + q.offset


def unpack_codes(packed: jax.Array, n: int) -> jax.Array:
    """uint8 bytes -> n 4-bit codes (element 2j from the high nibble)."""
    return jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)[:n]


def dequantize_4bit(q: Weight4bit, dtype=jnp.float32) -> jax.Array:
    """Dense weight of logical shape `q.shape`: code[nibble] * absmax (fp32), one rounding to dtype."""
    n, bs, nb = q.numel, q.blocksize, q.nblocks
    vals = q.code[unpack_codes(q.packed, n).astype(jnp.int32)]
    vals = jnp.pad(vals, (0, nb * bs - n)).reshape(nb, bs) * absmax_f32(q)[:, None]
    return vals.reshape(-1)[:n].reshape(q.shape).astype(dtype)
