"""The `jqlora` CLI: help texts, inspect, crosscheck, train -> export-peft -> import-peft, generate,
bench, explain-kernel, the library functions behind the commands, and a fast smoke run of the demo
pipeline. Commands run in-process through `jqlora.cli.main(argv)` (the console script calls the
same function)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_runner import run_cli
from jqlora.cli import COMMANDS, main

pytestmark = pytest.mark.torch



# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def nf4_ckpt(tmp_path_factory):
    """A tiny transformers + bitsandbytes NF4 Llama checkpoint, with the demo's char tokenizer."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from jqlora.demo import task

    src = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                     config_overrides={"initializer_range": 0.1})
    dst = tmp_path_factory.mktemp("cli") / "nf4"
    shutil.copytree(src, dst)
    task.save_tokenizer(dst)  # 31 char tokens; the model's vocab is 128
    return dst


@pytest.fixture(scope="module")
def trained(nf4_ckpt, tmp_path_factory):
    """`jqlora train` for 3 steps from a TOML config + flag overrides."""
    from jqlora.demo import task

    root = tmp_path_factory.mktemp("train")
    data = task.write_jsonl(root / "train.jsonl", task.make_split(64, 0, seed=3).train)
    cfg = root / "train.toml"
    cfg.write_text(f'model = "{nf4_ckpt}"\ncompute_dtype = "float32"\n'
                   '[lora]\nrank = 4\nalpha = 8\ntarget_modules = ["q_proj", "v_proj", "down_proj"]\n'
                   f'[train]\ndata_path = "{data}"\nseq_len = 32\nbatch_size = 4\nsteps = 99\n'
                   f'lr = 0.01\nout_dir = "{root / "run"}"\nsave_every = 2\nlog_every = 1\n')
    rc = main(["train", "--config", str(cfg), "--steps", "3", "--keep-checkpoints", "none"])
    assert rc == 0
    return root / "run"


# ---------------------------------------------------------------------------------------------- help
def test_help_of_every_command(capsys):
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    for name in COMMANDS:
        assert name in out
    for name in COMMANDS:
        rc, out, _ = run_cli(capsys, name, "--help")
        assert rc == 0, name
        assert f"usage: jqlora {name}" in out and len(out) > 400, name
    rc, _, err = run_cli(capsys)
    assert rc == 2


def test_console_script_entry_point():
    exe = Path(sys.executable).with_name("jqlora")
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    r = subprocess.run([str(exe), "inspect", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "effective bits per" in r.stdout.replace("\n", " ").replace("  ", " ")


# ------------------------------------------------------------------------------------------- inspect
def test_inspect_text_and_json_totals(nf4_ckpt, capsys):
    rc, out, _ = run_cli(capsys, "inspect", nf4_ckpt)
    assert rc == 0
    assert "model.layers.0.self_attn.q_proj" in out and "nf4" in out and "effective bits/param" in out
    rc, out, _ = run_cli(capsys, "inspect", nf4_ckpt, "--json")
    assert rc == 0
    info = json.loads(out)
    rows, t = info["tensors"], info["totals"]
    quant = [r for r in rows if r["kind"] == "nf4"]
    assert len(quant) == 2 * 7  # 2 layers x 7 projections; lm_head stays plain
    assert all(r["blocksize"] == 64 and r["nested"] and r["dtype"] == "float32" for r in quant)
    q = next(r for r in rows if r["name"] == "model.layers.0.mlp.down_proj")
    assert q["shape"] == [64, 128] and q["params"] == 64 * 128
    n, nb = 64 * 128, 64 * 128 // 64  # packed + absmax codes + 16-entry table + nested absmax/table/offset
    assert q["bytes"] == n // 2 + nb + 16 * 4 + 4 * 1 + 256 * 4 + 4
    plain = next(r for r in rows if r["name"] == "lm_head.weight")
    assert plain["kind"] == "plain" and plain["bytes"] == 128 * 64 * 4
    assert t["quantized_bytes"] == sum(r["bytes"] for r in quant)
    assert t["total_bytes"] == sum(r["bytes"] for r in rows)
    assert t["params"] == sum(int(np.prod(r["shape"])) for r in rows)
    assert t["bits_per_param"] == pytest.approx(8 * t["total_bytes"] / t["params"])
    # 4 bits + scales + per-module tables (the 1 KiB nested table weighs a lot in matrices this small)
    assert t["bits_per_quantized_param"] == pytest.approx(8 * t["quantized_bytes"] / t["quantized_params"])
    assert 4.0 < t["bits_per_quantized_param"] < t["bits_per_param"]


def test_inspect_errors_name_file_and_tensor(nf4_ckpt, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(nf4_ckpt, bad)
    f = bad / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"
    tensors[key] = np.frombuffer(b"{not json" + b" " * 20, np.uint8).copy()
    save_file(tensors, f)
    rc, out, err = run_cli(capsys, "inspect", bad)
    assert rc == 2 and out == ""
    assert str(f) in err and key in err
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])  # truncated file
    rc, _, err = run_cli(capsys, "inspect", bad)
    assert rc == 2 and str(f) in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, "inspect", tmp_path / "nope")
    assert rc == 2 and "nope" in err


