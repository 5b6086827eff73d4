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


@pytest.fixture(scope="module")
def phi3():
    tm = fc.text_model(fc.PHI3)
    params = fc.jax_params(tm)
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
    ids = fc.ids(t=t)
    ref, ref_states = fc.torch_forward(tm, ids)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    logits, states = m(jnp.asarray(ids), return_states=True)
    assert fc.rel_error(logits, ref) < 2e-5, t
    for i, h in enumerate(states["layers"][:-1]):
        assert fc.rel_error(h, ref_states[i + 1]) < 2e-5, (t, i)


def test_bf16_compute_matches_transformers_bf16(phi3):
    _, params, cfg = phi3
    ids = fc.ids()
    ref, _ = fc.torch_forward(fc.text_model(fc.PHI3, dtype=torch.bfloat16), ids)
    m = models.from_params({k: v.astype(jnp.bfloat16) for k, v in params.items()}, cfg, compute_dtype=jnp.bfloat16)
    assert fc.rel_error(m(jnp.asarray(ids)).astype(jnp.float32), ref) < 3e-2


@pytest.mark.parametrize("fmt", ["bf16", "nf4", "int8"])
def test_saved_folders_match_transformers(tmp_path_factory, fmt):
    """The fused linears through bitsandbytes' 4-bit and 8-bit formats and a plain bf16 folder:
    bitsandbytes' training path (dequantize + linear) in float32, as for Llama."""
    path = fc.cached(tmp_path_factory, "phi3", fmt)
    ids = fc.ids()
    tm = fc.load_with_transformers(path, train=True)
    ref, _ = fc.torch_forward(tm.float() if fmt == "bf16" else tm, ids)
    m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    kind = {"bf16": jax.Array, "nf4": quant.Weight4bit, "int8": quant.Int8Weight}[fmt]
    for lin in (m.model.layers[0].self_attn.qkv_proj, m.model.layers[0].mlp.gate_up_proj):
        assert isinstance(lin.base.get_value(), kind), fmt
    assert fc.rel_error(m(jnp.asarray(ids)), ref) < 1e-4


def test_lora_gradients_match_peft_on_the_fused_projections(phi3):
    """`all-linear` on both sides: LoRA on qkv_proj, o_proj, gate_up_proj, down_proj; loss and each
    A and B gradient equal PEFT's."""
    _, params, cfg = phi3
    pm, values = fc.peft_model(fc.PHI3, "all-linear")
    assert {n.rsplit(".", 1)[-1] for n in values} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    ids = fc.ids()
    loss_t, ref = fc.peft_loss_and_grads(pm, ids)

    m = models.from_params(params, cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                           lora=lora.LoraConfig(rank=4, alpha=8, target_modules="all-linear"))
    lora.set_lora_params(m, values)
    loss, got = fc.lora_loss_and_grads(m, ids)
    assert abs(loss - loss_t) < 1e-5
    assert sorted(got) == sorted(values)
    for name, g_ in got.items():
        for k in ("lora_A", "lora_B"):
            assert fc.rel_error(g_[k], ref[f"{name}.{k}.weight"]) < 1e-4, (name, k)


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
    pm, values = fc.peft_model(fc.PHI3, ["qkv_proj", "gate_up_proj"])
    pm.save_pretrained(tmp_path / "peft")
    model, report, cfg = adapters.load_model_with_adapter(path, tmp_path / "peft")
    assert sorted(report["matched"]) == sorted(values) and "qkv_proj" in cfg.target_modules

    out = adapters.save_adapter(tmp_path / "ours", model, cfg, base_model=str(path))
    keys = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    assert keys == ["gate_up_proj", "qkv_proj"]
    tm = PeftModel.from_pretrained(fc.load_with_transformers(path), out).train()  # bnb's exact path; no dropout
    ids = fc.ids()
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.float().numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    base = np.asarray(models.load_causal_lm(path, compute_dtype=jnp.float32)(jnp.asarray(ids)))
    assert fc.rel_error(got, ref) < 1e-4 and fc.rel_error(base, ref) > 1e-3  # the adapter matters and matches

    res = crosscheck(path, adapter=out, tokens=T, batch=1)
    assert res.passed and len(res.layers) >= 4, res.format()

    merged = merge_adapter(path, out, tmp_path / "merged", format="bf16")
    assert merged["merged"] == len(values)
    mt = fc.load_with_transformers(tmp_path / "merged").float()
    with torch.no_grad():
        got_m = mt(torch.tensor(ids)).logits.float().numpy()
    assert fc.rel_error(got_m, ref) < 3e-2  # the merged weights are rounded to bf16

    merge_adapter(path, out, tmp_path / "merged-nf4", format="nf4", force=True)  # fused weights re-quantized
    q_ref, _ = fc.torch_forward(fc.load_with_transformers(tmp_path / "merged-nf4", train=True), ids)
    ours = models.load_causal_lm(tmp_path / "merged-nf4", compute_dtype=jnp.float32)(jnp.asarray(ids))
    assert fc.rel_error(ours, q_ref) < 1e-4
    assert fc.rel_error(q_ref, ref) < 0.2  # NF4 keeps the adapted model roughly


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


