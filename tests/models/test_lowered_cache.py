"""The lowered-program cache (`jqlora.lowered_cache`): a stored program is found again by a new
process, a different program never gets another's entry, a damaged entry or a failed export runs
uncached, and generation through it equals generation without it."""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jqlora import lowered_cache
from jqlora.models import generate
from test_scan import _ids, _model

pytest.importorskip("flatbuffers")  # jax.export's serialization


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The cache on, in tmp_path; every call starts as a new process would (no in-process slots)."""
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: tmp_path)
    lowered_cache._slot.cache_clear()
    yield tmp_path
    lowered_cache._slot.cache_clear()


def _spy(monkeypatch):
    calls = {"export": 0, "deserialize": 0}
    real_export, real_deserialize = jax.export.export, jax.export.deserialize

    def export(*a, **k):
        calls["export"] += 1
        return real_export(*a, **k)

    def deserialize(*a, **k):
        calls["deserialize"] += 1
        return real_deserialize(*a, **k)

    monkeypatch.setattr(jax.export, "export", export)
    monkeypatch.setattr(jax.export, "deserialize", deserialize)
    return calls


def _scale(x, y, *, k):
    return {"out": x * k + y["b"]}


def _shift(x, y, *, k):  # same signature and statics as _scale, another program
    return {"out": x + k + y["b"]}


def _run(fun, x, y, k=3.0):
    return lowered_cache.call(fun, (x, y), static={"k": k}, name="t",
                              fallback=lambda: jax.jit(fun, static_argnames=("k",))(x, y, k=k))


def test_a_new_process_reads_the_stored_program(store, monkeypatch):
    calls = _spy(monkeypatch)
    x, y = jnp.arange(4.0), {"b": jnp.ones(4)}
    first = _run(_scale, x, y)
    assert calls == {"export": 1, "deserialize": 0} and len(list(store.iterdir())) == 1
    _run(_scale, x, y)  # the same process: the program it holds
    assert calls == {"export": 1, "deserialize": 0}
    lowered_cache._slot.cache_clear()  # a new process
    again = _run(_scale, 2 * x, y)
    assert calls == {"export": 1, "deserialize": 1}
    np.testing.assert_array_equal(first["out"], x * 3 + 1)
    np.testing.assert_array_equal(again["out"], 2 * x * 3 + 1)


def test_programs_with_the_same_signature_never_share_an_entry(store):
    """The key is the traced program, not the argument types: `_shift` must not run `_scale`."""
    x, y = jnp.arange(4.0), {"b": jnp.zeros(4)}
    np.testing.assert_array_equal(_run(_scale, x, y)["out"], x * 3)
    lowered_cache._slot.cache_clear()
    np.testing.assert_array_equal(_run(_shift, x, y)["out"], x + 3)
    lowered_cache._slot.cache_clear()
    np.testing.assert_array_equal(_run(_scale, x, y, k=5.0)["out"], x * 5)  # a static changes the program
    assert len(list(store.iterdir())) == 3


def _pallas_times(k):
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):  # the same name for every k
        o_ref[...] = x_ref[...] * k

    def fun(x, y, *, k):
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
        return {"out": out + y["b"]}
    return fun


def test_pallas_kernels_that_differ_only_in_their_body_get_their_own_entries(store):
    """Two kernels of one name and shape that compute different things are two programs."""
    x, y = jnp.arange(8.0), {"b": jnp.zeros(8)}
    np.testing.assert_array_equal(_run(_pallas_times(2.0), x, y)["out"], 2 * x)
    lowered_cache._slot.cache_clear()
    np.testing.assert_array_equal(_run(_pallas_times(5.0), x, y)["out"], 5 * x)
    assert len(list(store.iterdir())) == 2


def _pallas_block(j):
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fun(x, y, *, k):  # reads block j of x: only the index map differs
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), x.dtype), grid=(1,),
                             in_specs=[pl.BlockSpec((4,), lambda i: (j,))],
                             out_specs=pl.BlockSpec((4,), lambda i: (0,)), interpret=True)(x)
        return {"out": out * k + y["b"][:4]}
    return fun


def test_pallas_index_maps_the_printed_program_leaves_out_are_in_the_key(store):
    x, y = jnp.arange(8.0), {"b": jnp.zeros(8)}
    np.testing.assert_array_equal(_run(_pallas_block(0), x, y, k=1.0)["out"], x[:4])
    lowered_cache._slot.cache_clear()
    np.testing.assert_array_equal(_run(_pallas_block(1), x, y, k=1.0)["out"], x[4:])
    assert len(list(store.iterdir())) == 2


def test_a_damaged_entry_or_a_failed_export_runs_uncached(store, monkeypatch, caplog):
    x, y = jnp.arange(4.0), {"b": jnp.ones(4)}
    _run(_scale, x, y)
    (entry,) = store.iterdir()
    entry.write_bytes(b"not a serialized program")
    lowered_cache._slot.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jqlora.lowered_cache"):
        np.testing.assert_array_equal(_run(_scale, x, y)["out"], x * 3 + 1)
    assert "cannot read the stored program" in caplog.text
    assert entry.read_bytes() != b"not a serialized program"  # stored again

    def fail(*a, **k):
        raise RuntimeError("export refused")

    monkeypatch.setattr(jax.export, "export", fail)
    lowered_cache._slot.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jqlora.lowered_cache"):
        np.testing.assert_array_equal(_run(_shift, x, y)["out"], x + 4)
    assert "export refused" in caplog.text


def test_generation_through_the_cache_equals_generation_without_it(store, monkeypatch):
    m = _model(2)
    ids = _ids(2, 5)
    key = jax.random.key(3)
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: None)
    plain = [np.asarray(generate(m, ids, 6)), np.asarray(generate(m, ids, 6, temperature=0.8, rng=key))]
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: store)
    calls = _spy(monkeypatch)
    for _ in range(2):  # stored, then read back by a "new process"
        lowered_cache._slot.cache_clear()
        cached = [np.asarray(generate(m, ids, 6)), np.asarray(generate(m, ids, 6, temperature=0.8, rng=key))]
        for a, b in zip(plain, cached):
            np.testing.assert_array_equal(a, b)
    assert calls == {"export": 2, "deserialize": 2}  # greedy and sampling: two programs


def test_rollouts_through_the_cache_equal_rollouts_without_it(store, monkeypatch, caplog):
    """`generate_batch`'s prefill and decode programs (which return a KVCache) are stored, a new
    process reads them back, and the tokens, lengths and log-probabilities are those of plain jit.
    Decode calls of 2 steps: the cache a read-back program returns goes into the next call."""
    from test_rollout import PROMPTS

    from jqlora.models.rollout import generate_batch

    m = _model(2)
    kw = dict(key=None, temperature=0.0, return_logprobs=True, stop_token_ids=[0], decode_chunk=2)
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: None)
    plain = generate_batch(m, PROMPTS, 7, **kw)
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: store)
    calls = _spy(monkeypatch)
    for _ in range(2):  # stored, then read back by a "new process"
        lowered_cache._slot.cache_clear()
        with caplog.at_level(logging.WARNING, logger="jqlora.lowered_cache"):
            cached = generate_batch(m, PROMPTS, 7, **kw)
        for f in ("tokens", "lengths", "finished", "logprobs"):
            np.testing.assert_array_equal(getattr(cached, f), getattr(plain, f), err_msg=f)
    assert "not stored" not in caplog.text and "cannot read" not in caplog.text, caplog.text
    assert calls == {"export": 2, "deserialize": 2}  # prefill and decode
    assert sorted(f.name.split("-")[0] for f in store.iterdir()) == ["rollout_decode", "rollout_prefill"]


def test_a_ring_cache_layout_survives_serialization():
    """A KVCache with ring layers out of a stored program: the same pytree structure (its layout
    tuples hash and compare equal) and the same arrays."""
    from jqlora.models.cache import KVCache

    c = KVCache(k=jnp.ones((1, 2, 8, 1, 4)), v=jnp.zeros((1, 2, 8, 1, 4)), segment_ids=jnp.ones((2, 8), jnp.int32),
                index=jnp.int32(3), ring_k=jnp.full((2, 2, 4, 1, 4), 2.0), ring_v=jnp.zeros((2, 2, 4, 1, 4)),
                layout=(("ring", 0), ("full", 0), ("ring", 1)))
    exported = jax.export.export(jax.jit(lambda c: dataclasses.replace(c, index=c.index + 1)))(c)
    back = jax.export.deserialize(exported.serialize())
    assert back.out_tree == jax.tree.structure(c) and hash(back.out_tree) == hash(jax.tree.structure(c))
    out = back.call(c)
    assert out.layout == c.layout and int(out.index) == 4
    np.testing.assert_array_equal(out.ring_k, c.ring_k)


def _train(steps=3):
    from flax import nnx

    from jqlora import lora
    from jqlora.train.optim import make_optimizer
    from jqlora.train.step import train_step

    m = _model(2)
    opt = nnx.Optimizer(m, make_optimizer(1e-2, 1, 10), wrt=nnx.LoRAParam)
    ids = np.asarray(_ids(1, 12))[None]
    batch = {"input_ids": ids, "targets": ids, "loss_mask": np.ones(ids.shape, np.float32),
             "positions": np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape)}
    step = train_step.bind(m, opt)
    losses, donated = [], []
    for _ in range(steps):
        before = jax.tree.leaves(nnx.state(m, nnx.LoRAParam))
        losses.append(float(step(batch)["loss"]))
        donated.append(all(a.is_deleted() for a in before))
    return losses, donated, {k: np.asarray(v) for k, v in jax.tree.leaves_with_path(lora.lora_params_by_module(m))}


def test_the_train_step_through_the_cache_equals_and_donates_as_without(store, monkeypatch):
    """The train step (`frozen_jit`'s bound step) through the cache: the same losses and LoRA
    weights as plain `jax.jit`, the LoRA state still donated, and a new process reads the entry."""
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: None)
    plain = _train()
    monkeypatch.setattr(lowered_cache, "cache_dir", lambda: store)
    calls = _spy(monkeypatch)
    for _ in range(2):
        lowered_cache._slot.cache_clear()
        cached = _train()
        assert cached[0] == plain[0] and cached[1] == plain[1] == [True] * 3, (cached[:2], plain[:2])
        assert cached[2].keys() == plain[2].keys()
        for k in plain[2]:
            np.testing.assert_array_equal(cached[2][k], plain[2][k])
    assert calls == {"export": 1, "deserialize": 1} and len(list(store.iterdir())) == 1