# ---------------------------------------------------------------------------------------- crosscheck
def test_crosscheck_passes_and_fails(nf4_ckpt, capsys):
    rc, out, _ = run_cli(capsys, "crosscheck", nf4_ckpt, "--tokens", "8", "--json")
    assert rc == 0, out
    rep = json.loads(out)
    assert rep["passed"] and rep["logits"]["rel"] < 1e-4
    assert [d["name"] for d in rep["layers"]] == ["embed", "layer.0", "layer.1", "norm"]
    # an impossible tolerance fails
    rc, out, _ = run_cli(capsys, "crosscheck", nf4_ckpt, "--tokens", "8", "--tolerance", "1e-12")
    assert rc == 2 and "FAIL" in out
    # perturbed JAX weights fail, and the report localizes the error at layer 0
    rc, out, _ = run_cli(capsys, "crosscheck", nf4_ckpt, "--tokens", "8", "--perturb", "0.05", "--json")
    rep = json.loads(out)
    assert rc == 2 and not rep["passed"]
    d = {x["name"]: x for x in rep["layers"]}
    assert d["embed"]["max_abs"] == 0.0 and d["layer.0"]["rel"] > 1e-3


def test_crosscheck_library_with_perturbed_quantized_weight(nf4_ckpt):
    """The library entry point with a caller-built JAX model whose 4-bit absmax was altered."""
    import dataclasses

    import jax.numpy as jnp

    from jqlora import models, quant
    from jqlora.crosscheck import crosscheck

    m = models.load_causal_lm(nf4_ckpt, compute_dtype=jnp.float32)
    layer = m.model.layers[1].mlp.up_proj
    w = layer.base.get_value()
    assert isinstance(w, quant.Weight4bit)
    layer.base.set_value(dataclasses.replace(w, offset=w.offset * 1.5))
    res = crosscheck(nf4_ckpt, jax_model=m, tokens=8)
    assert not res.passed
    assert res.layers[1].rel < 1e-5 and res.layers[2].rel > 1e-3  # layer.0 fine, layer.1 broken


