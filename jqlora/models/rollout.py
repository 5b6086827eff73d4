"""Batched generation for rollouts: many prompts of different lengths at once, compiled once per
bucket, with per-row stop tokens, sampling, and the log-probability of every chosen token.

`generate_batch` left-pads the prompts to a shared width (padding is segment 0, never attended;
each row's positions count its own tokens only), so a row yields the tokens it yields alone. The
model runs as it is: the LoRA branches unmerged over the quantized base, in eval mode.

Programs: a prefill (the prompts into a fresh KV cache, each row's first token) and a decode
program (a `lax.while_loop` of up to `decode_chunk` steps that ends early once every row is done;
the decoder layers hoisted as in `jqlora.models.generate`), each compiled once per (batch bucket,
prompt-width bucket, token bucket, sampling mode). Rows are padded to `batch_bucket(n)`, the prompt
width to a multiple of `PROMPT_BUCKET`, the cache to that width plus `max_new_tokens` rounded up to
`generate.TOKEN_BUCKET`; the number of new tokens, temperature, top-p and stop ids are traced. A
training loop whose prompts vary in length therefore compiles once per bucket, not once per step.

Finished rows: a row that emits a stop token is done (its later tokens are discarded, its output
padded). Between decode calls, once the live rows fit in half the slots or fewer (and in at
least `COMPACT_MIN_ROWS`), they are gathered with their KV cache rows into the smaller batch
bucket, so finished rows stop costing work there (`compact=False` keeps every slot to the end;
without stop ids the decode runs as one call); the loop ends when every row is done. Measured on
an H200 (random NF4 weights, LoRA r = 16, 64 rows, 256 tokens, rows stopping at random points):
1B 7,920 -> 8,768 and 8B 2,476 -> 2,877 tokens/s; each call of 32 steps costs a host round trip
(1B, a stop list that never matches: 21,710 -> 19,529 tokens/s).
A slot is not free: an 8B decode step took 6.2 / 9.2 / 13.2 ms at 32 / 64 / 128 rows on an H200
(`benchmarks/rollout_bench.py`). Each smaller bucket reached compiles its decode program once.

Sampling: row r's token at step i is drawn with `fold_in(fold_in(key, r), i)`, so a row's sample
does not depend on the batch bucket or on the other rows.

LongRoPE (Phi-3): each row takes the long factors once its own sequence passes
original_max_position_embeddings, and at that step its whole cache is recomputed with them, as
transformers' and jqlora's `generate` do for a sequence alone (`generate.longrope_recompute`). The
decision is the row's own, so a row's tokens are still those it yields alone; transformers'
`generate` on a left-padded batch instead switches every row when the padded width passes it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jqlora import lowered_cache
from jqlora.errors import SettingError
from jqlora.models.cache import KVCache
from jqlora.models.config import longrope_switch
from jqlora.models.generate import _sample, decode_layer_states, hoist_layers, model_loader, sample_token, token_bucket

PROMPT_BUCKET = 64  # the padded prompt width is a multiple of this
DECODE_CHUNK = 32  # decode steps per call; finished rows are dropped between calls
COMPACT_MIN_ROWS = 8  # never compacted below this many slots: few rows cost little, each bucket compiles


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """What `generate_batch` returns (numpy arrays; B prompts, T = max_new_tokens).

    tokens: (B, T) int32 completion tokens; after a row's end, `pad_token_id`.
    lengths: (B,) int32 completion lengths, the stop token included when one was emitted.
    finished: (B,) bool, whether the row emitted an EOS or stop token (else it ran out of tokens).
    prompt_lengths: (B,) int32.
    logprobs: (B, T) float32 or None: log_softmax(logits)[token] of each chosen token, where logits
      are the model's raw float32 logits at that step (temperature 1, before any top-p
      truncation); 0 after a row's end. The same numbers as a full forward pass over
      prompt + completion (up to the compute dtype's rounding).
    steps: decode positions the loop ran (the longest row's length, at most T).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    prompt_lengths: np.ndarray
    logprobs: Optional[np.ndarray] = None
    steps: int = 0

    def completions(self) -> list:
        """Each row's completion as a list of ids (stop token included, padding dropped)."""
        return [self.tokens[i, :n].tolist() for i, n in enumerate(self.lengths)]


def batch_bucket(n: int) -> int:
    """The compiled row count for n prompts: a power of two up to 64, then a multiple of 64."""
    n = max(int(n), 1)
    if n <= 64:
        return 1 << (n - 1).bit_length()
    return -(-n // 64) * 64


def prompt_bucket(width: int, bucket: int = PROMPT_BUCKET) -> int:
    """The compiled prompt width for prompts of at most `width` tokens."""
    return -(-int(width) // bucket) * bucket


def _stop_array(eos_token_id, stop_token_ids) -> np.ndarray:
    ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, (int, np.integer))
                                           else list(eos_token_id))
    ids = sorted({int(t) for t in ids} | {int(t) for t in stop_token_ids})
    # padded with -1 (never a token) to a multiple of 8 ids: a new count of ids compiles nothing
    return np.asarray(ids + [-1] * (-len(ids) % 8 or (8 if not ids else 0)), np.int32)


def _sampler(key, rows, temperature, top_p, *, greedy, use_top_p, return_logprobs, stops):
    """(pick(logits, i), logprob(logits, tok), is_stop(tok)) for slots holding rows `rows`."""
    row_keys = None if greedy else jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)

    def pick(step_logits, i):
        if greedy:
            return sample_token(step_logits, None, 0.0)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
        draw = lambda lg, k: _sample(lg[None], k, temperature, top_p if use_top_p else None)[0]  # noqa: E731
        return jax.vmap(draw)(step_logits, keys)

    def logprob(step_logits, tok):
        if not return_logprobs:
            return jnp.zeros((tok.shape[0], 0), jnp.float32)
        return jnp.take_along_axis(jax.nn.log_softmax(step_logits, axis=-1), tok[:, None], axis=-1)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stops[None, :], axis=-1)

    return pick, logprob, is_stop


