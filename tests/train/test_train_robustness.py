"""`jqlora train` when things go wrong: a refused or failed command changes nothing on disk, two
writers on one out dir, a full or read-only disk, kill -9 at random points (inside checkpoint
writes too) then --resume bit for bit, data with nothing to train on, progress in a log file.

The model is a tiny Llama with NF4 weights written by jqlora itself (`interop.save_bnb_checkpoint`,
no torch), with the demo's character tokenizer. Subprocess tests run the real console entry point
(`python -m jqlora.cli`); the others call `jqlora.cli.main` in-process.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import run_cli
from jqlora.runs import RUN_FILE
from jqlora.train.lock import LOCK_FILE

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
              tie_word_embeddings=False, rms_norm_eps=1e-5)

# Runs the real CLI in a subprocess; JQLORA_TEST_SLOW_SAVE_S seconds of sleep after each checkpoint's
# arrays file is written inside its temp directory (state.json not yet there), so that a kill can
# land inside a checkpoint write.
SLOW_CLI = """
import os, sys, time
import jqlora.train.checkpoint as c
delay = float(os.environ.get("JQLORA_TEST_SLOW_SAVE_S", "0"))
orig = c.write_bytes_atomic
def slow(path, data):
    out = orig(path, data)
    if delay and path.name == c.ARRAYS_FILE:
        time.sleep(delay)
    return out
c.write_bytes_atomic = slow
from jqlora.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def nf4_model(tmp_path_factory) -> Path:
    """A tiny NF4 Llama checkpoint + tokenizer, and train.jsonl beside it (64 prompt/completion lines)."""
    from interop.bnb_save import save_bnb_checkpoint
    from jqlora import models, quant
    from jqlora.demo import task

    root = tmp_path_factory.mktemp("nf4")
    params = models.init_params(CONFIG, seed=0, std=0.1)
    for k in [k for k in params if k.endswith("_proj.weight")]:
        params[k[: -len(".weight")]] = quant.quantize_4bit(params.pop(k), "nf4", 64, True)
    save_bnb_checkpoint(root / "model", params, CONFIG)
    task.save_tokenizer(root / "model")
    task.write_jsonl(root / "train.jsonl", task.make_split(64, 0, seed=3).train)
    return root / "model"


def train_args(model: Path, out: Path, *extra) -> list[str]:
    return ["train", "--model", str(model), "--compute-dtype", "float32", "--rank", "4", "--alpha", "8",
            "--target-modules", "q_proj,v_proj", "--data-path", str(model.parent / "train.jsonl"),
            "--seq-len", "32", "--batch-size", "4", "--lr", "0.01", "--seed", "1", "--lora-dropout", "0.1",
            "--out-dir", str(out), "--attention", "einsum", "--remat", "false", *map(str, extra)]



def tree(d: Path) -> dict[str, str]:
    """Every file under `d` (relative path -> sha256 of its bytes), temp names included."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(d: Path) -> list[str]:
    """Temp files/dirs of interrupted writes, and a lock file, anywhere under `d`."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")
                  if ".tmp" in p.name or ".old-" in p.name or p.name == LOCK_FILE)


