"""The ring-buffer KV cache of sliding-window layers (`jqlora.models.cache`): window-sized arrays for
windowed layers, whole-sequence ones for global layers, and decoding through it equal to decoding
with every layer's whole sequence cached and to transformers' greedy tokens (its own sliding
cache), with prompts longer than the window."""
from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import family_checkpoints as fc  # noqa: E402
from jqlora import models  # noqa: E402
from jqlora.models.cache import KVCache  # noqa: E402

pytestmark = pytest.mark.torch

WINDOW = 4
CONFIGS = {"gemma2": dict(fc.GEMMA2, sliding_window=WINDOW, num_hidden_layers=4),
           "gemma3": dict(fc.GEMMA3, sliding_window=WINDOW)}
PROMPT = 10  # longer than the window: the prefill writes past the ring's length
NEW = 40


@functools.lru_cache(maxsize=None)
def _family(kind):
    tm = fc.text_model(CONFIGS[kind])
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    return kind, tm, models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32)


@pytest.fixture(params=sorted(CONFIGS))
def family(request):
    return _family(request.param)


def test_windowed_layers_hold_window_sized_caches(family):
    kind, _, m = family
    c = m.config
    cache = m.init_cache(2, 100)
    n_ring = sum(w is not None for w in c.sliding_windows)
    assert n_ring == (2 if kind == "gemma2" else 5)
    shape = (2, c.num_key_value_heads, c.head_dim)
    assert cache.ring_k.shape == cache.ring_v.shape == (n_ring, shape[0], WINDOW, *shape[1:])
    assert cache.k.shape == (c.num_hidden_layers - n_ring, shape[0], 100, *shape[1:])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, PROMPT)))
    graphdef, state = nnx.split(m)
    _, after = jax.eval_shape(lambda st, c: nnx.merge(graphdef, st)(ids, cache=c), state, cache)
    assert after.ring_k.shape == cache.ring_k.shape and after.k.shape == cache.k.shape
    assert KVCache.nbytes(c, 2, 100, jnp.float32) == 4 * (after.k.size + after.ring_k.size) * 2
    full = KVCache.init(c, 2, 100, jnp.float32, ring=False)
    assert full.ring_k is None and full.k.shape[0] == c.num_hidden_layers


def _decode(m, prompt, mask, cache, steps):
    """Greedy decoding step by step through `cache`, one compiled program; -> (tokens (B, steps),
    logits (B, steps, V))."""
    graphdef, state = nnx.split(m)

    @jax.jit
    def run(state, prompt, seg, cache):
        model = nnx.merge(graphdef, state)
        pos = jnp.maximum(jnp.cumsum(seg, -1) - 1, 0)
        logits, cache = model(prompt, positions=pos, segment_ids=seg, cache=cache)

        def step(carry, _):
            last, p, cache = carry
            tok = jnp.argmax(last, -1)
            logits, cache = model(tok[:, None], positions=p[:, None], cache=cache)
            return (logits[:, 0], p + 1, cache), (tok, last)

        _, (toks, lgs) = jax.lax.scan(step, (logits[:, -1], pos[:, -1] + 1, cache), None, length=steps)
        return toks.T, jnp.swapaxes(lgs, 0, 1)

    toks, lgs = run(state, jnp.asarray(prompt), jnp.asarray(mask, jnp.int32), cache)
    return np.asarray(toks), np.asarray(lgs)


# Gemma 2's run is slow-only: Gemma 3's covers the ring path (both window kinds, a global layer
# between), and Gemma 2's soft-caps through the ring meet transformers' tokens below.
@pytest.mark.parametrize("kind", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_ring_decoding_equals_whole_sequence_cache(kind):
    """Left-padded rows of different lengths, a prefill past the window, 40 steps: the same logits
    (to float rounding) and tokens with the ring buffer as with every slot of every layer kept."""
    _, _, m = _family(kind)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, (2, PROMPT))
    mask = np.ones_like(prompt)
    mask[1, :3] = 0  # row 1: 7 real tokens after 3 padding slots
    max_len = PROMPT + NEW
    tok_r, lg_r = _decode(m, prompt, mask, m.init_cache(2, max_len), NEW)
    tok_f, lg_f = _decode(m, prompt, mask, KVCache.init(m.config, 2, max_len, jnp.float32, ring=False), NEW)
    np.testing.assert_array_equal(tok_r, tok_f)
    np.testing.assert_allclose(lg_r, lg_f, rtol=0, atol=2e-5 * np.abs(lg_f).max())


def test_greedy_generation_equals_transformers(family):
    """`generate` (ring buffer inside the compiled decode loop) gives transformers' greedy tokens."""
    kind, tm, m = family
    prompt = np.random.default_rng(3).integers(0, 256, (1, PROMPT))
    with torch.no_grad():
        ref = tm.generate(torch.tensor(prompt), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    got = np.asarray(models.generate(m, jnp.asarray(prompt), max_new_tokens=NEW, decode_layers="scanned"))
    np.testing.assert_array_equal(got[0, PROMPT:], ref[0, PROMPT:].numpy(), err_msg=kind)
    if kind == "gemma3":  # the layers sliced once before the loop (the GPU default when they fit)
        hoisted = models.generate(m, jnp.asarray(prompt), max_new_tokens=NEW, decode_layers="hoisted")
        np.testing.assert_array_equal(np.asarray(hoisted), got)
