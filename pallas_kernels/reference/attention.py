"""The cached-decoding attention family's jnp side: one new query token per row attending to a
layer's keys and values inside the whole KV cache.

The cache holds every layer: k, v (L, B, S, kvh, d). A decoding step has written the new token's
key and value at slot `index` of row `layer` before it attends. A key slot s of batch row b is
seen when s <= index, its segment equals the query's (k_seg[b, s] == q_seg[b]), it was written
(k_seg[b, s] != 0) and, with a sliding window, index - s < window: the mask
`jqlora.models.attention.attention_mask` builds for one query at slot `index`. Query head n uses
kv head n // (h / kvh).

Numerics ("online_softmax"): scores in float32 from the operands widened to float32, scaled,
soft-capped (cap * tanh(s / cap)) and masked; a float32 softmax; the unrounded float32
probabilities weight v in float32; the output is rounded once. The model's einsum path
(transformers' numerics) rounds the probabilities to the activations' dtype before they weight v;
the two agree to that rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_decode_attention_operands(q, k_cache, v_cache, q_seg, k_seg, *, what: str):
    """q (B, h, d); k_cache, v_cache (L, B, S, kvh, d) with h a multiple of kvh; q_seg (B,) and
    k_seg (B, S) integer. Every error names the operand."""
    if q.ndim != 3:
        raise ValueError(f"{what}: `q` must be (B, heads, head_dim), got shape {q.shape}")
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{what}: `k_cache` and `v_cache` must both be (layers, B, S, kv_heads, head_dim), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    _, b, s, kvh, d = k_cache.shape
    if q.shape[0] != b or q.shape[2] != d or q.shape[1] % kvh:
        raise ValueError(f"{what}: `q` {q.shape} does not fit the cache {k_cache.shape}: it needs batch {b}, "
                         f"head_dim {d} and a multiple of {kvh} heads")
    if q_seg.shape != (b,) or k_seg.shape != (b, s):
        raise ValueError(f"{what}: `q_seg` must be ({b},) and `k_seg` ({b}, {s}), got {q_seg.shape} and "
                         f"{k_seg.shape}")
    for name, a in (("q_seg", q_seg), ("k_seg", k_seg)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{what}: `{name}` must be integer, got {a.dtype}")


def decode_mask(index, q_seg, k_seg, window):
    """(B, S) bool: the key slots the query at slot `index` sees (module docstring)."""
    s = jnp.arange(k_seg.shape[1], dtype=jnp.int32)[None, :]
    idx = jnp.asarray(index, jnp.int32)
    m = (s <= idx) & (k_seg == q_seg[:, None]) & (k_seg != 0)
    if window is not None:
        m = m & (idx - s < window)
    return m


def decode_attention_reference(q, k_cache, v_cache, layer, index, q_seg, k_seg, *, scale: float,
                               cap: float | None = None, window: int | None = None, out_dtype=None):
    """(B, h, d): attention of q over row `layer` of the cache, numerics "online_softmax"."""
    check_decode_attention_operands(q, k_cache, v_cache, q_seg, k_seg, what="decode_attention_reference")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    b, h, d = q.shape
    kvh = k_cache.shape[3]
    k = jax.lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False).astype(jnp.float32)  # (B, S, kvh, d)
    v = jax.lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k, precision=jax.lax.Precision.HIGHEST) * jnp.float32(scale)
    if cap is not None:
        scores = jnp.tanh(scores / cap) * cap
    mask = decode_mask(index, q_seg, k_seg, window)[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)  # a row that sees no key gives zeros
    out = jnp.einsum("bkgs,bskd->bkgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, h, d).astype(out_dtype)
