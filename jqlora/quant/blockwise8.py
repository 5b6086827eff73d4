"""8-bit blockwise quantization with the dynamic map: bitsandbytes' double quantization of absmax."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jqlora.quant.tables import dynamic_map


def bucketize(x: jax.Array, code: jax.Array) -> jax.Array:
    """Index of the nearest entry of the sorted `code`; exact ties go to the lower index.

    Same rule as torch.bucketize on the fp32 midpoints (what bitsandbytes' default op does):
    code k is chosen when mid[k-1] < x <= mid[k].
    """
    bounds = (code[:-1] + code[1:]) / 2
    return jnp.searchsorted(bounds, x, side="left", method="scan").astype(jnp.int32)


def blockwise_scale(x: jax.Array, blocksize: int):
    """Split flat fp32 `x` into blocks, return (absmax (nb,), scaled in [-1, 1] padded to nb*bs).

    Full blocks multiply by the fp32 reciprocal of absmax; a short last block divides by it,
    exactly as bitsandbytes' default op does, so both give the same bits. Two XLA behaviours are
    kept out of the way: an all-zero block scales to 0 explicitly (bitsandbytes clamps absmax at
    1e-38, a subnormal that XLA flushes to zero, which would give 0 * inf = NaN), and the
    division is fenced so the simplifier cannot turn it into a (1-ulp-off) reciprocal multiply.
    Weights beyond ~8.5e37 or below ~1.2e-38 (fp32 subnormals) are not reproduced bit for bit.
    """
    n = x.shape[0]
    nb = -(-n // blocksize)
    rem = n % blocksize
    blocks = jnp.pad(x, (0, nb * blocksize - n)).reshape(nb, blocksize)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    nonzero = (absmax > 0)[:, None]
    safe = jnp.where(nonzero, absmax[:, None], jnp.float32(1.0))
    scaled = blocks * (jnp.float32(1.0) / safe)
    if rem:
        denom = jax.lax.optimization_barrier(jnp.broadcast_to(safe[-1:], blocks[-1:].shape))
        scaled = jnp.concatenate([scaled[:-1], blocks[-1:] / denom], axis=0)
    scaled = jnp.where(nonzero, scaled, jnp.float32(0.0))
    return absmax, jnp.clip(scaled, -1.0, 1.0).reshape(-1)


def quantize_blockwise(x: jax.Array, blocksize: int = 256, code: jax.Array | None = None):
    """Quantize flat fp32 `x` to uint8 codes of the dynamic map; returns (codes (n,), absmax (nb,))."""
    code = jnp.asarray(dynamic_map() if code is None else code, jnp.float32)
    n = x.shape[0]
    absmax, scaled = blockwise_scale(x.astype(jnp.float32), blocksize)
    return bucketize(scaled[:n], code).astype(jnp.uint8), absmax


def dequantize_blockwise(codes: jax.Array, absmax: jax.Array, code: jax.Array, blocksize: int = 256) -> jax.Array:
    """fp32 values code[q] * absmax[i // blocksize], as bitsandbytes computes them."""
    n = codes.shape[0]
    idx = jnp.arange(n) // blocksize
    return code[codes.astype(jnp.int32)] * absmax[idx]
