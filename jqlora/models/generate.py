"""Autoregressive generation with a preallocated KV cache: one compiled program holds the prefill
and a `lax.while_loop` of single-token decode steps (it stops early once every row has emitted
EOS). The cache lives inside that program (a loop carry, updated in place), and the number of new
tokens is a traced bound: every `max_new_tokens` up to the same multiple of `TOKEN_BUCKET` runs the
same compiled program, so generating N tokens compiles one program whatever N is.

Decode layers: the decoder layers are stored stacked (one array per weight kind). A scan over
them slices each layer's weights out of the stacks, and a kernel takes whole arrays, so XLA copies
every layer's weights on every token: about half of the decode time measured on an H200
(benchmarks/results/JOURNAL.md, 2026-11-27). With `decode_layers="hoisted"` the layers are sliced
once, before the decode loop, and run one after another inside it: no copy per token, at the
price of a second copy of the layer weights while generating and a longer compilation (the
layers are unrolled). "auto" hoists when two copies of the weights and the KV cache fit in 90% of
the device's memory; on a CPU (no memory limit reported) it scans.

Fused projections: with hoisted layers, the projections that read one input, q|k|v and gate|up,
run as one product each (`jqlora.lora.fuse`; 4 products a layer instead of 7). At one token a
4-bit product costs about 4 us however small its weight, so this saves 8% of an 8B token's time
and 12% of a 1B token's on an H200 (benchmarks/results/JOURNAL.md). The fused 4-bit weights
hold de-nested float32 scales (`jqlora.quant.stacked_rows`), 3 bytes more per 64 weights."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from flax import nnx

from jqlora import lowered_cache
from jqlora.errors import SettingError
from jqlora.models.cache import KVCache
from jqlora.models.config import longrope_switch
from jqlora.models.remat import device_memory, state_bytes

# The output buffer and KV cache are sized to max_new_tokens rounded up to this; a request for N
# tokens compiles only when its bucket (or the prompt shape) is new.
TOKEN_BUCKET = 64
DECODE_LAYERS = ("auto", "hoisted", "scanned")


def sample_token(logits: jax.Array, key: Optional[jax.Array], temperature: float = 0.0, top_p: float = 1.0) -> jax.Array:
    """Next token per row from logits (B, V). temperature == 0: argmax. Otherwise sample from
    softmax(logits / temperature) restricted to the nucleus: the smallest set of most likely
    tokens whose probability mass reaches top_p (the token that crosses top_p is included; tokens
    tied with the smallest kept logit are kept too)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("sampling (temperature > 0) needs an rng key")
    return _sample(logits, key, temperature, top_p if top_p < 1.0 else None)


def _sample(logits, key, temperature, top_p):
    """Temperature + optional nucleus sampling; temperature/top_p may be traced scalars."""
    logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if top_p is not None:
        srt = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _eos_array(eos_token_id) -> Optional[jax.Array]:
    if eos_token_id is None:
        return None
    if isinstance(eos_token_id, int):
        eos_token_id = (eos_token_id,)
    return jnp.asarray(tuple(int(e) for e in eos_token_id), jnp.int32)


def token_bucket(max_new_tokens: int) -> int:
    """The compiled length for `max_new_tokens` new tokens: the next multiple of TOKEN_BUCKET."""
    return -(-int(max_new_tokens) // TOKEN_BUCKET) * TOKEN_BUCKET


def hoist_layers(model, batch: int, max_len: int, decode_layers: str = "auto") -> bool:
    """Whether generation slices the layers once before its decode loop (module docstring)."""
    if decode_layers not in DECODE_LAYERS:
        raise ValueError(f"decode_layers must be one of {DECODE_LAYERS}, got {decode_layers!r}")
    if decode_layers != "auto":
        return decode_layers == "hoisted"
    limit = device_memory()
    if limit is None:
        return False
    cache = KVCache.nbytes(model.config, batch, max_len, model.compute_dtype)
    return state_bytes(model) + state_bytes(model.model.layers) + cache <= 0.9 * limit


def model_loader(graphdef, *states):
    """A function that rebuilds the model from its split state inside a traced program: a fresh
    copy per call, since NNX forbids touching Variables created at another trace level (prefill,
    loop body). eval(): no dropout; remat is pointless without a backward pass."""
    def load():
        m = nnx.merge(graphdef, *states, copy=True)
        m.eval()
        m.remat = False
        return m

    return load


def prefill(model, prompt, prompt_mask, max_len: int):
    """Run LEFT-padded prompts (B, T) (mask 0 = padding: segment 0, never attended; positions count
    real tokens only) into a fresh cache of `max_len` slots. -> (logits (B, T, V), cache, the
    position of each row's next token (B,))."""
    seg = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg, axis=-1) - 1, 0)
    cache = model.init_cache(prompt.shape[0], max_len)
    logits, cache = model(prompt, positions=positions, segment_ids=seg, cache=cache)
    return logits, cache, positions[:, -1] + 1


