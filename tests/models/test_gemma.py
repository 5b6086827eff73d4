"""Gemma 2 and Gemma 3 against transformers (eager attention) on CPU, float32, at the same format.

Tiny random checkpoints (tests/support/family_checkpoints.py) with sliding windows shorter than the
sequence, an attention scale that is not head_dim ** -0.5, Gemma's (1 + w) norms drawn around zero,
Gemma 2's soft-caps small enough to change every score, and Gemma 3's second RoPE table. The real
Gemma 3 270M is tested in tests/models/test_real_gemma.py.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import family_checkpoints as fc  # noqa: E402
from jqlora import lora, models  # noqa: E402
from jqlora.models.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def dense(request):
    cfg = fc.FAMILIES[request.param]
    tm = fc.text_model(cfg)
    params = fc.jax_params(tm)
    return request.param, tm, params, tm.config.to_dict()


def test_config_reads_the_gemma_switches(dense):
    kind, _, _, cfg = dense
    c = ModelConfig.from_hf(cfg)
    assert c.norm_kind == "gemma" and c.sandwich_norms and c.embed_scale == pytest.approx(8.0)
    assert c.attn_scale == pytest.approx(24 ** -0.5) and c.hidden_act == "gelu_pytorch_tanh"
    if kind == "gemma2":
        assert (c.attn_softcap, c.final_softcap) == (5.0, 3.0)
        assert c.sliding_windows == (6, None) * 3  # even layers slide
        assert c.local_rope_theta is None and not c.qk_norm
    else:
        assert (c.attn_softcap, c.final_softcap) == (None, None)
        assert c.sliding_windows == (6,) * 5 + (None,)  # layer_types: 5 sliding, 1 full
        assert (c.rope_theta, c.local_rope_theta) == (1e6, 1e4) and c.qk_norm


def test_logits_and_every_layer_match_transformers_fp32(dense):
    kind, tm, params, cfg = dense
    ids = fc.ids()
    ref, ref_states = fc.torch_forward(tm, ids)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    logits, states = m(jnp.asarray(ids), return_states=True)
    assert fc.rel_error(logits, ref) < 2e-5, kind
    assert fc.rel_error(states["embed"], ref_states[0]) < 1e-6  # the sqrt(hidden) scale
    for i, h in enumerate(states["layers"][:-1]):  # transformers' last hidden state is after the norm
        assert fc.rel_error(h, ref_states[i + 1]) < 2e-5, (kind, i)
    assert fc.rel_error(states["norm"], ref_states[-1]) < 2e-5


def test_bf16_compute_matches_transformers_bf16(dense):
    kind, tm, params, cfg = dense
    ids = fc.ids()
    ref, _ = fc.torch_forward(fc.text_model(fc.FAMILIES[kind], dtype=torch.bfloat16), ids)
    m = models.from_params({k: v.astype(jnp.bfloat16) for k, v in params.items()}, cfg, compute_dtype=jnp.bfloat16)
    assert fc.rel_error(m(jnp.asarray(ids)).astype(jnp.float32), ref) < 3e-2, kind


@pytest.mark.parametrize("decode_layers", ["scanned", "hoisted"])
def test_greedy_generation_equals_transformers(dense, decode_layers):
    """Cached decoding (windows and soft-caps in the decode path) gives transformers' greedy tokens,
    past the window; hoisted: q|k|v and the GeGLU's gate|up fused."""
    kind, tm, params, cfg = dense
    prompt = fc.ids(1, 5, seed=3)
    with torch.no_grad():
        ref = tm.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 5:].numpy()
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    got = np.asarray(models.generate(m, jnp.asarray(prompt), max_new_tokens=12, decode_layers=decode_layers))[0, -12:]
    np.testing.assert_array_equal(got, ref)


