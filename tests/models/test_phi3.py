"""Phi-3 / Phi-4-mini against transformers (eager attention) and PEFT on CPU, float32, at the same format.

A tiny random Phi-3 (tests/support/family_checkpoints.py: PHI3) with its fused `qkv_proj` and
`gate_up_proj`, LongRoPE whose original length (8) is shorter than the test sequences (the long
factors apply) and longer than a short one (the short factors apply), partial rotary (0.75) and a
sliding window shorter than the sequence.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import family_checkpoints as fc  # noqa: E402
from jqlora import lora, models, quant  # noqa: E402
from jqlora.models.config import ModelConfig, rope_attention_scaling  # noqa: E402
from jqlora.lora.config import peft_target_modules  # noqa: E402

pytestmark = pytest.mark.torch

T = 20  # past original_max_position_embeddings (8) and the window (12)
SHORT = 7  # inside original_max_position_embeddings: the short factors


def _ids(b=2, t=T, seed=0):
    return np.random.default_rng(seed).integers(0, fc.TINY["vocab_size"], (b, t))


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _torch_forward(m, ids):
    with torch.no_grad():
        out = m(torch.tensor(ids), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


@pytest.fixture(scope="module")
def phi3():
    tm = fc.text_model(fc.PHI3)
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    return tm, params, tm.config.to_dict()


def test_config_reads_fused_projections_longrope_and_partial_rotary(phi3):
    tm, _, cfg = phi3
    c = ModelConfig.from_hf(cfg)
    assert c.fused_projections and c.rope_type == "longrope" and c.rotary_dim == 24
    assert c.sliding_windows == (12,) * 4
    assert rope_attention_scaling(c) == pytest.approx(tm.model.rotary_emb.attention_scaling, rel=1e-12)
    assert rope_attention_scaling(c) > 1.0  # factor 128 / 8: the scale is in play
    # "su" is the older name of the same rope type
    old = dict(cfg, rope_parameters=None, rope_scaling={**cfg["rope_parameters"], "type": "su", "rope_type": "su"})
    assert ModelConfig.from_hf(old).rope_params == c.rope_params


@pytest.mark.parametrize("t", [T, SHORT])
def test_logits_and_every_layer_match_transformers_fp32(phi3, t):
    tm, params, cfg = phi3
    ids = _ids(t=t)
    ref, ref_states = _torch_forward(tm, ids)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    logits, states = m(jnp.asarray(ids), return_states=True)
    assert _rel(logits, ref) < 2e-5, t
    for i, h in enumerate(states["layers"][:-1]):
        assert _rel(h, ref_states[i + 1]) < 2e-5, (t, i)


def test_bf16_compute_matches_transformers_bf16(phi3):
    _, params, cfg = phi3
    ids = _ids()
    ref, _ = _torch_forward(fc.text_model(fc.PHI3, dtype=torch.bfloat16), ids)
    m = models.from_params({k: v.astype(jnp.bfloat16) for k, v in params.items()}, cfg, compute_dtype=jnp.bfloat16)
    assert _rel(m(jnp.asarray(ids)).astype(jnp.float32), ref) < 3e-2


@pytest.mark.parametrize("fmt", ["bf16", "nf4", "int8"])
def test_saved_folders_match_transformers(tmp_path_factory, fmt):
    """The fused linears through bitsandbytes' 4-bit and 8-bit formats and a plain bf16 folder:
    bitsandbytes' training path (dequantize + linear) in float32, as for Llama."""
    path = fc.cached(tmp_path_factory, "phi3", fmt)
    ids = _ids()
    tm = fc.load_with_transformers(path, train=True)
    ref, _ = _torch_forward(tm.float() if fmt == "bf16" else tm, ids)
    m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    kind = {"bf16": jax.Array, "nf4": quant.Weight4bit, "int8": quant.Int8Weight}[fmt]
    for lin in (m.model.layers[0].self_attn.qkv_proj, m.model.layers[0].mlp.gate_up_proj):
        assert isinstance(lin.base.get_value(), kind), fmt
    assert _rel(m(jnp.asarray(ids)), ref) < 1e-4


def _peft_model(targets, seed=1):
    """PEFT LoRA on a fresh transformers Phi-3 with random (nonzero) B; -> (peft model, {module: A, B})."""
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(fc.text_model(fc.PHI3), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_B") and "default" in getattr(mod, "lora_B", {}):
                mod.lora_B["default"].weight.copy_(0.1 * torch.randn(mod.lora_B["default"].weight.shape, generator=g))
                values[name.removeprefix("base_model.model.")] = {
                    "lora_A": mod.lora_A["default"].weight.numpy().copy(),
                    "lora_B": mod.lora_B["default"].weight.numpy().copy()}
    return pm, values


def test_lora_gradients_match_peft_on_the_fused_projections(phi3):
    """`all-linear` on both sides: LoRA on qkv_proj, o_proj, gate_up_proj, down_proj; loss and each
    A and B gradient equal PEFT's."""
    _, params, cfg = phi3
    pm, values = _peft_model("all-linear")
    assert {n.rsplit(".", 1)[-1] for n in values} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    ids = _ids()
    x, y = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    logits = pm(x).logits
    loss_t = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss_t.backward()
    ref = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad.numpy()
           for n, p in pm.named_parameters() if p.grad is not None}

    m = models.from_params(params, cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                           lora=lora.LoraConfig(rank=4, alpha=8, target_modules="all-linear"))
    lora.set_lora_params(m, values)

    def loss_fn(model):
        lg = model(jnp.asarray(ids[:, :-1])).astype(jnp.float32)
        lp = jax.nn.log_softmax(lg, -1)
        return -jnp.take_along_axis(lp, jnp.asarray(ids[:, 1:])[..., None], -1).mean()

    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
    assert abs(float(loss) - float(loss_t)) < 1e-5
    got = lora.lora_state_by_module(m, grads)
    assert sorted(got) == sorted(values)
    for name, g_ in got.items():
        for k in ("lora_A", "lora_B"):
            assert _rel(g_[k], ref[f"{name}.{k}.weight"]) < 1e-4, (name, k)


