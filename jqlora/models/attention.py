"""The attention of the decoder layers as functions of arrays: RoPE tables and their application
(llama3 scaling, LongRoPE, partial rotary), positions inside packed segments, soft-capping, the
boolean mask (causal, same segment, sliding window), the sliding layers' ring-buffer cache, and
`attend`, which runs one of `ATTENTION_IMPLS`. The layer (`jqlora.models.llama.Attention`) owns
the projections, the q/k norms and the whole-sequence KV cache writes, and calls these.

Numerics follow transformers: RoPE cos/sin computed in float32 and cast to the compute dtype
(rotate_half convention); the einsum path accumulates scores in float32 and takes a float32
softmax (Gemma 2: soft-capped before the mask).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import jqlora.models.packed_attention as packed_attention
from jqlora.models.config import ModelConfig, longrope_switch, rope_attention_scaling, rope_inv_freq


_MASK_VALUE = float(np.finfo(np.float32).min)

ATTENTION_IMPLS = ("einsum", "xla", "cudnn")


def rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_cos_sin(config: ModelConfig, positions: jax.Array, dtype, per_row: bool = False):
    """cos, sin of shape (B, T, rotary_dim) for integer positions (B, T); fp32 math, then dtype.
    LongRoPE (Phi-3) takes its long table when the call's largest position + 1 exceeds
    original_max_position_embeddings, as transformers decides per forward call; per_row: each
    row decides by its own largest position (each row as if it ran alone)."""
    inv = jnp.asarray(rope_inv_freq(config))
    switch = longrope_switch(config)
    if switch is not None:
        top = jnp.max(positions, axis=-1, keepdims=True)[..., None] if per_row else jnp.max(positions)
        inv = jnp.where(top + 1 > switch, jnp.asarray(rope_inv_freq(config, long=True)), inv)
    freqs = positions.astype(jnp.float32)[..., None] * inv  # (B, T, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    s = rope_attention_scaling(config)
    return (jnp.cos(emb) * s).astype(dtype), (jnp.sin(emb) * s).astype(dtype)


def apply_rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin on the first cos.shape[-1] features of x (all of them unless
    the rotary is partial, Phi-4-mini); the rest pass unchanged."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr = x[..., :rd]
    return jnp.concatenate([xr * cos + rotate_half(xr) * sin, x[..., rd:]], axis=-1)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its (contiguous) segment: 0, 1, ... restarting per segment."""
    t = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=segment_ids.ndim - 1)
    return idx - start_idx


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's attention and final-logit soft-capping); x when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def attention_mask(q_slots, k_slots, q_seg, k_seg, window: Optional[int]):
    """Boolean (B, T, S): causal by slot, same nonzero segment, inside the sliding window."""
    qs = q_slots[:, :, None]
    ks = k_slots[:, None, :]
    m = (ks <= qs) & (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] != 0)
    if window is not None:
        m = m & (qs - ks < window)
    return m


def attend(q, k, v, q_slots, k_slots, q_seg, k_seg, *, scale: float, cap: Optional[float],
           window: Optional[int], dtype, impl: str = "einsum", plain_causal: bool = False, runs=None):
    """Attention of queries q (B, T, h, d) over keys and values k, v (B, S, kvh, d) -> (B, T, h * d).
    impl "einsum": `einsum_attention`; "xla" / "cudnn": `fused_attention` (which ignores dtype).
    Query head n uses kv head n // (h / kvh), like HF's repeat_kv."""
    if impl == "einsum":
        return einsum_attention(q, k, v, q_slots, k_slots, q_seg, k_seg, scale=scale, cap=cap, window=window,
                                dtype=dtype)
    return fused_attention(q, k, v, q_slots, k_slots, q_seg, k_seg, scale=scale, cap=cap, window=window,
                           impl=impl, plain_causal=plain_causal, runs=runs)