# ------------------------------------------------------------------ train -> export -> import -> use
def test_train_export_import_roundtrip(trained, nf4_ckpt, tmp_path, capsys):
    from interop import load_peft_adapter

    assert (trained / "jqlora_run.json").is_file() and (trained / "loss.csv").is_file()
    run = json.loads((trained / "jqlora_run.json").read_text())
    assert run["train"]["steps"] == 3 and run["lora"]["rank"] == 4  # flag overrode the file
    written, cfg = load_peft_adapter(trained / "adapter")
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and len(written) == 6
    # export-peft from the training checkpoint reproduces the adapter written at the end
    out = tmp_path / "exported"
    rc, text, err = run_cli(capsys, "export-peft", trained, out)
    assert rc == 0, err
    assert "step 3" in text
    exported, _ = load_peft_adapter(out)
    assert set(exported) == set(written)
    for m in written:
        for k in ("lora_A", "lora_B"):
            np.testing.assert_array_equal(exported[m][k], written[m][k])
    assert any(np.any(p["lora_B"] != 0) for p in exported.values())
    # an earlier step differs
    rc, _, err = run_cli(capsys, "export-peft", trained, tmp_path / "step2", "--step", "2")
    assert rc == 0, err
    step2, _ = load_peft_adapter(tmp_path / "step2")
    assert any(not np.array_equal(step2[m]["lora_B"], written[m]["lora_B"]) for m in written)
    # import-peft: every module matched, and the adapter changes the logits
    rc, text, err = run_cli(capsys, "import-peft", out, "--model", nf4_ckpt, "--json")
    assert rc == 0, err
    rep = json.loads(text)
    assert len(rep["matched"]) == 6 and rep["rank"] == 4 and rep["logits_max_abs_change"] > 0
    assert "model.layers.0.self_attn.k_proj" in rep["untouched"]
    # PEFT in torch loads the exported adapter and agrees with JAX
    rc, text, _ = run_cli(capsys, "crosscheck", nf4_ckpt, "--adapter", out, "--tokens", "8")
    assert rc == 0, text
    # an adapter that does not fit the model is rejected with a clear message
    wrong = tmp_path / "wrong"
    shutil.copytree(out, wrong)
    c = json.loads((wrong / "adapter_config.json").read_text())
    c["r"] = 8
    (wrong / "adapter_config.json").write_text(json.dumps(c))
    rc, _, err = run_cli(capsys, "import-peft", wrong, "--model", nf4_ckpt)
    assert rc == 2 and "adapter_model.safetensors" in err


def test_train_resume_and_errors(trained, tmp_path, capsys):
    trained = Path(shutil.copytree(trained, tmp_path / "run"))  # other tests read the original
    # --resume continues from the stored settings (no --config needed) up to the new step count
    rc, text, err = run_cli(capsys, "train", "--resume", "--out-dir", trained, "--steps", "4")
    assert rc == 0, err
    assert "resumed from step 3" in text
    assert json.loads((trained / "jqlora_run.json").read_text())["train"]["steps"] == 4
    rc, _, err = run_cli(capsys, "train", "--resume", "--out-dir", trained, "--steps", "5", "--rank", "8")
    assert rc == 2 and "lora.rank" in err
    rc, _, err = run_cli(capsys, "train", "--out-dir", trained, "--steps", "5")
    assert rc == 2 and "no model" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x", "lora": {"rnak": 4}}))
    rc, _, err = run_cli(capsys, "train", "--config", bad)
    assert rc == 2 and "lora.rnak" in err and str(bad) in err


def test_generate_prints_tokens(trained, nf4_ckpt, capsys):
    rc, out, err = run_cli(capsys, "generate", nf4_ckpt, "--prompt", "abc=", "--max-new-tokens", "5",
                           "--adapter", trained / "adapter", "--show-ids")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("abc=") and lines[1].startswith("ids:")
    ids = [int(t) for t in lines[1].split()[1:]]
    assert 1 <= len(ids) <= 5 and all(0 <= t < 128 for t in ids)
    rc, out, err = run_cli(capsys, "generate", nf4_ckpt, "--prompt-ids", "1,5,6,7", "--max-new-tokens", "4",
                           "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--json", "--timing")
    assert rc == 0
    assert len(json.loads(out)["ids"]) <= 4
    timing = json.loads(next(ln for ln in err.splitlines() if ln.startswith("timing: "))[len("timing: "):])
    assert {"load_s", "generate_s", "attention", "decode_attention", "decode_attention_reason", "decode_norm",
            "decode_norm_reason"} <= set(timing)
    import jax

    if jax.default_backend() != "gpu":  # the decoding steps' attention and norms: the kernels run on a GPU only
        assert timing["decode_attention"] == "einsum" and "not on a GPU" in timing["decode_attention_reason"]
        assert timing["decode_norm"] == "xla" and "not on a GPU" in timing["decode_norm_reason"]


# --------------------------------------------------------------------------------------------- bench
def test_bench_on_cpu_exits_2(capsys):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("GPU present: the benchmark would really run")
    rc, _, err = run_cli(capsys, "bench")
    assert rc == 2 and "no GPU" in err