def _loader(graphdef, compute_dtype, lora_state, rest):
    # The LoRA matrices in the compute dtype once, before the loop: `qmatmul` rounds them to it on
    # every call anyway, and inside the loop that would be two small casts per layer and token.
    lora_state = jax.tree.map(lambda a: a.astype(compute_dtype), lora_state)
    return model_loader(graphdef, lora_state, rest)


def _prefill(model, prompt, prompt_mask, max_len: int):
    """`generate.prefill` with each row's LongRoPE table chosen by that row's own positions."""
    seg = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg, axis=-1) - 1, 0)
    cache = model.init_cache(prompt.shape[0], max_len)
    logits, cache = model(prompt, positions=positions, segment_ids=seg, cache=cache, rope_per_row=True)
    return logits, cache, positions[:, -1] + 1


def _step(model, tok, pos, cache, layer_states):
    """`generate.decode_step` with each row's LongRoPE table chosen by that row's own position."""
    logits, cache = model(tok[:, None], positions=pos[:, None], cache=cache, layer_states=layer_states,
                          rope_per_row=True)
    return logits[:, 0].astype(jnp.float32), cache


def _select_rows(rows, new, old):
    """Per slot, `new`'s rows where `rows` (B,) holds, else `old`'s: a cache's (layers, B, ...)
    arrays on axis 1, the rest on axis 0; scalars (the shared index) from `new`."""
    def sel(n, o):
        if n.ndim == 0:
            return n
        shape = (1, -1) + (1,) * (n.ndim - 2) if n.ndim == 5 else (-1,) + (1,) * (n.ndim - 1)
        return jnp.where(rows.reshape(shape), n, o)

    return jax.tree.map(sel, new, old)


