"""Mixture-of-experts models through the command line: `--quantize-experts` (the experts of a
transformers + bitsandbytes NF4 folder, left dense there, are NF4 by default and stay dense with
`none`; a run keeps its choice on resume) and `export-merged` at bf16 and nf4, whose folders
transformers loads per expert and which give the logits of the model with the adapter.

Tiny random checkpoints: tests/support/moe_checkpoints.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moe_checkpoints as mc  # noqa: E402
from cli_runner import run_cli  # noqa: E402
from jqlora import adapters, lora, models, quant  # noqa: E402

pytestmark = pytest.mark.torch


def _experts(model):
    """The first MoE layer's gate_up stack as the model holds it."""
    return model.model.layers[0].mlp.experts.gate_up_proj.base.get_value().stack


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture
def loaded(monkeypatch):
    """Every model `jqlora.models.load_causal_lm` returns during the test, with its arguments."""
    seen = []
    load = models.load_causal_lm

    def recording(*args, **kw):
        m = load(*args, **kw)
        seen.append((kw.get("quantize_experts", "auto"), m))
        return m

    monkeypatch.setattr(models, "load_causal_lm", recording)
    return seen


def test_quantize_experts_flag(tmp_path_factory, capsys, loaded):
    base = mc.cached(tmp_path_factory, "mixtral", "nf4")  # attention NF4, experts dense (as transformers writes)
    for flag, expected in (([], quant.Weight4bit), (["--quantize-experts", "none"], jnp.ndarray)):
        loaded.clear()
        rc, out, err = run_cli(capsys, "generate", base, "--prompt-ids", "1,2,3", "--max-new-tokens", "1", *flag)
        assert rc == 0, err
        (_, m), = loaded
        stack = _experts(m)
        assert isinstance(stack, expected), (flag, type(stack))
        if expected is quant.Weight4bit:
            assert stack.quant_type == "nf4"
    # a bad value: the usage error, exit 2, on every command that loads a model
    for cmd in (["generate", base, "--prompt-ids", "1"], ["crosscheck", base], ["import-peft", str(base)],
                ["train", "--model", base]):
        rc, _, err = run_cli(capsys, *cmd, "--quantize-experts", "nf3")
        assert rc == 2 and "--quantize-experts: invalid choice: 'nf3'" in err, (cmd, err)
    # the load-balancing loss' coefficient, checked before anything loads
    for value, says in (("-1", "--router-aux-loss-coef must be a number >= 0 or None, got -1.0"),
                        ("x", "--router-aux-loss-coef: cannot parse 'x' as float | None")):
        rc, _, err = run_cli(capsys, "train", "--model", base, "--data-path", base / "config.json",
                             "--router-aux-loss-coef", value)
        assert rc == 2 and says in err, err


def test_train_records_quantize_experts_and_resume_keeps_it(tmp_path_factory, capsys, loaded):
    import shutil

    from jqlora.demo import task

    root = tmp_path_factory.mktemp("moe-qe")
    base = root / "nf4"
    shutil.copytree(mc.cached(tmp_path_factory, "mixtral", "nf4"), base)
    task.save_tokenizer(base)
    data = task.write_jsonl(root / "train.jsonl", task.make_split(8, 0, seed=3).train)
    common = ["--model", base, "--data-path", data, "--seq-len", "32", "--batch-size", "2", "--compute-dtype",
              "float32", "--target-modules", "q_proj", "--rank", "2", "--out-dir", root / "run",
              "--keep-checkpoints", "none", "--remat", "false"]
    rc, _, err = run_cli(capsys, "train", *common, "--steps", "1", "--quantize-experts", "none")
    assert rc == 0, err
    assert isinstance(_experts(loaded[-1][1]), jnp.ndarray)
    record = json.loads((root / "run" / "jqlora_run.json").read_text())
    assert record["quantize_experts"] == "none"
    rc, _, err = run_cli(capsys, "train", *common, "--steps", "2", "--resume", "--quantize-experts", "nf4")
    assert rc == 2 and "--resume: quantize_experts is 'nf4' but the run in" in err and "used 'none'" in err, err
    loaded.clear()
    rc, _, err = run_cli(capsys, "train", *common, "--steps", "2", "--resume")  # the record's choice
    assert rc == 0, err
    assert isinstance(_experts(loaded[-1][1]), jnp.ndarray)


