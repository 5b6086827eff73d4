"""Every mixture-of-experts checkpoint layout jqlora reads (tests/support/moe_checkpoints.py):
per-expert float keys (Qwen3-MoE gate/up/down, Mixtral w1/w3/w2), transformers 5's fused 3-D
tensors, transformers + bitsandbytes NF4 (experts left dense, quantized at load), unsloth-style
per-expert Linear4bit / Linear8bitLt, and stacks quantized whole by bitsandbytes'
`replace_parameter_4bit`. The experts jqlora holds dequantize bit for bit as bitsandbytes
dequantizes them, and the logits match transformers (fp32, train mode: bitsandbytes' exact path).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

import jax.numpy as jnp  # noqa: E402

import moe_checkpoints as mc  # noqa: E402
from jqlora import models, quant  # noqa: E402
from jqlora.lora.experts import Router  # noqa: E402

pytestmark = pytest.mark.torch


def _ids():
    return np.random.default_rng(0).integers(0, 256, (2, 10))


def _experts(m):
    """{"model.layers.N.mlp.experts.gate_up_proj" | ...: the ExpertWeights jqlora holds}."""
    out = {}
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer.mlp, "experts"):
            for p in ("gate_up_proj", "down_proj"):
                out[f"model.layers.{i}.mlp.experts.{p}"] = getattr(layer.mlp.experts, p).base.get_value()
    return out


def _reference(directory, train=True, experts=None):
    """transformers' model of `directory` (NF4 / int8 attention as bitsandbytes loads it), with its
    expert stacks replaced by `experts` ({name: (E, out, in) tensor}) when given."""
    from transformers import AutoModelForCausalLM

    mc._quiet()
    m = AutoModelForCausalLM.from_pretrained(str(directory), device_map="cpu", dtype=torch.float32,
                                             attn_implementation="eager")
    if experts:
        params = dict(m.named_parameters())
        with torch.no_grad():
            for name, w in experts.items():
                params[name].copy_(w)
    return m.train() if train else m.eval()


def _logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor(ids)).logits.float().numpy()


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("kind, layout", [("qwen3_moe", "expert_nf4"), ("qwen3_moe", "expert_int8"),
                                          ("qwen3_moe", "fused_nf4"), ("mixtral", "expert_nf4")])
def test_quantized_experts_are_bit_identical_to_bitsandbytes(tmp_path_factory, kind, layout):
    path = mc.cached(tmp_path_factory, kind, layout)
    m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    held = _experts(m)
    ref = mc.bnb_expert_stacks(path)
    assert set(held) == {k for k in ref if ".experts." in k} and held
    fmt = "int8" if layout == "expert_int8" else "nf4"
    for name, w in held.items():
        assert w.format == fmt, name
        np.testing.assert_array_equal(np.asarray(quant.dequantize_experts(w, jnp.float32)), ref[name].numpy(), name)
    # the router stays dense (unsloth's v4-era files quantize it: dequantized exactly)
    gate = m.model.layers[0].mlp.gate
    assert isinstance(gate, Router) and not isinstance(gate.base.get_value(), (quant.Weight4bit, quant.Int8Weight))
    if layout == "expert_nf4":  # experts and router bnb-dequantized into transformers: the same logits
        nf4 = mc.cached(tmp_path_factory, kind, "nf4")
        assert _rel(m(jnp.asarray(_ids())), _logits(_reference(nf4, experts=ref), _ids())) < 1e-4


@pytest.mark.parametrize("kind, layout", [("qwen3_moe", "plain"), ("qwen3_moe", "fused"), ("mixtral", "plain")])
def test_float_layouts_match_transformers(tmp_path_factory, kind, layout):
    path = mc.cached(tmp_path_factory, kind, layout)
    m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    assert {w.format for w in _experts(m).values()} == {"dense"}  # a plain checkpoint stays plain
    ref = _logits(mc.tiny_moe(kind), _ids())  # the model the folder was saved from
    assert _rel(m(jnp.asarray(_ids())), ref) < 2e-5


def test_dense_experts_in_a_quantized_checkpoint_are_quantized_at_load(tmp_path_factory):
    path = mc.cached(tmp_path_factory, "qwen3_moe", "nf4")  # transformers + bnb: experts left dense
    auto = models.load_causal_lm(path, compute_dtype=jnp.float32)
    assert {w.format for w in _experts(auto).values()} == {"nf4"}
    kept = models.load_causal_lm(path, compute_dtype=jnp.float32, quantize_experts="none")
    assert {w.format for w in _experts(kept).values()} == {"dense"}
    assert _rel(kept(jnp.asarray(_ids())), _logits(_reference(path), _ids())) < 1e-4
    plain = mc.cached(tmp_path_factory, "qwen3_moe", "plain")
    q = models.load_causal_lm(plain, compute_dtype=jnp.float32, quantize="nf4")
    assert {w.format for w in _experts(q).values()} == {"nf4"}
    assert isinstance(q.model.layers[0].mlp.gate.base.get_value(), jnp.ndarray)  # never the router


def test_bad_expert_tensors_are_named(tmp_path_factory):
    from jqlora.models.build import from_params

    tm = mc.tiny_moe("mixtral")
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    cfg = tm.config.to_dict()
    bad = {**params, "model.layers.1.mlp.experts.down_proj": params["model.layers.1.mlp.experts.down_proj"][:3]}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj: shape \(3, 64, 64\)"):
        from_params(bad, cfg)
    per_expert = {k: v for k, v in params.items() if ".experts." not in k}
    per_expert["model.layers.0.block_sparse_moe.experts.0.w1.weight"] = params[
        "model.layers.0.mlp.experts.gate_up_proj"][0, :64]
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight"):
        from_params(per_expert, cfg)
    with pytest.raises(ValueError, match="quantize_experts"):
        from_params(params, cfg, quantize_experts="int4")


def test_donated_expert_tensors_are_freed_once_stacked():
    """`load_causal_lm` owns its tensors: per-expert device arrays are deleted once stacked and
    quantized (a 30B MoE's bf16 experts would otherwise stay beside their NF4 copy)."""
    from jqlora.models.build import from_params
    from safetensors.torch import load_file
    import tempfile

    tm = mc.tiny_moe("mixtral")
    with tempfile.TemporaryDirectory() as d:
        tm.save_pretrained(d)  # per-expert keys (w1 / w3 / w2)
        params = {k: jnp.asarray(v.numpy()) for k, v in load_file(f"{d}/model.safetensors").items()}
    expert = [v for k, v in params.items() if ".experts." in k]
    ids = jnp.asarray(_ids())
    ref = _logits(tm, _ids())
    donated = from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32, quantize_experts="none",
                          donate_params=True)
    assert expert and all(a.is_deleted() for a in expert)  # gate and up joined, so every source is a copy
    assert {w.format for w in _experts(donated).values()} == {"dense"}
    assert _rel(donated(ids), ref) < 2e-5