def _longrope_switch_rows(model, tok, pos, cache, layer_states, history, i, crossing):
    """LongRoPE: the step at which the rows in `crossing` (B,) first pass
    original_max_position_embeddings. Those rows' prompt and generated tokens (`history`: prompt
    (B, W), its mask, the tokens generated so far (B, bucket), the last of them `tok`) run again
    into a fresh cache with the long factors (`generate.longrope_recompute`, each row by its own
    positions), and their logits and cache rows replace the plain step's; the other rows take
    the plain step. -> (float32 logits (B, V), cache)."""
    prompt, prompt_mask, gen = history
    logits, stepped = _step(model, tok, pos, cache, layer_states)
    t = prompt.shape[1]
    seg = jnp.concatenate([prompt_mask.astype(jnp.int32),
                           jnp.broadcast_to(jnp.arange(gen.shape[1]) < i, gen.shape).astype(jnp.int32)], axis=1)
    positions = jnp.maximum(jnp.cumsum(seg, axis=-1) - 1, 0)
    fresh = KVCache.init(model.config, tok.shape[0], seg.shape[1], model.compute_dtype, ring=False)
    full, again = model(jnp.concatenate([prompt, gen], axis=1), positions=positions, segment_ids=seg, cache=fresh,
                        rope_per_row=True)
    last = jax.lax.dynamic_index_in_dim(full, t + i - 1, 1, keepdims=False).astype(jnp.float32)
    again = dataclasses.replace(again, index=jnp.asarray(t + i, jnp.int32)).in_layout_of(cache)
    return jnp.where(crossing[:, None], last, logits), _select_rows(crossing, again, stepped)


def _prefill_program(lora_state, rest, prompt, prompt_mask, active, key, stops, temperature, top_p, *, graphdef,
                     compute_dtype, cache_len, greedy, use_top_p, return_logprobs):
    """The prompts into a fresh cache and each row's first token: (cache, token, next position,
    done, log-prob (B, 1) or (B, 0))."""
    model = _loader(graphdef, compute_dtype, lora_state, rest)()
    rows = jnp.arange(prompt.shape[0], dtype=jnp.int32)
    pick, logprob, is_stop = _sampler(key, rows, temperature, top_p, greedy=greedy, use_top_p=use_top_p,
                                      return_logprobs=return_logprobs, stops=stops)
    logits, cache, next_pos = _prefill(model, prompt, prompt_mask, cache_len)
    first = logits[:, -1].astype(jnp.float32)
    tok = pick(first, 0)
    done = (is_stop(tok) & active) | ~active  # rows that only fill the batch bucket: done from the start
    return cache, tok, next_pos, done, logprob(first, tok)


def _decode_program(lora_state, rest, cache, tok, pos, done, rows, key, stops, temperature, top_p, start, stop, history,
                    *, graphdef, compute_dtype, chunk, greedy, use_top_p, return_logprobs, hoist):
    """Decode steps start, start + 1, ... < stop (at most `chunk`) until every slot is done.
    rows: the prompt index of each slot (its sampling key). history: None, or for LongRoPE each
    slot's (prompt (B, W), prompt mask, tokens generated before `start` (B, bucket)), the tokens
    a row's recompute runs again (`_longrope_switch_rows`). -> (cache, token, position, done,
    tokens (B, chunk), log-probs (B, chunk) or (B, 0), the step reached)."""
    load = _loader(graphdef, compute_dtype, lora_state, rest)
    model = load()
    b = tok.shape[0]
    pick, logprob, is_stop = _sampler(key, rows, temperature, top_p, greedy=greedy, use_top_p=use_top_p,
                                      return_logprobs=return_logprobs, stops=stops)
    layer_states = decode_layer_states(model, hoist)  # sliced once, outside the loop
    switch = longrope_switch(model.config)
    if switch is None or switch >= cache.max_len:
        history = None  # no row can pass original_max_position_embeddings here
    gen = None if history is None else history[2]

    def cond(carry):
        return (carry[0] < stop) & ~jnp.all(carry[4])

    def body(carry):
        i, tok, pos, cache, done, out, lps, gen = carry
        if history is None:
            step_logits, cache = _step(load(), tok, pos, cache, layer_states)
        else:  # a live row whose next token sits at position `switch`: its sequence passes it now
            crossing = (pos == switch) & ~done
            step_logits, cache = jax.lax.cond(
                jnp.any(crossing),
                lambda c: _longrope_switch_rows(load(), tok, pos, c, layer_states, (*history[:2], gen), i, crossing),
                lambda c: _step(load(), tok, pos, c, layer_states), cache)
        new = pick(step_logits, i)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, i - start))
        if gen is not None:
            gen = jax.lax.dynamic_update_slice(gen, new[:, None], (0, i))
        if return_logprobs:
            lps = jax.lax.dynamic_update_slice(lps, logprob(step_logits, new), (0, i - start))
        return i + 1, new, pos + 1, cache, done | is_stop(new), out, lps, gen

    out = jnp.zeros((b, chunk), jnp.int32)
    lps = jnp.zeros((b, chunk if return_logprobs else 0), jnp.float32)
    i, tok, pos, cache, done, out, lps, _ = jax.lax.while_loop(cond, body,
                                                               (start, tok, pos, cache, done, out, lps, gen))
    return cache, tok, pos, done, out, lps, i