def test_peft_adapter_round_trip_keeps_the_fused_names(phi3, tmp_path_factory, tmp_path):
    """An adapter on qkv_proj / gate_up_proj: PEFT's file loads into jqlora, jqlora's export loads
    with PeftModel.from_pretrained on the NF4 folder, and `crosscheck` (transformers + bitsandbytes
    + PEFT, layer by layer) passes with it; the bf16 merge loads in transformers and equals PEFT."""
    import json

    from peft import PeftModel

    from jqlora import adapters
    from jqlora.crosscheck import crosscheck
    from jqlora.merge import merge_adapter

    path = fc.cached(tmp_path_factory, "phi3", "nf4")
    pm, values = _peft_model(["qkv_proj", "gate_up_proj"])
    pm.save_pretrained(tmp_path / "peft")
    model, report, cfg = adapters.load_model_with_adapter(path, tmp_path / "peft")
    assert sorted(report["matched"]) == sorted(values) and "qkv_proj" in cfg.target_modules

    out = adapters.save_adapter(tmp_path / "ours", model, cfg, base_model=str(path))
    keys = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    assert keys == ["gate_up_proj", "qkv_proj"]
    tm = PeftModel.from_pretrained(fc.load_with_transformers(path), out).train()  # bnb's exact path; no dropout
    ids = _ids()
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.float().numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    base = np.asarray(models.load_causal_lm(path, compute_dtype=jnp.float32)(jnp.asarray(ids)))
    assert _rel(got, ref) < 1e-4 and _rel(base, ref) > 1e-3  # the adapter matters and matches

    res = crosscheck(path, adapter=out, tokens=T, batch=1)
    assert res.passed and len(res.layers) >= 4, res.format()

    merged = merge_adapter(path, out, tmp_path / "merged", format="bf16")
    assert merged["merged"] == len(values)
    mt = fc.load_with_transformers(tmp_path / "merged").float()
    with torch.no_grad():
        got_m = mt(torch.tensor(ids)).logits.float().numpy()
    assert _rel(got_m, ref) < 3e-2  # the merged weights are rounded to bf16

    merge_adapter(path, out, tmp_path / "merged-nf4", format="nf4", force=True)  # fused weights re-quantized
    q_ref, _ = _torch_forward(fc.load_with_transformers(tmp_path / "merged-nf4", train=True), ids)
    ours = models.load_causal_lm(tmp_path / "merged-nf4", compute_dtype=jnp.float32)(jnp.asarray(ids))
    assert _rel(ours, q_ref) < 1e-4
    assert _rel(q_ref, ref) < 0.2  # NF4 keeps the adapted model roughly


def test_target_modules_name_the_fused_projections(phi3):
    _, params, cfg = phi3
    m = models.from_params(params, cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                           lora=lora.LoraConfig(rank=2, alpha=4, target_modules=("qkv_proj",)))
    names = sorted(lora.lora_params_by_module(m))
    assert names == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(4)]
    assert lora.lora_params_by_module(m)[names[0]]["lora_B"].shape == (4 * 32 + 2 * 2 * 32, 2)


def test_default_targets_reach_the_fused_projections_and_peft_names_them(phi3):
    """The default targets (q/k/v/o/gate/up/down) put LoRA on every projection of Phi-3, the fused
    ones included, and the PEFT config lists qkv_proj and gate_up_proj (else PEFT drops them)."""
    _, params, cfg = phi3
    conf = lora.LoraConfig(rank=2, alpha=4)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0), lora=conf)
    leaves = {n.rsplit(".", 1)[-1] for n in lora.lora_params_by_module(m)}
    assert leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    targets = peft_target_modules(conf.target_modules, list(lora.lora_params_by_module(m)))
    assert {"qkv_proj", "gate_up_proj"} <= set(targets)


def test_generation_across_the_original_length_equals_transformers(phi3):
    """A 5-token prompt and 12 new tokens pass original_max_position_embeddings (8): transformers
    recomputes the cache with the long factors there, and so does `generate`; tokens and each
    step's logits (ring-buffer caches: the window is 12) equal transformers'."""
    tm, params, cfg = phi3
    prompt = _ids(1, 5, seed=3)
    with torch.no_grad():
        r = tm.generate(torch.tensor(prompt), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    ref = torch.stack(r.logits, 1).numpy()
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    seq, logits = models.generate(m, jnp.asarray(prompt), max_new_tokens=12, return_logits=True)
    np.testing.assert_array_equal(np.asarray(seq)[0, 5:], r.sequences[0, 5:].numpy())
    assert _rel(logits, ref) < 1e-5
