"""Generation with the decoder layers sliced once before the decode loop (`decode_layers="hoisted"`)
against the scan over stacked layers inside it ("scanned"), and the "auto" choice between them;
the hoisted layers' fused projections (q|k|v, gate|up as one product each) against the layers
run apart; decoding attention through the `decode_attention` kernel against the einsum path."""
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import models, quant
from jqlora.models import generate, remat
from decode_kernel_calls import record_kernel_calls, record_norm_calls
from test_scan import CFG, _ids, _model

# the package re-exports the function `generate`, which shadows the module of the same name
gen = importlib.import_module("jqlora.models.generate")


def _multi_stack_model():
    """Four layers, LoRA on layer 1 only: stacks [0], [1], [2, 3] (a stack that starts past 0 and
    holds two layers, so each layer's KV-cache row start + j matters)."""
    m = _model(4, targets=("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"))
    assert [(s.start, s.size) for s in m.model.layers.stacks] == [(0, 1), (1, 1), (2, 2)]
    return m


def _left_padded_prompt():
    ids = _ids(2, 6, seed=3)
    mask = jnp.asarray([[1] * 6, [0, 0, 1, 1, 1, 1]], jnp.int32)
    return ids, mask


def test_hoisted_decode_equals_scanned_and_a_full_forward():
    m = _multi_stack_model()
    ids, mask = _left_padded_prompt()
    n = 5
    runs = {how: generate(m, ids, n, attention_mask=mask, return_logits=True, decode_layers=how)
                for how in ("scanned", "hoisted")}
    (seq_s, scores_s), (seq_h, scores_h) = runs["scanned"], runs["hoisted"]
    np.testing.assert_array_equal(np.asarray(seq_h), np.asarray(seq_s))
    np.testing.assert_allclose(np.asarray(scores_h), np.asarray(scores_s), rtol=1e-5, atol=1e-5)
    # both against one forward over prompt + generated tokens, without a cache: the logits each
    # new token was chosen from are those of the position before it
    full_mask = jnp.concatenate([mask, jnp.ones((2, n), jnp.int32)], axis=1)
    positions = jnp.maximum(jnp.cumsum(full_mask, axis=1) - 1, 0)
    ref = m(seq_h, positions=positions, segment_ids=full_mask)[:, ids.shape[1] - 1:-1]
    np.testing.assert_allclose(np.asarray(scores_h), np.asarray(ref), rtol=1e-4, atol=1e-4)
    assert len({tuple(r) for r in np.asarray(seq_h[:, 6:])}) == 2  # rows differ: the padding matters


def test_fused_projections_decode_as_the_projections_apart():
    """Layer 1 has LoRA on q_proj (not k, v) and down_proj: the fused q|k|v carries one LoRA block."""
    m = _multi_stack_model()
    ids, mask = _left_padded_prompt()
    runs = {fuse: generate(m, ids, 6, attention_mask=mask, return_logits=True, decode_layers="hoisted",
                           fuse_projections=fuse) for fuse in (True, False)}
    np.testing.assert_array_equal(np.asarray(runs[True][0]), np.asarray(runs[False][0]))
    np.testing.assert_allclose(np.asarray(runs[True][1]), np.asarray(runs[False][1]), rtol=1e-5, atol=1e-5)


def _hoisted_layer(m, fuse: bool):
    hoisted = gen.decode_layer_states(m, True, fuse)
    first = hoisted[0]
    return nnx.merge(first.graphdef, *first.states[0]), [h.left_apart for h in hoisted]


def test_hoisted_layers_run_four_products_where_seven_were():
    m = _multi_stack_model()
    layer, left = _hoisted_layer(m, True)
    assert hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
    assert not any(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert left == [{}, {}, {}]
    assert layer.self_attn.qkv_proj.out_features == m.config.q_features + 2 * m.config.kv_features
    apart, _ = _hoisted_layer(m, False)
    assert hasattr(apart.self_attn, "q_proj") and not hasattr(apart.self_attn, "qkv_proj")


def test_projections_of_different_formats_stay_apart():
    params = models.init_params({**CFG, "num_hidden_layers": 2}, seed=0, std=0.1)
    params = {k: quant.quantize_4bit(v) if k.endswith("proj.weight") and "k_proj" not in k else v
              for k, v in params.items()}  # k_proj left dense, as a skip list leaves a module
    m = _model(2, quantize=None, params=params)
    assert not isinstance(m.model.layers[0].self_attn.k_proj.base.get_value(), quant.Weight4bit)
    layer, left = _hoisted_layer(m, True)
    assert hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_up_proj")
    assert "mixed formats" in left[0]["self_attn"]
    ids, mask = _left_padded_prompt()
    fused, apart = (generate(m, ids, 4, attention_mask=mask, decode_layers="hoisted", fuse_projections=f)
                    for f in (True, False))
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(apart))


def test_hoisted_lora_matrices_are_in_the_compute_dtype():
    """Every product rounds LoRA to the compute dtype; hoisted, they are cast once, not per token."""
    from jqlora import lora
    params = models.init_params({**CFG, "num_hidden_layers": 2}, seed=0, std=0.1)
    m = models.from_params(params, {**CFG, "num_hidden_layers": 2}, quantize="nf4", compute_dtype=jnp.bfloat16,
                           lora=lora.LoraConfig(rank=4), rngs=nnx.Rngs(0))
    for fuse in (True, False):
        layer, _ = _hoisted_layer(m, fuse)
        mats = [v[...] for _, v in nnx.iter_graph(layer) if isinstance(v, nnx.LoRAParam)]
        assert mats and all(a.dtype == jnp.bfloat16 for a in mats), fuse
    assert m.model.layers[0].self_attn.q_proj.lora_A[...].dtype == jnp.float32  # the model is untouched
    ids, mask = _left_padded_prompt()
    hoisted, scanned = (generate(m, ids, 4, attention_mask=mask, decode_layers=how) for how in ("hoisted", "scanned"))
    np.testing.assert_array_equal(np.asarray(hoisted), np.asarray(scanned))


