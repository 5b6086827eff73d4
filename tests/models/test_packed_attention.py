"""Packed rows under cuDNN (jqlora.models.packed_attention): the segment tables, and the wiring from
the train loop's batches through the model, checked on CPU with the cuDNN call replaced by an
emulation built from the tables alone (the GPU test in test_models.py runs cuDNN itself)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jqlora import lora, models
from jqlora.models import packed_attention as pa
from jqlora.train.data import SegmentTables


def _runs_by_scan(row):
    """(start, length) of each maximal run of one nonzero id, by a plain loop."""
    runs, prev = [], 0
    for p, s in enumerate(row):
        if s != 0 and s == prev:
            runs[-1][1] += 1
        elif s != 0:
            runs.append([p, 1])
        prev = s
    return runs


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_segment_runs_match_a_direct_scan(b, t, m, seed):
    rng = np.random.default_rng(seed)
    # runs of random length over ids {0..3}: repeats of an id after a break, padding anywhere
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        p = 0
        while p < t:
            n = int(rng.integers(1, 8))
            seg[r, p:p + n] = rng.integers(0, 4)
            p += n
    lengths, offsets = pa.segment_runs(seg, m)
    # the jax path jitted whole: one compile per example instead of one per eager op
    jl, jo = jax.jit(pa.segment_runs, static_argnums=1)(jnp.asarray(seg), m)
    np.testing.assert_array_equal(np.asarray(jl), lengths)
    np.testing.assert_array_equal(np.asarray(jo), offsets)
    assert lengths.shape == (b, m) and offsets.shape == (b, m + 1)
    for r in range(b):
        runs = _runs_by_scan(seg[r])[:m]
        want_len = [n for _, n in runs] + [-1] * (m - len(runs))
        want_off = [p for p, _ in runs] + [-1] * (m + 1 - len(runs))
        assert lengths[r].tolist() == want_len
        assert offsets[r].tolist() == want_off


def test_table_width_and_tables_only_widen():
    one = np.ones((2, 16), np.int32)
    five = np.repeat(np.arange(1, 6), 3)[None].astype(np.int32)  # 5 runs in 15 tokens
    assert pa.table_width(one) == 4
    assert pa.table_width(five) == 8
    assert pa.table_width(five, at_least=16) == 16
    many = (np.arange(2 * (pa.MAX_WIDTH + 1)) // 2 + 1)[None].astype(np.int32)
    assert pa.table_width(many) is None
    tables = SegmentTables()
    b5 = tables.add({"segment_ids": five[None]})  # (grad_accum, batch, T) as train() stacks them
    assert b5["segment_lengths"].shape == (1, 1, 8) and b5["segment_offsets"].shape == (1, 1, 9)
    b1 = tables.add({"segment_ids": one[None]})
    assert b1["segment_lengths"].shape == (1, 2, 8)  # narrower rows keep the wider table
    assert b1["segment_lengths"][0, :, 0].tolist() == [16, 16]
    assert "segment_lengths" not in tables.add({"segment_ids": many[None]})  # the mask path


CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _model(attention):
    model = models.from_params(models.init_params(CFG, seed=0, std=0.1), CFG, quantize="nf4",
                               compute_dtype=jnp.float32, lora=lora.LoraConfig(rank=4),
                               rngs=nnx.Rngs(0), attention=attention)
    for _, layer in lora.named_linears(model):
        if layer.has_lora:
            layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.01))
    return model


@pytest.fixture
def emulated_cudnn(monkeypatch):
    """cuDNN's packed call replaced by `emulate_cudnn_packed`; counts the calls."""
    calls = []

    def fake(*args):
        calls.append(args[3].shape)
        return pa.emulate_cudnn_packed(*args)

    monkeypatch.setattr(pa, "available", lambda: True)
    monkeypatch.setattr(pa, "_cudnn_packed", fake)
    return calls