def _fake_gpu(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def test_bench_without_benchmarks_package_says_how(monkeypatch, capsys):
    _fake_gpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # as in an installed package: not importable
    rc, out, err = run_cli(capsys, "bench", "--", "--ms", "1")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "not part of the installed jqlora package" in err
    assert "`make bench`" in err and "`python -m benchmarks.run ...`" in err


def test_bench_passes_its_arguments_to_benchmarks_run(monkeypatch, capsys):
    import importlib.machinery
    import types

    _fake_gpu(monkeypatch)
    seen = []
    pkg, mod = types.ModuleType("benchmarks"), types.ModuleType("benchmarks.run")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("benchmarks", None, is_package=True)
    mod.__spec__ = importlib.machinery.ModuleSpec("benchmarks.run", None)
    mod.main = lambda argv: seen.append(argv) or 3
    pkg.run = mod
    monkeypatch.setitem(sys.modules, "benchmarks", pkg)
    monkeypatch.setitem(sys.modules, "benchmarks.run", mod)
    rc, _, err = run_cli(capsys, "bench", "--", "--ms", "1,16")
    assert rc == 3 and seen == [["--ms", "1,16"]], err


# ------------------------------------------------------------------------------------ explain-kernel
def test_explain_kernel_prints_the_library_explanation(capsys):
    import jax.numpy as jnp

    from jqlora.ops.dispatch import Device, explain
    from pallas_kernels import registry

    want = explain("nf4", 16, 4096, 4096, blocksize=64, dtype=jnp.bfloat16, device=Device(platform="gpu", sm90=True),
                   backend="auto")
    args = ("explain-kernel", "--weight", "nf4", "--m", 16, "--n", 4096, "--k", 4096, "--device", "hopper")
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    assert out == str(want) + "\n" and len(want.rows) >= 1
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep == {"backend": want.plan.backend, "fwd": want.plan.fwd, "bwd": want.plan.bwd,
                   "rows": [{"product": p, "variant": v, "verdict": x} for p, v, x in want.rows]}
    assert rep["backend"] == "pallas"
    names = {v.name for v in registry.all_variants()}
    assert rep["fwd"] in names and rep["bwd"] in names
    # auto computes on the CPU with XLA, and LLM.int8 numerics use XLA on a GPU too
    for weight, device in (("nf4", "cpu"), ("llm_int8", "hopper")):
        rc, out, err = run_cli(capsys, "explain-kernel", "--weight", weight, "--m", 8, "--n", 256, "--k", 256,
                               "--dtype", "float16", "--device", device, "--json")
        assert rc == 0, err
        rep = json.loads(out)
        assert (rep["backend"], rep["fwd"], rep["bwd"]) == ("xla", None, None), (weight, device)


def test_explain_kernel_bad_values_exit_2_with_one_line(capsys):
    ok = {"--weight": "nf4", "--m": "1", "--n": "64", "--k": "64"}
    for flag, value, msg in (("--weight", "nf5", "'nf5' is not one of nf4, fp4, int8, llm_int8"),
                             ("--m", "0", "expected a positive integer, got 0"),
                             ("--k", "x", "expected a positive integer, got 'x'"),
                             ("--blocksize", "-64", "expected a positive integer"),
                             ("--dtype", "float64", "not one of bfloat16, float16, float32"),
                             ("--device", "tpu", "not one of current, hopper, gpu, cpu"),
                             ("--backend", "triton", "not one of auto, pallas, interpret, xla")):
        argv = [a for kv in {**ok, flag: value}.items() for a in kv]
        rc, out, err = run_cli(capsys, "explain-kernel", *argv)
        assert rc == 2 and out == "", flag
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"jqlora explain-kernel: error: {flag}: "), (flag, err)
        assert msg in err, (flag, err)