_PREFILL_STATIC = ("graphdef", "compute_dtype", "cache_len", "greedy", "use_top_p", "return_logprobs")
_DECODE_STATIC = ("graphdef", "compute_dtype", "chunk", "greedy", "use_top_p", "return_logprobs", "hoist")
_prefill_jit = jax.jit(_prefill_program, static_argnames=_PREFILL_STATIC)
_decode_jit = jax.jit(_decode_program, static_argnames=_DECODE_STATIC)


def _run(program, jitted, name, *args, **static):
    """A program, through the lowered-program cache when the compilation cache is on."""
    return lowered_cache.call(program, args, static=static, name=name, fallback=lambda: jitted(*args, **static))


def compiled_programs() -> int:
    """How many rollout programs this process has compiled (prefill and decode, per bucket and
    sampling mode)."""
    return _prefill_jit._cache_size() + _decode_jit._cache_size()


def _take_rows(tree, idx):
    """The slots `idx` of every array of a decode state: the batch axis is axis 1 of the cache's
    (layers, B, slots, heads, dim) arrays and axis 0 of the rest; scalars stay."""
    idx = jnp.asarray(idx, jnp.int32)
    return jax.tree.map(lambda a: a if a.ndim == 0 else jnp.take(a, idx, axis=1 if a.ndim == 5 else 0), tree)