def test_packed_tables_give_the_mask_paths_loss_and_gradients(emulated_cudnn):
    """A packed batch as train() hands it to a cudnn model (segment tables added): the same loss
    sums and LoRA gradients as the einsum path's (T, T) mask; a table too narrow for a row's
    segments gives NaN, never a finite wrong loss."""
    from jqlora.train.step import _forward_sums

    t = 24
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128, (2, t + 1)).astype(np.int32)
    seg = np.zeros((2, t), np.int32)
    seg[0, :10], seg[0, 10:17], seg[0, 17:] = 1, 2, 3
    seg[1, :13], seg[1, 13:20] = 1, 2  # then 4 padding tokens
    starts = np.array([np.searchsorted(r, r) for r in seg])
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": seg,
             "loss_mask": (seg > 0).astype(np.float32),
             "positions": np.where(seg > 0, np.arange(t) - starts, 0).astype(np.int32)}
    with_tables = SegmentTables().add(dict(batch))

    @nnx.jit  # one compile per model and table width instead of one per eagerly dispatched op
    def forward_and_grads(model, b):
        (s, n), g = nnx.value_and_grad(lambda m: _forward_sums(m, b), has_aux=True,
                                       argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        return s, n, g

    def sums_and_grads(model, b):
        s, n, g = forward_and_grads(model, {k: jnp.asarray(v) for k, v in b.items()})
        return float(s), float(n), jax.tree.leaves(g)

    s_ref, n_ref, g_ref = sums_and_grads(_model("einsum"), batch)
    cudnn = _model("cudnn")
    s, n, g = sums_and_grads(cudnn, with_tables)
    assert emulated_cudnn and all(shape == (2, 4) for shape in emulated_cudnn)
    assert n == n_ref == 24 + 20
    np.testing.assert_allclose(s, s_ref, rtol=1e-6)
    for a, b in zip(g, g_ref):
        # the two attention paths sum in their own order: an entry that cancels to a small value
        # carries the rounding of the large terms (a few float32 ulps of the leaf's largest entry)
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    narrow = dict(batch)
    narrow["segment_lengths"], narrow["segment_offsets"] = pa.segment_runs(seg, 2)  # row 0 has 3
    assert np.isnan(sums_and_grads(cudnn, narrow)[0])


def _garbage_outside_runs(q, k, v, lengths, offsets, scale):
    """cuDNN's packed call as it behaves on a GPU: outputs AND dq/dk/dv of tokens outside every
    run are never written, so they hold whatever memory held (NaN here)."""
    t = q.shape[1]
    p = jnp.arange(t)[None, :]
    start, n = offsets[:, None, :-1], lengths[:, None, :]
    inside = ((n > 0) & (p[:, :, None] >= start) & (p[:, :, None] < start + n)).any(-1)
    dirty = lambda a: jnp.where(inside[:, :, None, None], a, jnp.asarray(jnp.nan, a.dtype))  # noqa: E731

    @jax.custom_vjp
    def call(q, k, v):
        return dirty(pa.emulate_cudnn_packed(q, k, v, lengths, offsets, scale))

    def fwd(q, k, v):
        out, vjp = jax.vjp(lambda *a: pa.emulate_cudnn_packed(*a, lengths, offsets, scale), q, k, v)
        return dirty(out), vjp

    def bwd(vjp, g):
        return tuple(dirty(d) for d in vjp(g))

    call.defvjp(fwd, bwd)
    return call(q, k, v)


def test_padding_tokens_never_reach_the_gradients(monkeypatch):
    """A packed row with padding: cuDNN leaves the outputs and the gradients of padding tokens
    unwritten (garbage, NaN here); the attention's outputs and q/k/v gradients must stay finite
    and equal the clean emulation's."""
    monkeypatch.setattr(pa, "available", lambda: True)
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 4, 4, 4, 0]], np.int32)
    runs = tuple(jnp.asarray(a) for a in pa.segment_runs(seg, 4))
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 8, 4, 8))
    k = jax.random.normal(kk, (2, 8, 2, 8))
    v = jax.random.normal(kv, (2, 8, 2, 8))
    w = jax.random.normal(jax.random.key(1), (2, 8, 4, 8))

    def loss(q, k, v):
        return jnp.sum(pa.packed_causal_attention(q, k, v, jnp.asarray(seg), runs, scale=0.3) * w)

    monkeypatch.setattr(pa, "_cudnn_packed", pa.emulate_cudnn_packed)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    monkeypatch.setattr(pa, "_cudnn_packed", _garbage_outside_runs)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