def _adapter(base, directory, seed=1):
    """A random LoRA on attention and experts (every B non-zero) for `base`, written as PEFT does;
    returns the jqlora model that holds it (experts as stored, float32)."""
    cfg = lora.LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    m = models.load_causal_lm(base, lora=cfg, compute_dtype=jnp.float32, quantize_experts="none",
                              rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    lp = {k: {"lora_A": v["lora_A"], "lora_B": jnp.asarray(rng.normal(0, 0.1, v["lora_B"].shape), jnp.float32)}
          for k, v in lora.lora_params_by_module(m).items()}
    lora.set_lora_params(m, lp)
    adapters.save_adapter(directory, m, cfg, base_model=str(base))
    return m


@pytest.mark.parametrize("kind", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_export_merged_moe_bf16_and_nf4_load_in_transformers(kind, tmp_path_factory, tmp_path, capsys):
    """Both formats: per-expert dense keys (the merged expert as computed from the adapter), a
    folder transformers loads with jqlora's logits for the same file, within the format's rounding
    of the model with the adapter."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = mc.cached(tmp_path_factory, kind, "nf4")
    want_model = _adapter(base, tmp_path / "adapter")
    ids = np.random.default_rng(0).integers(0, 256, (2, 10))
    want = np.asarray(want_model(jnp.asarray(ids)))
    base_off = _rel(models.load_causal_lm(base, compute_dtype=jnp.float32, quantize_experts="none")(
        jnp.asarray(ids)), want)  # how far the adapter moves the logits
    # expert 0's gate of layer 0, merged: W + scale * B[:I] A
    per_expert = "block_sparse_moe.experts.0.w1" if kind == "mixtral" else "mlp.experts.0.gate_proj"
    pair = lora.lora_params_by_module(want_model)["model.layers.0.mlp.experts.gate_up_proj"]
    a, b = np.asarray(pair["lora_A"][0]), np.asarray(pair["lora_B"][0])
    with safe_open(str(base / "model.safetensors"), "np") as f:
        w = f.get_tensor(f"model.layers.0.{per_expert}.weight")
    merged = w + 2.0 * b[: w.shape[0]] @ a
    mc._quiet()
    for fmt, tol in (("bf16", 2e-2), ("nf4", 0.35 * base_off)):
        out = tmp_path / fmt
        rc, text, err = run_cli(capsys, "export-merged", base, out, "--adapter", tmp_path / "adapter",
                                "--format", fmt, "--force")
        assert rc == 0, err
        with safe_open(str(out / "model.safetensors"), "np") as f:
            keys = set(f.keys())
            expert = f.get_tensor(f"model.layers.0.{per_expert}.weight")
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)  # per expert
        assert not any(".experts." in k and ("absmax" in k or "quant_state" in k) for k in keys)  # dense
        assert expert.dtype == (np.float32 if fmt == "nf4" else jnp.bfloat16)  # nf4: the checkpoint's dtype
        np.testing.assert_allclose(expert.astype(np.float32), merged, rtol=1e-2 if fmt == "bf16" else 1e-5,
                                   atol=1e-6)
        if fmt == "nf4":
            assert "expert and router weights dense" in text
            assert any(k.endswith("self_attn.q_proj.weight.absmax") for k in keys)  # attention re-quantized
        tm = AutoModelForCausalLM.from_pretrained(str(out), device_map="cpu", dtype=torch.float32).train()
        with torch.no_grad():
            theirs = tm(torch.tensor(ids)).logits.numpy()
        # the same file in jqlora, experts as stored: transformers' numbers
        mine = models.load_causal_lm(out, compute_dtype=jnp.float32, quantize_experts="none")
        assert _rel(mine(jnp.asarray(ids)), theirs) < 1e-4, fmt
        # and the model with the adapter, up to the format's rounding (nf4: attention re-quantized,
        # well within the adapter's own effect)
        assert _rel(theirs, want) < tol, (fmt, _rel(theirs, want))
        if fmt == "nf4":  # by default jqlora holds the written experts in NF4 again
            assert isinstance(_experts(models.load_causal_lm(out, compute_dtype=jnp.float32)), quant.Weight4bit)


@pytest.mark.parametrize("layout", ["plain", "expert_nf4"])
def test_export_merged_nf4_keeps_experts_and_routers_dense(layout, tmp_path_factory, tmp_path, capsys):
    """A plain base (whose decoder linears the nf4 format quantizes) and unsloth's per-expert 4-bit
    base (experts and router 4-bit, a folder transformers 5 cannot load): the nf4 folder holds the
    experts and routers dense per expert, and transformers loads it with jqlora's logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = mc.cached(tmp_path_factory, "mixtral", layout)
    _adapter(base, tmp_path / "adapter")
    rc, text, err = run_cli(capsys, "export-merged", base, tmp_path / "out", "--adapter", tmp_path / "adapter",
                            "--format", "nf4", "--force")
    assert rc == 0, err
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.block_sparse_moe.gate.weight").dtype == np.float32
    assert not any(("experts." in k or ".gate." in k) and ("absmax" in k or "quant_state" in k) for k in keys)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys
    assert any(k.endswith("self_attn.o_proj.weight.absmax") for k in keys)
    mc._quiet()
    tm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), device_map="cpu", dtype=torch.float32).train()
    ids = np.random.default_rng(0).integers(0, 256, (2, 10))
    with torch.no_grad():
        theirs = tm(torch.tensor(ids)).logits.numpy()
    mine = models.load_causal_lm(tmp_path / "out", compute_dtype=jnp.float32, quantize_experts="none")
    assert _rel(mine(jnp.asarray(ids)), theirs) < 1e-4
    assert "26 expert and router weights dense" in text  # 2 layers x (4 experts x 3 + 1 router)


def test_crosscheck_with_quantized_experts_gives_torch_the_same_experts(tmp_path_factory, capsys):
    """`crosscheck --quantize-experts nf4`: the JAX side holds NF4 experts, the torch side multiplies
    the same dequantized experts, and the check passes at its float32 tolerance."""
    base = mc.cached(tmp_path_factory, "mixtral", "nf4")
    rc, out, err = run_cli(capsys, "crosscheck", base, "--tokens", "8", "--quantize-experts", "nf4", "--json")
    report = json.loads(out)
    assert rc == 0 and report["passed"], out + err
    assert any("4 expert stacks quantized on the JAX side" in n for n in report["notes"]), report["notes"]
