"""PEFT adapters of the text model inside a multimodal Gemma 3 (`Gemma3ForConditionalGeneration`):
jqlora's export names its modules as PEFT does on that model (`model.language_model.layers...`)
with target_modules that reach no vision-tower projection, `PeftModel.from_pretrained` on the
multimodal model applies it, `export-merged` writes a multimodal folder transformers loads, and
adapters PEFT wrote for that model read back into jqlora."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import family_checkpoints as fc  # noqa: E402
from jqlora import adapters, lora, models  # noqa: E402

pytestmark = pytest.mark.torch


def _multimodal(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), attn_implementation="eager").eval()


def _logits(tm, ids):
    with torch.no_grad():
        return tm(input_ids=torch.tensor(ids)).logits.float().numpy()


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


IDS = np.random.default_rng(0).integers(0, 250, (2, 12))


def test_export_loads_with_peft_on_the_multimodal_model(tmp_path_factory, tmp_path):
    path = fc.cached(tmp_path_factory, "gemma3_mm", None)
    cfg = lora.LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    m = models.load_causal_lm(path, compute_dtype=jnp.float32, lora=cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    lora.set_lora_params(m, {n: {"lora_A": np.asarray(p["lora_A"]),
                                 "lora_B": rng.normal(0, 0.1, p["lora_B"].shape).astype(np.float32)}
                             for n, p in lora.lora_params_by_module(m).items()})
    out = adapters.save_adapter(tmp_path / "adapter", m, cfg, base_model=str(path))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert isinstance(written["target_modules"], str)

    pm = peft.PeftModel.from_pretrained(_multimodal(path), out).eval()
    with_lora = [n for n, mod in pm.named_modules() if hasattr(mod, "lora_A") and "default" in mod.lora_A]
    assert len(with_lora) == 6 * 3 and all(".language_model." in n for n in with_lora)  # no vision tower module
    ref = _logits(pm, IDS)
    got = np.asarray(m(jnp.asarray(IDS)))
    assert _rel(got, ref) < 1e-5
    assert _rel(np.asarray(models.load_causal_lm(path, compute_dtype=jnp.float32)(jnp.asarray(IDS))), ref) > 1e-3

    back, report, _ = adapters.load_model_with_adapter(path, out)  # jqlora reads its own export back
    assert len(report["matched"]) == 18 and _rel(np.asarray(back(jnp.asarray(IDS))), ref) < 1e-5

    from jqlora.merge import merge_adapter  # the merge into the multimodal folder loads in transformers

    assert merge_adapter(path, out, tmp_path / "merged", format="bf16")["merged"] == 18
    assert _rel(_logits(_multimodal(tmp_path / "merged").float(), IDS), ref) < 3e-2  # bf16 weights


def test_a_peft_adapter_of_the_multimodal_model_reads_into_jqlora(tmp_path_factory, tmp_path):
    """PEFT's own adapter, made on the multimodal model with a regex limited to the text model."""
    path = fc.cached(tmp_path_factory, "gemma3_mm", None)
    pm = peft.get_peft_model(_multimodal(path), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|o_proj|gate_proj)"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for mod in pm.modules():
            if hasattr(mod, "lora_B") and "default" in mod.lora_B:
                mod.lora_B["default"].weight.copy_(0.1 * torch.randn(mod.lora_B["default"].weight.shape, generator=g))
    pm.eval()
    ref = _logits(pm, IDS)
    pm.save_pretrained(tmp_path / "peft")
    m, report, cfg = adapters.load_model_with_adapter(path, tmp_path / "peft")
    assert len(report["matched"]) == 18 and all(n.startswith("model.layers.") for n in report["matched"])
    assert _rel(np.asarray(m(jnp.asarray(IDS))), ref) < 1e-5