@pytest.mark.parametrize("decode_layers", ["scanned", "hoisted"])
def test_generation_across_the_original_length_equals_transformers(phi3, decode_layers):
    """A 5-token prompt and 12 new tokens pass original_max_position_embeddings (8): transformers
    recomputes the cache with the long factors there, and so does `generate`; tokens and each
    step's logits (ring-buffer caches: the window is 12) equal transformers'. Hoisted: the
    checkpoint's own qkv_proj and gate_up_proj, nothing more to fuse."""
    tm, params, cfg = phi3
    prompt = fc.ids(1, 5, seed=3)
    with torch.no_grad():
        r = tm.generate(torch.tensor(prompt), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    ref = torch.stack(r.logits, 1).numpy()
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    seq, logits = models.generate(m, jnp.asarray(prompt), max_new_tokens=12, return_logits=True,
                                  decode_layers=decode_layers)
    np.testing.assert_array_equal(np.asarray(seq)[0, 5:], r.sequences[0, 5:].numpy())
    assert fc.rel_error(logits, ref) < 1e-5


def test_batched_rollouts_switch_each_row_to_the_long_factors_as_transformers():
    """`generate_batch` of a 3- and a 6-token prompt, 12 new tokens each: the rows pass
    original_max_position_embeddings (8) at different steps, in different decode calls (chunks of
    3 steps, a stop id that never comes). Each row's greedy tokens and log-probabilities equal
    transformers' greedy `generate` of that prompt alone, which recomputes the cache with the long
    factors when the sequence passes 8 (the window, 12, keeps ring-buffer caches in play). The
    final norm is scaled up so the logits spread: a key left with the short factors, or a row
    switched by another row's length, moves the log-probabilities by about 2e-3."""
    tm = fc.text_model(fc.PHI3, seed=1)
    with torch.no_grad():
        tm.model.norm.weight.mul_(30.0)
    params = fc.jax_params(tm)
    prompts, n = [fc.ids(1, 3, seed=4)[0], fc.ids(1, 6, seed=5)[0]], 12
    ref_tokens, ref_lps = [], []
    for p in prompts:
        with torch.no_grad():
            r = tm.generate(torch.tensor(p[None]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
        toks = r.sequences[0, len(p):].numpy()
        lps = torch.stack(r.logits, 1)[0].double().log_softmax(-1).numpy()
        ref_tokens.append(toks)
        ref_lps.append(lps[np.arange(n), toks])
    stop = next(t for t in range(fc.TINY["vocab_size"]) if not any(t in toks for toks in ref_tokens))
    m = models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32)
    out = models.generate_batch(m, prompts, n, key=None, temperature=0.0, stop_token_ids=[stop],
                                return_logprobs=True, decode_chunk=3)
    np.testing.assert_array_equal(out.tokens, np.stack(ref_tokens))
    np.testing.assert_allclose(out.logprobs, np.stack(ref_lps), rtol=0, atol=1e-4)