def popen(argv, **env) -> subprocess.Popen:
    e = {**os.environ, "JAX_PLATFORMS": "cpu", **{k: str(v) for k, v in env.items()}}
    return subprocess.Popen([sys.executable, "-c", SLOW_CLI, *argv], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(cond, what: str, p: subprocess.Popen | None = None, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if p is not None and p.poll() is not None:
            raise AssertionError(f"process ended ({p.returncode}) before {what}: {p.communicate()[1][-2000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -------------------------------------------------------------------- a failed command changes nothing
def test_refused_and_failed_runs_leave_the_run_on_disk_as_it_was(nf4_model, tmp_path, capsys):
    """The issue's repro: run A; the same command again without --resume (refused), and a --resume
    with another data file (fails on the data position) leave every file of A byte for byte as it
    was, so export-peft and --resume still work."""
    out = tmp_path / "A"
    rc, _, err = run_cli(capsys, *train_args(nf4_model, out, "--steps", 2, "--save-every", 1))
    assert rc == 0, err
    before = tree(out)
    assert RUN_FILE in before and "checkpoints/step_00000002/state.json" in before
    rc, _, err = run_cli(capsys, *train_args(nf4_model, out, "--steps", 2, "--rank", 8, "--target-modules",
                                             "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"))
    assert rc == 2 and "already holds checkpoints" in err and "Traceback" not in err
    assert tree(out) == before
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "ab=", "completion": "ba"}\n' * 5)
    rc, _, err = run_cli(capsys, "train", "--resume", "--out-dir", out, "--data-path", other, "--steps", 3)
    assert rc == 2 and "different data" in err and "Traceback" not in err
    assert tree(out) == before
    rc, _, err = run_cli(capsys, "export-peft", out, tmp_path / "exported")
    assert rc == 0, err
    rc, text, err = run_cli(capsys, "train", "--resume", "--out-dir", out, "--steps", 3)
    assert rc == 0 and "resumed from step 2" in text, err
    assert json.loads((out / RUN_FILE).read_text())["train"]["steps"] == 3
    assert leftovers(out) == []


def test_refused_run_into_a_new_directory_creates_nothing(nf4_model, tmp_path, capsys):
    """A run refused after the lock was taken (here: nothing to train on) removes the directory it made."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abcdefghij" * 4 + "=", "completion": "xy"}) + "\n"
                            for _ in range(6)))
    out = tmp_path / "new" / "run"
    rc, _, err = run_cli(capsys, *train_args(nf4_model, out, "--steps", 2, "--data-path", data))
    assert rc == 2 and "Traceback" not in err
    assert "nothing to train on: all 6 examples have no supervised token within seq_len=32" in err
    assert not out.exists()


# ------------------------------------------------------------------------------ disk full, read-only
@pytest.mark.parametrize("code", ["ENOSPC", "EROFS", "EACCES"])
def test_disk_errors_exit_2_naming_the_path(nf4_model, tmp_path, capsys, monkeypatch, code):
    """A write the disk refuses (full, read-only, no permission) at the second checkpoint: exit 2, one
    line naming that checkpoint; the first checkpoint and the record stay, no temp dir is left."""
    import interop.atomic_io as aio
    from jqlora.train import checkpoint as ckpt_mod

    calls = []

    def failing(path, data):
        calls.append(path)
        if len(calls) > 2:  # the second checkpoint's arrays file
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])  # half written when the disk gave up
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return aio.write_bytes_atomic(path, data)

    monkeypatch.setattr(ckpt_mod, "write_bytes_atomic", failing)
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, *train_args(nf4_model, out, "--steps", 3, "--save-every", 1))
    lines = [ln for ln in err.splitlines() if ln.startswith("jqlora train: error:")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert str(out / "checkpoints" / "step_00000002") in lines[0]
    assert {"ENOSPC": "no space left", "EROFS": "read-only", "EACCES": "permission denied"}[code] in lines[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert leftovers(out) == [] and (out / RUN_FILE).is_file()
    monkeypatch.undo()
    (out / ".adapter.tmp-killed").mkdir()  # what a kill inside the adapter/record writes leaves
    (out / ".jqlora_run.json.tmp-killed").write_text("{")
    rc, text, err = run_cli(capsys, "train", "--resume", "--out-dir", out)  # once the disk is back
    assert rc == 0 and "resumed from step 1" in text, err
    assert leftovers(out) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_dir_exits_2(nf4_model, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, _, err = run_cli(capsys, *train_args(nf4_model, ro / "run", "--steps", 1))
    finally:
        ro.chmod(0o755)
    assert rc == 2 and "Traceback" not in err and str(ro / "run") in err and "permission denied" in err


# ----------------------------------------------------------- kill -9 and resume; two writers, stale lock
def test_kill_9_then_resume_is_bit_exact_and_a_second_writer_is_refused(nf4_model, tmp_path, capsys):
    """Real subprocesses: run P1 (slow checkpoint writes) while a second `jqlora train` on the same
    out dir is refused (exit 2, naming the lock file and P1's pid); SIGKILL P1 inside a checkpoint
    write; P2 --resume (slow checkpoint writes too) takes over the stale lock and is killed at a
    random point after its next checkpoint; a last --resume continues from that checkpoint. The
    adapter and the loss curve equal an uninterrupted run's bit for bit, every checkpoint on disk
    after a kill is complete and valid, and nothing temporary (nor the lock file) is left. The
    uninterrupted run, the refused writer and the last --resume run in this process
    (`jqlora.cli.main`; the lock is a `flock`, which another open file in this process cannot take
    either): a subprocess costs a JAX start-up and uncached compiles."""
    from jqlora.train import checkpoint as ckpt_mod

    steps = 6
    ref = tmp_path / "ref"
    rc, _, err = run_cli(capsys, *train_args(nf4_model, ref, "--steps", steps, "--save-every", 1))
    assert rc == 0, err
    run, ck, lock = tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "run" / LOCK_FILE

    def argv(*extra):
        return train_args(nf4_model, run, "--steps", steps, "--save-every", 1, *extra)

    def newest() -> int:
        return max([s for s, _ in ckpt_mod.list_checkpoints(ck)], default=0)

    def check_complete():  # no half-written checkpoint is ever listed
        for _, path in ckpt_mod.list_checkpoints(ck):
            ckpt_mod._read(path)

    p1 = popen(argv(), JQLORA_TEST_SLOW_SAVE_S=1.0)
    wait_for(lambda: lock.is_file() and lock.read_text().strip() == str(p1.pid), "P1's lock", p1)
    rc, _, err = run_cli(capsys, *argv("--resume"))
    assert rc == 2 and "Traceback" not in err, err
    assert str(lock) in err and f"pid {p1.pid}" in err
    wait_for(lambda: ck.is_dir() and any(ck.glob(".step_*.tmp-*/" + ckpt_mod.ARRAYS_FILE)),
             "P1 inside a checkpoint write", p1)
    p1.send_signal(signal.SIGKILL)
    p1.wait()
    assert p1.returncode == -signal.SIGKILL
    assert lock.read_text().strip() == str(p1.pid)  # kill -9 leaves the file, not the flock
    check_complete()

    rng = random.Random(int(os.environ.get("JQLORA_KILL_SEED", "0")))
    n0 = newest()
    p2 = popen(argv("--resume"), JQLORA_TEST_SLOW_SAVE_S=0.5)  # slow writes: still running at the kill
    wait_for(lambda: newest() > n0 or p2.poll() is not None, f"P2's first checkpoint after step {n0}")
    time.sleep(rng.uniform(0.0, 0.3))
    p2.send_signal(signal.SIGKILL)
    _, err = p2.communicate()
    assert f"taking over the stale lock of pid {p1.pid}" in err, err
    check_complete()
    n1 = newest()
    assert n0 < n1 < steps, (n0, n1)  # the last run resumes mid-run: data position, RNG, optimizer

    rc, text, err = run_cli(capsys, *argv("--resume"))
    assert rc == 0 and f"resumed from step {n1}" in text, err
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (run / "adapter" / name).read_bytes() == (ref / "adapter" / name).read_bytes(), name
    losses = [ln.split(",")[:2] for ln in (run / "loss.csv").read_text().splitlines()]
    assert losses == [ln.split(",")[:2] for ln in (ref / "loss.csv").read_text().splitlines()]
    assert leftovers(run) == []


# ---------------------------------------------------------------------------- nothing to train on
def test_batches_without_a_supervised_token_are_skipped_and_counted(nf4_model, tmp_path, capsys):
    """9 of 10 prompts are longer than seq_len (their completions are cut off), one row per
    example: the batches of two all-prompt rows are skipped (never logged as loss 0.0), counted in
    the output and the run record, and a resumed run counts each skip once (the same total as a
    run without interruption)."""
    rows = [{"prompt": "abcdefghij" * 4 + "=", "completion": "xy"}] * 9 + [{"prompt": "ab=", "completion": "ba"}]
    data = tmp_path / "mostly_long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def args(out, *extra):
        return train_args(nf4_model, out, "--data-path", data, "--batch-size", 2, "--save-every", 1,
                          "--no-packing", "--log-every", 1, *extra)

    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="9 of 10 examples have no supervised token within seq_len=32"):
        rc, _, err = run_cli(capsys, *args(out, "--steps", 2))
    assert rc == 0, err
    first = json.loads((out / RUN_FILE).read_text())["skipped_batches"]
    assert first >= 4 and f"skipped {first} batch(es)" in err  # 4 of an epoch's 5 batches are all-prompt
    losses = [float(r.split(",")[1]) for r in (out / "loss.csv").read_text().splitlines()[1:]]
    assert len(losses) == 2 and all(x > 0.1 for x in losses), losses
    rc, _, err = run_cli(capsys, *args(out, "--steps", 4, "--resume"))
    assert rc == 0, err
    total = json.loads((out / RUN_FILE).read_text())["skipped_batches"]
    rc, _, err = run_cli(capsys, *args(tmp_path / "straight", "--steps", 4))
    assert rc == 0, err
    assert total == json.loads((tmp_path / "straight" / RUN_FILE).read_text())["skipped_batches"] >= 12


def test_progress_lines_when_stderr_is_not_a_terminal(nf4_model, tmp_path, capsys, monkeypatch):
    from jqlora.train import loop

    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, *train_args(nf4_model, out, "--steps", 3))  # pytest's stderr: no TTY
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: step")]
    assert [ln.split()[2] for ln in lines] == ["1/3", "3/3"], err  # first and last (steps < 30 s apart)
    assert all("loss" in ln and "tokens/s" in ln and "elapsed" in ln for ln in lines)
    monkeypatch.setattr(loop, "PROGRESS_EVERY_S", 0.0)
    rc, _, err = run_cli(capsys, *train_args(nf4_model, tmp_path / "r2", "--steps", 3))
    assert [ln.split()[2] for ln in err.splitlines() if ln.startswith("train: step")] == ["1/3", "2/3", "3/3"]
    rc, _, err = run_cli(capsys, *train_args(nf4_model, tmp_path / "r3", "--steps", 2, "--no-progress"))
    assert rc == 0 and "train: step" not in err


def test_lock_is_exclusive_and_released(tmp_path):
    """In one process too: a second holder is refused while the first holds the lock; the lock file
    is gone afterwards; a directory the lock created is removed when left empty."""
    from jqlora.train.lock import RunLockedError, lock_run_dir

    out = tmp_path / "new"
    with lock_run_dir(out) as path:
        assert path.read_text().strip() == str(os.getpid())
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}") as e:
            with lock_run_dir(out):
                pass
        assert str(path) in str(e.value)
    assert not out.exists()
    out.mkdir()
    (out / LOCK_FILE).write_text("999999999\n")  # left by a killed process
    with lock_run_dir(out):
        pass
    assert out.is_dir() and sorted(os.listdir(out)) == []  # a directory it did not create stays
