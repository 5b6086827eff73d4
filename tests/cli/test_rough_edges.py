"""What a first hour with `jqlora train` runs into: settings checked before anything loads or is
written, Ctrl-C at any moment is status 130 and "interrupted", the run record's paths absolute
(resume from another directory), outputs with the umask's mode, loss.csv from step 1, and CLI
errors that name flags, not Python parameters. A tiny plain Llama (no torch) with the demo's
character tokenizer."""
from __future__ import annotations

import csv
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import run_cli

CFG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """root/model (a tiny checkpoint with a tokenizer) and root/train.jsonl."""
    import interop
    from jqlora.demo import task
    from jqlora.models import init_params

    root = tmp_path_factory.mktemp("rough")
    interop.save_bnb_checkpoint(root / "model", init_params(CFG, seed=0, std=0.1), CFG)
    task.save_tokenizer(root / "model")
    task.write_jsonl(root / "train.jsonl", task.make_split(32, 0, seed=2).train)
    return root


SMALL = ("--seq-len", "16", "--batch-size", "2", "--rank", "2", "--compute-dtype", "float32", "--no-tensorboard",
         "--no-progress")


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """`jqlora train` run from `setup` as the working directory, every path relative: 3 steps,
    a row every 2 steps, a checkpoint every step; under umask 022."""
    from jqlora.cli import main

    old_cwd, old_umask = os.getcwd(), os.umask(0o022)
    os.chdir(setup)
    try:
        rc = main(["train", "--model", "model", "--data-path", "train.jsonl", "--out-dir", "run", "--steps", "3",
                   "--log-every", "2", "--save-every", "1", "--keep-checkpoints", "none", *SMALL])
    finally:
        os.chdir(old_cwd)
        os.umask(old_umask)
    assert rc == 0
    return setup / "run"


# ----------------------------------------------------------------- (a) settings before anything
@pytest.mark.parametrize("flag,value,says", [("--remat", "maybe", "--remat must be"),
                                             ("--seq-len", "0", "--seq-len must be >= 1"),
                                             ("--warmup-ratio", "2", "--warmup-ratio must be in [0, 1]")])
def test_invalid_settings_exit_2_before_the_model_loads_and_write_nothing(setup, tmp_path, capsys, flag, value,
                                                                          says):
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--model", setup / "model", "--data-path", setup / "train.jsonl",
                         "--out-dir", out, *SMALL, flag, value)
    assert rc == 2 and says in err and "Traceback" not in err, err
    assert "attention:" not in err  # printed just before the model loads
    assert not out.exists()


# ----------------------------------------------------------------------- (b) Ctrl-C at any moment
def _interrupt_at(setup, tmp_path, marker: str, steps: int) -> tuple[int, str, Path]:
    """Start `jqlora train` in a process of its own, send SIGINT once a stderr line starts with
    `marker`; (status, stderr, out_dir)."""
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JQLORA_COMPILE_CACHE": "0"}
    argv = ["train", "--model", str(setup / "model"), "--data-path", str(setup / "train.jsonl"), "--out-dir",
            str(out), "--steps", str(steps), "--save-every", "0", *map(str, SMALL[:-1])]
    # Python's own Ctrl-C handler, as a terminal gives it: a suite started as a background job inherits
    # SIGINT ignored, and Python then installs no handler (the CLI would rightly not be interrupted)
    boot = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.argv = ['jqlora'] + {argv!r}; runpy.run_module('jqlora.cli', run_name='__main__')")
    p = subprocess.Popen([sys.executable, "-c", boot], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         env=env)
    seen = []
    try:
        for line in p.stderr:
            seen.append(line)
            if line.startswith(marker):
                time.sleep(0.2)
                p.send_signal(signal.SIGINT)
                break
        rest = p.stderr.read()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert any(line.startswith(marker) for line in seen), "".join(seen)
    return p.returncode, "".join(seen) + rest, out


@pytest.mark.parametrize("marker,steps", [("data:", 3),       # reading the data, loading the model
                                          ("remat:", 3),      # tracing: the first compilation follows
                                          ("train: step 1/", 1000)])  # between steps
def test_ctrl_c_is_status_130_and_interrupted(setup, tmp_path, marker, steps):
    rc, err, out = _interrupt_at(setup, tmp_path, marker, steps)
    assert rc == 130, (rc, err)  # not -11 (a segfault at shutdown) nor 1 (a traceback)
    assert "jqlora train: interrupted" in err and "Traceback" not in err, err
    if out.exists():  # no lock and no temp file left behind
        assert not list(out.glob(".*")) and not (out / "jqlora.lock").exists(), list(out.iterdir())