# ------------------------------------------------------------------- library forms of the commands
def test_inspect_checkpoint_library(nf4_ckpt, tmp_path):
    from interop import CheckpointError
    from interop.inspect import inspect_checkpoint

    info = inspect_checkpoint(nf4_ckpt / "model.safetensors")  # a file: its directory is read
    t = info["totals"]
    assert info["path"] == str(nf4_ckpt) and info["model_type"] == "llama"
    assert info["quantization"]["bnb_4bit_quant_type"] == "nf4"
    assert t["by_kind"]["nf4"] == 14 and t["entries"] == len(info["tensors"]) == sum(t["by_kind"].values())
    assert t["file_bytes"] == (nf4_ckpt / "model.safetensors").stat().st_size
    assert t["total_bytes"] == t["quantized_bytes"] + t["plain_bytes"] < t["file_bytes"]
    with pytest.raises(CheckpointError, match="no such checkpoint file or directory"):
        inspect_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=str(tmp_path / "empty")):
        inspect_checkpoint(tmp_path / "empty")


def test_export_adapter_library(trained, tmp_path):
    from interop import load_peft_adapter
    from jqlora.runs import RunError, export_adapter

    step3 = trained / "checkpoints" / "step_00000003"
    r = export_adapter(step3, tmp_path / "a")  # a step directory: the run record is two levels up
    assert r == dict(checkpoint=str(step3), step=3, adapter=str(tmp_path / "a"), modules=6,
                     model=json.loads((trained / "jqlora_run.json").read_text())["model"], rank=4, alpha=8.0)
    got, cfg = load_peft_adapter(tmp_path / "a")
    want, _ = load_peft_adapter(trained / "adapter")
    assert cfg["r"] == 4 and set(got) == set(want)
    for m in want:
        np.testing.assert_array_equal(got[m]["lora_B"], want[m]["lora_B"])
    with pytest.raises(RunError, match=r"no checkpoint for step 7 \(have \[2, 3\]\)"):
        export_adapter(trained, tmp_path / "b", step=7)
    assert not (tmp_path / "b").exists()


def test_import_adapter_library(trained, nf4_ckpt, tmp_path):
    from interop.peft_adapter import AdapterFormatError
    from jqlora.adapters import AdapterMismatchError, import_adapter

    r = import_adapter(trained / "adapter", tokens=4)  # the model: the adapter's base_model_name_or_path
    assert r["model"] == str(nf4_ckpt) and r["tokens_shape"] == [2, 4]
    assert len(r["matched"]) == 6 and r["zero_B_modules"] == [] and r["logits_max_abs_change"] > 0
    assert r["scale"] == pytest.approx(8 / 4)
    with pytest.raises(AdapterFormatError, match="no such adapter directory"):
        import_adapter(tmp_path / "nope")
    hub = Path(shutil.copytree(trained / "adapter", tmp_path / "hub"))
    c = json.loads((hub / "adapter_config.json").read_text())
    c["base_model_name_or_path"] = "org/not-a-local-dir"
    (hub / "adapter_config.json").write_text(json.dumps(c))
    with pytest.raises(AdapterMismatchError, match="pass --model"):
        import_adapter(hub)


# ---------------------------------------------------------------------------------------------- demo
def test_demo_pipeline_quick(tmp_path):
    from jqlora.demo import DemoSettings, run_demo

    lines = []
    s = run_demo(tmp_path / "demo", DemoSettings.quick(), log=lines.append, progress=False)
    text = "\n".join(lines)
    assert s["ok"] and s["crosscheck"]["passed"] and s["adapter_roundtrip_max_abs"] == 0.0
    for key in ("loss_png", "loss_csv", "adapter", "base_nf4"):
        assert Path(s[key]).exists(), key
    assert (Path(s["adapter"]) / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["accuracy_after"] == s["accuracy_after"]
    assert "before" in text and "crosscheck" in text and "jqlora demo summary" in text


def test_demo_quantized_folder_follows_the_umask(tmp_path):
    """The demo's NF4 folder, written beside its place and renamed there, gets the umask's mode as
    every export does (a temporary directory's is 0700); a second build replaces it."""
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from jqlora.demo.build import quantize_with_bnb

    dense = checkpoint_factory.build_llama_checkpoint(tmp_path / "dense", quant=None)
    old = os.umask(0o022)
    try:
        out = quantize_with_bnb(dense, tmp_path / "demo" / "base-nf4")
        assert out.stat().st_mode & 0o777 == 0o755
        assert quantize_with_bnb(dense, out) == out and (out / "config.json").is_file()
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755 and sorted(p.name for p in out.parent.iterdir()) == ["base-nf4"]