def einsum_attention(q, k, v, q_slots, k_slots, q_seg, k_seg, *, scale: float, cap: Optional[float],
                     window: Optional[int], dtype):
    """Scores materialized in float32 (scaled, soft-capped, then masked by `attention_mask`), a
    float32 softmax, probabilities cast to dtype (the activations') before they weight v. The
    path of prefill with a cache and of cached decoding where the `decode_attention` kernel does
    not run (`jqlora.ops.cached_attention`); the only forward path with soft-capping."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = softcap(scores * jnp.float32(scale), cap)
    mask = attention_mask(q_slots, k_slots, q_seg, k_seg, window)[:, None, None]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h * d)


def fused_attention(q, k, v, q_slots, k_slots, q_seg, k_seg, *, scale: float, cap: Optional[float],
                    window: Optional[int], impl: str, plain_causal: bool, runs=None):
    """jax.nn.dot_product_attention: cuDNN flash attention on a GPU ("cudnn"), or its XLA
    version ("xla"), which tests use to check this wiring on CPU. Without packing (plain_causal),
    a plain causal mask (nothing materialized); with packing, the same boolean mask as the einsum
    path.

    is_causal is set in both cases: that mask is causal already (same segment and key slot <=
    query slot), and the flag lets cuDNN skip the key tiles above the diagonal, which it
    would otherwise compute and then mask. With `runs` (cuDNN, packed rows, no sliding
    window shorter than the row) there is no mask at all: `packed_attention`."""
    b, t, h, d = q.shape
    if cap is not None:  # CausalLM refuses this at build time; a guard
        raise ValueError(f"attention {impl!r} has no soft-capping; this model needs attention='einsum'")
    if runs is not None and (window is None or window >= t):
        out = packed_attention.packed_causal_attention(q, k, v, q_seg, runs, scale=scale)
        return out.reshape(b, t, h * d)
    local = None if window is None else (window - 1, 0)
    mask = None if plain_causal else attention_mask(q_slots, k_slots, q_seg, k_seg, window)[:, None]
    if impl == "cudnn" and t % 2 == 1 and k.shape[1] == t:  # cuDNN's backward refuses an odd length
        q, k, v, mask = pad_to_even_length(q, k, v, mask)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                       local_window_size=local if plain_causal else None,
                                       implementation=impl)
    return out[:, :t].reshape(b, t, h * d)


def pad_to_even_length(q, k, v, mask):
    """q, k, v (B, T, ., d) and a boolean mask (B, 1, T, T) or None (causal only) with one slot
    more (T + 1), sliced off after: the added key comes after every real query (causal) and is
    masked for it; the added query sees its own key at least (a row with no key would give NaN,
    and NaN times a zero cotangent is still NaN in backward)."""
    pad = lambda a: jnp.pad(a, ((0, 0), (0, 1)) + ((0, 0),) * (a.ndim - 2))  # noqa: E731
    if mask is not None:
        t = q.shape[1]
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 1), (0, 1))).at[:, :, t, t].set(True)
    return pad(q), pad(k), pad(v), mask


def ring_attend(k, v, ck, cv, layer, index, k_seg):
    """A sliding-window layer's cached keys and values in a ring buffer (`KVCache.ring_k`).

    k, v: this call's T new entries (B, T, kvh, d) at slots [index, index + T); ck, cv: (rings, B,
    R, kvh, d), ring entry j of row `layer` holding the latest slot s < index with s = j mod R;
    k_seg: (B, max_len) segment of every slot (this call's included). Returns the keys and values
    the new queries attend (the R ring entries as they were, then the T new ones: a prefill longer
    than the ring sees all of its own tokens), their slots (B, R + T) and segments (B, R + T) for
    `attention_mask` (an entry never written has segment 0), and the ring arrays with the last
    min(T, R) new entries written at their slots mod R."""
    b, t = k.shape[:2]
    r = ck.shape[2]
    idx = jnp.asarray(index, jnp.int32)
    held = idx - 1 - jnp.mod(idx - 1 - jnp.arange(r, dtype=jnp.int32), r)  # the slot in each entry; < 0: none
    held_seg = jnp.where(held >= 0, jnp.take(k_seg, jnp.maximum(held, 0), axis=1), 0)
    slots = jnp.concatenate([held, idx + jnp.arange(t, dtype=jnp.int32)])
    segs = jnp.concatenate([held_seg, jax.lax.dynamic_slice_in_dim(k_seg, idx, t, axis=1)], axis=1)
    rk = jax.lax.dynamic_index_in_dim(ck, layer, 0, keepdims=False)
    rv = jax.lax.dynamic_index_in_dim(cv, layer, 0, keepdims=False)
    keys = jnp.concatenate([rk, k.astype(ck.dtype)], axis=1)
    values = jnp.concatenate([rv, v.astype(cv.dtype)], axis=1)
    if t == 1:  # decoding: one entry, written in place
        zero = jnp.zeros((), jnp.int32)
        at = (layer, zero, jnp.mod(idx, r), zero, zero)
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], at)
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], at)
    else:
        m = min(t, r)
        pos = jnp.mod(idx + (t - m) + jnp.arange(m, dtype=jnp.int32), r)
        ck = ck.at[layer, :, pos].set(jnp.moveaxis(k[:, t - m:], 1, 0).astype(ck.dtype))
        cv = cv.at[layer, :, pos].set(jnp.moveaxis(v[:, t - m:], 1, 0).astype(cv.dtype))
    return keys, values, jnp.broadcast_to(slots, (b, r + t)), segs, (ck, cv)