# --------------------------------------------------------------- (c) absolute paths, resume elsewhere
def test_run_record_paths_are_absolute_and_resume_works_from_elsewhere(trained, setup, tmp_path, capsys,
                                                                     monkeypatch):
    record = json.loads((trained / "jqlora_run.json").read_text())
    assert record["model"] == str((setup / "model").resolve())
    for key in ("data_path", "tokenizer_path", "out_dir"):
        assert Path(record["train"][key]).is_absolute() and Path(record["train"][key]).exists(), key
    assert Path(record["train"]["data_path"]) == setup / "train.jsonl"
    monkeypatch.chdir(tmp_path)  # no model/ or train.jsonl here
    rc, out, err = run_cli(capsys, "train", "--resume", "--out-dir", trained, "--steps", "4")
    assert rc == 0, err
    assert "trained steps 4..4 (resumed from step 3)" in out


# ---------------------------------------------------------------------------- (d) the umask's mode
def test_outputs_get_the_umask_s_mode(trained, tmp_path, capsys):
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    for d in [trained / "adapter", *sorted((trained / "checkpoints").iterdir())]:  # written under umask 022
        assert mode(d) == 0o755, (d, oct(mode(d)))
    old = os.umask(0o027)
    try:
        rc, _, err = run_cli(capsys, "export-peft", trained, tmp_path / "peft")
    finally:
        os.umask(old)
    assert rc == 0, err
    assert mode(tmp_path / "peft") == 0o750
    assert all(mode(f) == 0o640 for f in (tmp_path / "peft").iterdir())


# ------------------------------------------------------------------------- (e) loss.csv's rows
def test_loss_csv_starts_at_step_1(trained):
    with open(trained / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows][:3] == [1, 2, 3]  # step 1, every 2nd, the last


# ---------------------------------------------------------------------------- (g) flags, not params
def test_errors_speak_flags(trained, setup, capsys):
    rc, _, err = run_cli(capsys, "train", "--model", setup / "model", "--data-path", setup / "train.jsonl",
                         "--out-dir", trained, "--steps", "5", *SMALL)
    assert rc == 2 and "--resume" in err and "resume=True" not in err, err
    assert "another --out-dir" in err


# ------------------------------------------------------------- (f) a run record from the Python API
def test_python_api_run_is_exported_by_the_cli(setup, tmp_path, capsys):
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from interop import safetensors_io
    from jqlora import adapters, models
    from jqlora.lora import LoraConfig
    from jqlora.train import TrainConfig, train

    lora = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"))
    model = models.load_causal_lm(setup / "model", lora=lora, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = TrainConfig(data_path=str(setup / "train.jsonl"), tokenizer_path=str(setup / "model"), seq_len=16,
                      batch_size=2, steps=2, lr=1e-2, out_dir=str(tmp_path / "api"), tensorboard=False,
                      progress=False)
    train(model, cfg)
    record = json.loads((tmp_path / "api" / "jqlora_run.json").read_text())
    assert record["model"] == str((setup / "model").resolve()) and record["compute_dtype"] == "float32"
    assert record["lora"]["target_modules"] == ["down_proj", "q_proj"] and record["lora"]["rank"] == 2
    rc, _, err = run_cli(capsys, "export-peft", tmp_path / "api", tmp_path / "peft")
    assert rc == 0, err
    adapters.save_adapter(tmp_path / "direct", model, lora)
    exported, _ = safetensors_io.deserialize((tmp_path / "peft" / "adapter_model.safetensors").read_bytes(), "peft")
    direct, _ = safetensors_io.deserialize((tmp_path / "direct" / "adapter_model.safetensors").read_bytes(), "direct")
    assert exported.keys() == direct.keys() and len(direct) == 2 * 2 * CFG["num_hidden_layers"]
    for k in direct:
        np.testing.assert_array_equal(exported[k], direct[k])
    # a model whose folder is unknown: the record says so, and export asks for --model
    bare = models.from_params(models.init_params(CFG, seed=0, std=0.1), CFG, lora=lora, compute_dtype=jnp.float32,
                              rngs=nnx.Rngs(0))
    train(bare, TrainConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "bare"), "steps": 1}))
    assert json.loads((tmp_path / "bare" / "jqlora_run.json").read_text())["model"] is None
    rc, _, err = run_cli(capsys, "export-peft", tmp_path / "bare", tmp_path / "peft2")
    assert rc == 2 and "pass --model" in err, err
    rc, _, err = run_cli(capsys, "export-peft", tmp_path / "bare", tmp_path / "peft2", "--model", setup / "model")
    assert rc == 0, err