def test_greedy_generation_through_the_decode_attention_kernel(dense, monkeypatch):
    """The global layers' decoding attention in the `decode_attention` kernel (interpret mode;
    a GPU's default), Gemma 2's soft-cap inside it, the sliding layers' ring buffers on the einsum
    path: still transformers' greedy tokens, past the window, and the einsum path's logits."""
    from decode_kernel_calls import record_kernel_calls

    calls = record_kernel_calls(monkeypatch)
    kind, tm, params, cfg = dense
    prompt = fc.ids(1, 5, seed=3)
    with torch.no_grad():
        ref = tm.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 5:].numpy()
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    runs = {}
    for backend in ("xla", "interpret"):  # the einsum path, then the kernel
        m.backend = backend
        runs[backend] = models.generate(m, jnp.asarray(prompt), max_new_tokens=12, decode_layers="hoisted",
                                        return_logits=True)
    assert calls and all(kw["window"] is None for kw in calls)
    assert all(kw["cap"] is not None for kw in calls) == (kind == "gemma2")
    np.testing.assert_array_equal(np.asarray(runs["interpret"][0])[0, -12:], ref)
    np.testing.assert_allclose(np.asarray(runs["interpret"][1]), np.asarray(runs["xla"][1]), rtol=1e-5, atol=1e-5)


def test_cudnn_attention_refuses_soft_capped_models(dense):
    kind, _, params, cfg = dense
    if kind == "gemma3":  # no soft-cap: the fused path serves it (compared with einsum below)
        m = models.from_params(params, cfg, compute_dtype=jnp.float32, attention="xla")
        ref = models.from_params(params, cfg, compute_dtype=jnp.float32)
        ids = jnp.asarray(fc.ids())
        assert fc.rel_error(m(ids), ref(ids)) < 1e-5
        return
    with pytest.raises(ValueError, match="soft-capping.*attention='einsum'"):
        models.from_params(params, cfg, compute_dtype=jnp.float32, attention="cudnn")


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantized_gemma3_matches_bitsandbytes(tmp_path_factory, fmt):
    """bitsandbytes' training path (dequantize + linear) in float32, as for Llama (test_models.py)."""
    path = fc.cached(tmp_path_factory, "gemma3", fmt)
    ids = fc.ids()
    ref, _ = fc.torch_forward(fc.load_with_transformers(path, train=True), ids)
    m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    assert fc.rel_error(m(jnp.asarray(ids)), ref) < 1e-4


def test_multimodal_gemma3_loads_its_text_model(tmp_path_factory, caplog):
    """A `Gemma3ForConditionalGeneration` folder (nested text_config, `language_model.` keys, a vision
    tower and projector): the text model loads, the rest is skipped with a note, and text-only logits
    equal transformers'."""
    import logging

    path = fc.cached(tmp_path_factory, "gemma3_mm", "nf4")
    from transformers import AutoModelForImageTextToText

    tm = AutoModelForImageTextToText.from_pretrained(str(path), device_map="cpu", attn_implementation="eager").train()
    ids = fc.ids()
    with torch.no_grad():
        ref = tm(input_ids=torch.tensor(ids)).logits.float().numpy()
    with caplog.at_level(logging.INFO, logger="jqlora"):
        m = models.load_causal_lm(path, compute_dtype=jnp.float32)
    assert any("vision tower" in r.getMessage() for r in caplog.records)
    assert m.config.model_type == "gemma3_text" and m.config.tie_word_embeddings
    assert fc.rel_error(m(jnp.asarray(ids)), ref) < 1e-4


def test_lora_gradients_match_peft(dense):
    """LoRA on every projection: loss and gradients of each A and B equal PEFT's on the same model."""
    kind, tm, params, cfg = dense
    targets = list(lora.DEFAULT_TARGETS)
    pm, values = fc.peft_model(fc.FAMILIES[kind], targets)
    ids = fc.ids()
    loss_t, ref = fc.peft_loss_and_grads(pm, ids)

    m = models.from_params(params, cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                           lora=lora.LoraConfig(rank=4, alpha=8, target_modules=targets))
    lora.set_lora_params(m, values)
    loss, got = fc.lora_loss_and_grads(m, ids)
    assert abs(loss - loss_t) < 1e-5
    assert len(got) == len(values)
    for name, g_ in got.items():
        for k in ("lora_A", "lora_B"):
            r = ref[f"{name}.{k}.weight"]
            assert fc.rel_error(g_[k], r) < 1e-4, (kind, name, k)