def _lowered(m, hoist: bool) -> str:
    graphdef, state = nnx.split(m)
    ids = _ids(1, 5)
    return gen._generate.lower(state, ids, jnp.ones_like(ids), None, jnp.full((1,), -1, jnp.int32),
                               jnp.float32(0.0), jnp.float32(1.0), jnp.int32(4), graphdef=graphdef,
                               bucket=gen.TOKEN_BUCKET,
                               greedy=True, use_top_p=False, return_logits=False, hoist=hoist,
                               fuse=True).as_text()


@pytest.mark.parametrize("multi", [False, True])
def test_hoisted_decode_loop_has_no_scan_over_layers(multi):
    m = _multi_stack_model() if multi else _model(2)
    stacks = m.model.layers.stacks
    scanned, hoisted = _lowered(m, False), _lowered(m, True)
    # the prefill scans each stack in both; only the scanned decode loop scans them again
    assert scanned.count("stablehlo.while") - hoisted.count("stablehlo.while") == len(stacks)
    # inside the hoisted loop: one lowered layer function per stack, called once per layer
    calls = re.findall(r"call @(one_layer\w*)", hoisted)
    assert len(calls) == m.config.num_hidden_layers and len(set(calls)) == len(stacks), calls
    assert "one_layer" not in scanned


def test_auto_hoists_only_where_two_copies_of_the_layers_fit(monkeypatch):
    m = _model(2)
    batch, max_len = 2, 5 + gen.TOKEN_BUCKET
    weights = remat.state_bytes(m)
    layers = remat.state_bytes(m.model.layers)
    kv = m.init_cache(batch, max_len)
    need = weights + layers + kv.k.nbytes + kv.v.nbytes
    assert 0 < layers < weights

    def hoists(limit):
        monkeypatch.setattr(gen, "device_memory", lambda: limit)
        return gen.hoist_layers(m, batch, max_len)

    assert hoists(None) is False  # a CPU: no limit reported, copies are cheap
    assert hoists(1 << 50) is True
    assert hoists(int(need / 0.9) + 2) is True
    assert hoists(int(need / 0.9) - 2) is False
    assert hoists(int((need - layers) / 0.9) + 2) is False  # fits once, not with a second copy of the layers
    monkeypatch.setattr(gen, "device_memory", lambda: 0)
    assert gen.hoist_layers(m, batch, max_len, "hoisted") is True  # explicit choices ignore memory
    monkeypatch.setattr(gen, "device_memory", lambda: 1 << 50)
    assert gen.hoist_layers(m, batch, max_len, "scanned") is False
    with pytest.raises(ValueError, match="decode_layers must be one of"):
        gen.hoist_layers(m, batch, max_len, "unrolled")
    with pytest.raises(ValueError, match="decode_layers must be one of"):
        generate(m, _ids(1, 5), 2, decode_layers="unrolled")


def test_generate_passes_the_auto_choice_to_the_compiled_program(monkeypatch):
    m = _model(2)
    seen = []

    def record(*args, bucket, **kw):
        seen.append(kw["hoist"])
        b = args[1].shape[0]
        return jnp.zeros((b, bucket), jnp.int32), jnp.zeros((b, 0, m.config.vocab_size), jnp.float32)

    monkeypatch.setattr(gen, "_generate", record)
    for limit, hoist in ((None, False), (1 << 50, True), (1, False)):
        monkeypatch.setattr(gen, "device_memory", lambda limit=limit: limit)
        generate(m, _ids(1, 5), 2)
        assert seen[-1] is hoist, (limit, seen)


@pytest.mark.parametrize("how", ["scanned", "hoisted"])
def test_generation_through_the_kernel_equals_the_einsum_path(how, monkeypatch):
    """Left-padded rows, a model of three layer stacks (each layer's cache row matters): the same
    tokens, logits to float32 rounding. The attention and norm kernels must run (call counters say
    so), the norm after the attention with the residual add in it."""
    calls = record_kernel_calls(monkeypatch)
    norms = record_norm_calls(monkeypatch)
    m = _multi_stack_model()
    ids, mask = _left_padded_prompt()
    out = {}
    for backend in ("xla", "interpret"):
        m.backend = backend
        out[backend] = generate(m, ids, 5, attention_mask=mask, return_logits=True, decode_layers=how)
    assert calls, "the kernel did not run"
    assert {n["backend"] for n in norms} == {"interpret"}
    assert any(n["delta_shape"] is None for n in norms), "the norms without a residual add did not run"
    assert any(n["delta_shape"] == (2, 1, CFG["hidden_size"]) for n in norms), "the add-and-norm did not run"
    np.testing.assert_array_equal(np.asarray(out["interpret"][0]), np.asarray(out["xla"][0]))
    np.testing.assert_allclose(np.asarray(out["interpret"][1]), np.asarray(out["xla"][1]), rtol=1e-5, atol=1e-5)