def decode_layer_states(model, hoist: bool, fuse: bool = True):
    """The layers sliced once, before a decode loop (loop invariants), or None to scan them.
    fuse: each layer's projections that read one input (q|k|v, gate|up) run as one product
    (`DecoderLayer.fuse_projections`). The LoRA matrices are cast to the compute dtype once, here."""
    if not hoist:
        return None
    return [stack.layer_states(fuse, model.compute_dtype) for stack in model.model.layers.stacks]


def decode_step(model, tok, pos, cache, layer_states):
    """One token per row (B,) at positions pos (B,) -> (float32 logits (B, V), cache)."""
    logits, cache = model(tok[:, None], positions=pos[:, None], cache=cache, layer_states=layer_states)
    return logits[:, 0].astype(jnp.float32), cache


def longrope_recompute(model, prompt, prompt_mask, out, i, like: KVCache):
    """LongRoPE (Phi-3): transformers' `generate` recomputes the whole cache once, when the
    sequence first passes original_max_position_embeddings, so that every key carries the long
    factors from then on (Phi3ForCausalLM.prepare_inputs_for_generation). The prompt and the i
    tokens of `out` (B, bucket) generated so far, the last of them not yet in the cache, run again
    into a fresh cache in `like`'s layout -> (float32 logits of that last token (B, V), cache)."""
    b, t = prompt.shape
    seg = jnp.concatenate([prompt_mask.astype(jnp.int32),
                           jnp.broadcast_to(jnp.arange(out.shape[1]) < i, out.shape).astype(jnp.int32)], axis=1)
    positions = jnp.maximum(jnp.cumsum(seg, axis=-1) - 1, 0)
    fresh = KVCache.init(model.config, b, seg.shape[1], model.compute_dtype, ring=False)
    logits, cache = model(jnp.concatenate([prompt, out], axis=1), positions=positions, segment_ids=seg, cache=fresh)
    last = jax.lax.dynamic_index_in_dim(logits, t + i - 1, 1, keepdims=False).astype(jnp.float32)
    cache = dataclasses.replace(cache, index=jnp.asarray(t + i, jnp.int32))
    return last, cache.in_layout_of(like)


