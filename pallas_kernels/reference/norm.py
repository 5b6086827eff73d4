"""The decoding rows' residual add and RMSNorm, in jnp: the oracle of `pallas_kernels.triton.rms_norm`.

A decoder layer adds a product's output to the residual stream and normalises the sum before the
next product. The product may hand over its K splits' float32 partials (S, M, N) unsummed; the
sum is then rounded once to the activations' dtype, as the product itself would round it.

Numerics ("rms_norm", as `jqlora.models.llama.RMSNorm` and transformers): r = round(x + round(sum
of the partials)); h = r * rsqrt(mean(r^2) + eps) in float32; kind "llama" rounds h, then
multiplies by the weight in the activations' dtype; kind "gemma" multiplies by (1 + weight) in
float32 and rounds once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NORM_KINDS = ("llama", "gemma")


def check_rms_norm_operands(x, delta, weight, kind: str, *, what: str):
    """x (M, N) floating; delta None, (M, N) or (S, M, N) partials; weight (N,). Errors name the operand."""
    if kind not in NORM_KINDS:
        raise ValueError(f"{what}: unknown norm kind {kind!r}; expected one of {NORM_KINDS}")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what}: `x` must be a floating (rows, features) array, got {x.dtype} {x.shape}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{what}: `weight` must be ({x.shape[1]},), got {weight.shape}")
    if delta is not None and (delta.ndim not in (2, 3) or tuple(delta.shape[-2:]) != x.shape):
        raise ValueError(f"{what}: `delta` must be {x.shape} or (splits, *{x.shape}), got {delta.shape}")


def summed(delta, dtype):
    """A product's output in the activations' dtype: its partials (S, M, N) summed, rounded once."""
    if delta.ndim == 3:
        return jnp.sum(delta.astype(jnp.float32), axis=0).astype(dtype)
    return delta.astype(dtype)


def rms_norm_reference(x, delta, weight, *, eps: float, kind: str = "llama"):
    """-> (r, normed): r = x + delta (x itself when delta is None), both in x's dtype."""
    check_rms_norm_operands(x, delta, weight, kind, what="rms_norm_reference")
    r = x if delta is None else (x + summed(delta, x.dtype)).astype(x.dtype)
    h = r.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if kind == "gemma":
        return r, (h * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return r, weight.astype(x.dtype) * h.astype(x.dtype)