def _check(prompts, vocab: int, max_new_tokens: int, temperature: float, top_p: float, key) -> list:
    if max_new_tokens < 1:
        raise SettingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0 or not 0.0 < top_p <= 1.0:
        raise SettingError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    if temperature > 0 and key is None:
        raise SettingError("sampling (temperature > 0) needs key=jax.random.key(...)")
    rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if not rows:
        raise SettingError("generate_batch: no prompts")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise SettingError(f"generate_batch: prompt {i} is empty (no tokens)")
        bad = r[(r < 0) | (r >= vocab)]
        if bad.size:
            raise SettingError(f"generate_batch: prompt {i} has token id {int(bad[0])} outside the vocabulary "
                               f"(vocab_size {vocab})")
    return rows


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key, temperature: float = 1.0,
                   top_p: float = 1.0, eos_token_id=None, stop_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                   return_logprobs: bool = False, decode_layers: str = "auto",
                   prompt_bucket_size: int = PROMPT_BUCKET, compact: bool = True,
                   decode_chunk: int = DECODE_CHUNK) -> Rollouts:
    """Complete every prompt (a list of token-id lists of any lengths) with up to `max_new_tokens`.

    temperature 0 is greedy (key may be None); otherwise sampling from softmax(logits / temperature)
    restricted to the top_p nucleus (`generate.sample_token`), reproducible with `key`. A row ends
    at its first token in eos_token_id (an int or ids) or stop_token_ids; the token is kept and
    counted in `lengths`, and the rest of the row is pad_token_id. return_logprobs: also each
    chosen token's log-probability under the raw model (see `Rollouts.logprobs`). decode_layers:
    as in `jqlora.models.generate`. prompt_bucket_size: the padded prompt width is a multiple of
    it (one compiled program per width). compact: drop finished rows between decode calls of
    `decode_chunk` steps (module docstring); the tokens are the same either way. The model runs
    as it is, LoRA unmerged, in eval mode."""
    vocab = int(model.config.vocab_size)
    rows = _check(prompts, vocab, int(max_new_tokens), float(temperature), float(top_p), key)
    if not 0 <= int(pad_token_id) < vocab:
        raise SettingError(f"pad_token_id {pad_token_id} is outside the vocabulary (vocab_size {vocab})")
    n = len(rows)
    lens = np.asarray([r.size for r in rows], np.int32)
    nb, width = batch_bucket(n), prompt_bucket(int(lens.max()), prompt_bucket_size)
    ids = np.full((nb, width), int(pad_token_id), np.int32)
    mask = np.zeros((nb, width), np.int32)
    for i, r in enumerate(rows):  # left-padded
        ids[i, width - r.size:] = r
        mask[i, width - r.size:] = 1
    mask[n:, -1] = 1  # rows that only fill the bucket: one token, finished from the start
    active = np.arange(nb) < n
    bucket = token_bucket(max_new_tokens)
    greedy = float(temperature) == 0.0
    use_top_p = float(top_p) < 1.0
    graphdef, lora_state, rest = nnx.split(model, nnx.LoRAParam, ...)
    key = jax.random.key(0) if greedy else key
    stops = _stop_array(eos_token_id, stop_token_ids)
    common = (jnp.asarray(stops), jnp.float32(temperature), jnp.float32(top_p))
    mode = dict(graphdef=graphdef, compute_dtype=model.compute_dtype.name, greedy=greedy, use_top_p=use_top_p,
                return_logprobs=bool(return_logprobs))
    cache, tok, pos, done, lp = _run(_prefill_program, _prefill_jit, "rollout_prefill", lora_state, rest,
                                     jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(active), key, *common,
                                     cache_len=width + bucket, **mode)
    total = int(max_new_tokens)
    tokens = np.full((nb, total), int(pad_token_id), np.int32)
    lps = np.zeros((nb, total), np.float32)
    tokens[:, 0] = np.asarray(tok)
    if return_logprobs:
        lps[:, 0] = np.asarray(lp)[:, 0]
    slots = np.arange(nb)  # the prompt each slot holds
    # without stop ids no row ends early: one decode call (chunks cost a host round trip each)
    chunk = decode_chunk if compact and (stops >= 0).any() else bucket
    hoist = {}
    longrope = longrope_switch(model.config) is not None
    i = 1
    while i < total:
        live = ~np.asarray(done)
        if not live.any():
            break
        keep = max(batch_bucket(int(live.sum())), COMPACT_MIN_ROWS)
        if compact and keep <= len(slots) // 2:
            idx = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])[:keep]  # done slots fill up
            cache, tok, pos, done = _take_rows((cache, tok, pos, done), idx)
            slots = slots[idx]
        b = len(slots)
        if b not in hoist:
            hoist[b] = hoist_layers(model, b, width + bucket, decode_layers)
        end = min(i + chunk, total)
        history = None
        if longrope:  # what a row's LongRoPE recompute runs again: its prompt and its tokens so far
            gen = np.full((b, bucket), int(pad_token_id), np.int32)
            gen[:, :i] = tokens[slots, :i]
            history = (jnp.asarray(ids[slots]), jnp.asarray(mask[slots]), jnp.asarray(gen))
        cache, tok, pos, done, out, lp, reached = _run(
            _decode_program, _decode_jit, "rollout_decode", lora_state, rest, cache, tok, pos, done,
            jnp.asarray(slots, jnp.int32), key, *common, jnp.int32(i), jnp.int32(end), history, chunk=chunk,
            hoist=hoist[b], **mode)
        reached = int(reached)
        tokens[slots, i:reached] = np.asarray(out)[:, :reached - i]
        if return_logprobs:
            lps[slots, i:reached] = np.asarray(lp)[:, :reached - i]
        i = reached
    steps = i
    tokens, lps = tokens[:n, :steps], lps[:n, :steps]
    stop_set = np.isin(tokens, stops[stops >= 0])
    finished = stop_set.any(axis=1)
    lengths = np.where(finished, stop_set.argmax(axis=1) + 1, steps).astype(np.int32)
    kept = np.arange(steps)[None, :] < lengths[:, None]
    out_tokens = np.full((n, total), int(pad_token_id), np.int32)
    out_tokens[:, :steps] = np.where(kept, tokens, int(pad_token_id))
    out_lps = None
    if return_logprobs:
        out_lps = np.zeros((n, total), np.float32)
        out_lps[:, :steps] = np.where(kept, lps, 0.0)
    return Rollouts(tokens=out_tokens, lengths=lengths, finished=finished, prompt_lengths=lens, logprobs=out_lps,
                    steps=steps)