def _generate_program(state, prompt, prompt_mask, key, eos, temperature, top_p, max_new_tokens, *, graphdef, bucket,
                      greedy, use_top_p, return_logits, hoist, fuse):
    """The prefill and the decode loop, one program (`_generate` compiles it; `_run` runs it)."""
    load = model_loader(graphdef, state)
    model = load()
    b, t = prompt.shape
    logits, cache, next_pos = prefill(model, prompt, prompt_mask, t + bucket)
    vocab = logits.shape[-1]

    def pick(step_logits, i):
        if greedy:
            return sample_token(step_logits, None, 0.0)
        return _sample(step_logits, jax.random.fold_in(key, i), temperature, top_p if use_top_p else None)

    def is_eos(tok):  # eos holds -1 when there is no EOS token: never matches
        return jnp.any(tok[:, None] == eos[None, :], axis=-1)

    first_logits = logits[:, -1].astype(jnp.float32)
    tok = pick(first_logits, 0)
    out = jnp.zeros((b, bucket), jnp.int32).at[:, 0].set(tok)
    scores = jnp.zeros((b, bucket if return_logits else 0, vocab), jnp.float32)
    if return_logits:
        scores = scores.at[:, 0].set(first_logits)
    done = is_eos(tok)
    pad = jnp.maximum(eos[0], 0)

    def cond(carry):
        i, _, _, _, done, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    # Sliced here, outside the loop: loop invariants, not a copy of every layer per token.
    layer_states = decode_layer_states(model, hoist, fuse)

    switch = longrope_switch(model.config)
    recompute = switch is not None and t <= switch < t + bucket  # the sequence may cross it here

    def body(carry):
        i, tok, pos, cache, done, out, scores = carry
        if recompute:
            step_logits, cache = jax.lax.cond(
                cache.index == switch, lambda c: longrope_recompute(load(), prompt, prompt_mask, out, i, c),
                lambda c: decode_step(load(), tok, pos, c, layer_states), cache)
        else:
            step_logits, cache = decode_step(load(), tok, pos, cache, layer_states)
        new = pick(step_logits, i)
        new = jnp.where(done, pad, new)
        out = out.at[:, i].set(new)
        if return_logits:
            scores = scores.at[:, i].set(step_logits)
        return i + 1, new, pos + 1, cache, done | is_eos(new), out, scores

    carry = (jnp.int32(1), tok, next_pos, cache, done, out, scores)
    i, _, _, _, done, out, scores = jax.lax.while_loop(cond, body, carry)
    # Rows that stopped early (or all rows, when the loop ended early) are padded with EOS.
    filled = jnp.arange(bucket)[None, :] < i
    out = jnp.where(filled, out, pad)
    return out, scores


_STATIC = ("graphdef", "bucket", "greedy", "use_top_p", "return_logits", "hoist", "fuse")
_generate = jax.jit(_generate_program, static_argnames=_STATIC)


def _run(*args, **static):
    """`_generate`, through the lowered-program cache when the compilation cache is on."""
    return lowered_cache.call(_generate_program, args, static=static, name="generate",
                              fallback=lambda: _generate(*args, **static))


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             rng: Optional[jax.Array] = None, eos_token_id: Union[int, Sequence[int], None] = None,
             attention_mask=None, return_logits: bool = False, decode_layers: str = "auto",
             fuse_projections: bool = True):
    """Generate `max_new_tokens` tokens after `prompt_ids` (B, T).

    temperature=0.0 is greedy (argmax); otherwise top-p (nucleus) sampling with `rng` (a
    jax.random key). attention_mask (B, T), 1 = token, 0 = padding, for LEFT-padded prompts of
    different lengths (positions count real tokens only; padding is never attended).
    After a row emits eos_token_id (int or list), its remaining tokens are eos_token_id[0].
    Returns (B, T + max_new_tokens) int32 token ids (prompt + generated); with return_logits=True
    also the float32 logits (B, max_new_tokens, V) each new token was chosen from (zeros after
    every row stopped). The model runs in eval mode (no LoRA dropout). decode_layers: "auto",
    "hoisted" or "scanned" (module docstring). fuse_projections: with hoisted layers, the
    projections that read one input (q|k|v, gate|up) run as one product each (module docstring);
    False runs them apart.
    """
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    if prompt.ndim != 2:
        raise ValueError(f"prompt_ids must be (batch, seq), got shape {prompt.shape}")
    if max_new_tokens < 1:
        raise SettingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise SettingError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng=jax.random.key(...)")
    mask = jnp.ones_like(prompt) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if mask.shape != prompt.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != prompt shape {prompt.shape}")
    eos = _eos_array(eos_token_id)
    graphdef, state = nnx.split(model)
    greedy = temperature == 0.0
    out, scores = _run(
        state, prompt, mask, None if greedy else rng,
        eos if eos is not None else jnp.full((1,), -1, jnp.int32),
        jnp.float32(temperature), jnp.float32(top_p), jnp.int32(max_new_tokens),
        graphdef=graphdef, bucket=token_bucket(max_new_tokens), greedy=greedy, use_top_p=top_p < 1.0,
        return_logits=bool(return_logits),
        hoist=hoist_layers(model, prompt.shape[0], prompt.shape[1] + token_bucket(max_new_tokens), decode_layers),
        fuse=bool(fuse_projections))
    n = int(max_new_tokens)
    out, scores = out[:, :n], scores[:, :n]
    seqs = jnp.concatenate([prompt, out], axis=1)
    return (seqs, scores) if return_logits else seqs
