"""What a fine-tuning run logs and how long it runs: the learning-rate schedules (against float64
closed forms, and inside the optimizer), `epochs` turned into steps from the packed rows, the
grad_norm and perplexity columns, TensorBoard event files (read back record by record, CRCs
checked, and compared with loss.csv / eval.csv, across a resume), and the CLI's refusals.

Models: test_train's StubLM (library runs) and test_train_robustness' tiny NF4 Llama (CLI runs).
"""
from __future__ import annotations

import csv
import json
import math
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cli_runner import run_cli
from jqlora import train as T
from jqlora.runs import RUN_FILE
from jqlora.train import examples as E
from jqlora.train import loop, optim
from jqlora.train import tokenization as TK
from jqlora.train.config import resolve_run_length
from test_train import StubLM, base_config, pattern_rows, tok_path, write_jsonl  # noqa: F401
from test_train_robustness import nf4_model, train_args  # noqa: F401


# ------------------------------------------------------------------------------------------------
# schedules
# ------------------------------------------------------------------------------------------------

def closed_form(kind, lr, warmup, total, ratio, c) -> float:
    """float64: the learning rate of optimizer count c (the update of step c + 1)."""
    if c < warmup:
        return lr * (c + 1) / warmup
    end, span = lr * ratio, max(total - warmup, 1)
    p = min(c - warmup, span) / span
    if kind == "cosine":
        return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * p))
    if kind == "linear":
        return lr + (end - lr) * p
    return lr


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("lr, warmup, total, ratio", [(1.0, 4, 14, 0.0), (2e-4, 0, 10, 0.1),
                                                      (3e-2, 1, 7, 0.5), (1e-3, 5, 5, 0.2)])
def test_schedule_values_equal_the_closed_form(kind, lr, warmup, total, ratio):
    s = T.make_schedule(lr, warmup, total, final_lr_ratio=ratio, kind=kind)
    got = [float(s(c)) for c in range(total + 3)]
    want = [closed_form(kind, lr, warmup, total, ratio, c) for c in range(total + 3)]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    if warmup:
        assert got[0] == pytest.approx(lr / warmup, rel=1e-6)  # the first update is not at lr 0
    if kind == "constant":
        assert all(v == pytest.approx(lr, rel=1e-7) for v in got[warmup:])
    span = max(total - warmup, 1)
    if kind != "constant":  # the decays end at lr * final_lr_ratio (at count `total` unless the
        # warmup takes every step) and stay there
        assert got[warmup + span:] == pytest.approx([lr * ratio] * (total + 3 - warmup - span),
                                                     rel=1e-6, abs=lr * 1e-7)
    # after warmup the value is optax's own decay schedule, shifted by the warmup
    ref = {"cosine": optax.cosine_decay_schedule(lr, span, alpha=ratio),
           "linear": optax.linear_schedule(lr, lr * ratio, span),
           "constant": optax.constant_schedule(lr)}[kind]
    assert np.array_equal(np.float32([ref(c - warmup) for c in range(warmup, total + 3)]),
                          np.float32(got[warmup:]))
    with pytest.raises(ValueError, match="cosine, linear, constant"):
        T.make_schedule(lr, warmup, total, kind="step")


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_the_optimizer_steps_by_the_chosen_schedule(kind):
    """With a constant gradient, Adam's update is lr_t * g / (|g| + eps) ~= lr_t at every count:
    the size of each update is the schedule's value."""
    lr, warmup, total = 0.1, 2, 6
    tx = T.make_optimizer(lr, warmup, total, grad_clip=None, lr_schedule=kind, final_lr_ratio=0.25)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    grads = {"w": jnp.full(3, 0.5)}
    sizes = []
    for _ in range(total):
        updates, state = tx.update(grads, state, params)
        sizes.append(float(-updates["w"][0]))
    want = [closed_form(kind, lr, warmup, total, 0.25, c) for c in range(total)]
    np.testing.assert_allclose(sizes, want, rtol=1e-4)


def test_the_loop_logs_each_lr_from_a_host_table_not_a_device_call(tmp_path, tok_path, monkeypatch):  # noqa: F811
    """The logged learning rates are the schedule's, and the loop never evaluates the schedule on
    a concrete step: on a GPU that call would queue behind the step in flight and its read-back
    would stall the pipeline every step (only the traced table evaluation is allowed)."""
    concrete_calls = []

    def watched(*args, **kw):
        schedule = T.make_schedule(*args, **kw)

        def call(count):
            if not isinstance(count, jax.core.Tracer):
                concrete_calls.append(count)
            return schedule(count)
        return call

    monkeypatch.setattr(loop, "make_schedule", watched)
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(24))
    res = T.train(StubLM(), base_config(tmp_path, tok_path, data, steps=7, warmup=3, lr_schedule="linear",
                                        final_lr_ratio=0.2))
    assert concrete_calls == []
    want = [closed_form("linear", 1e-2, 3, 7, 0.2, c) for c in range(7)]
    np.testing.assert_allclose(res.lrs, want, rtol=2e-6)
    table = T.schedule_table(T.make_schedule(1e-2, 3, 7, final_lr_ratio=0.2, kind="linear"), 7)
    assert table.dtype == np.float32 and table.shape == (7,)
    np.testing.assert_allclose(table, want, rtol=2e-6)


# ------------------------------------------------------------------------------------------------
# epochs
# ------------------------------------------------------------------------------------------------

def walked_rows_per_epoch(tokenized, **kw) -> int:
    """Rows the iterator fills before the first epoch's pieces are used up, drawn one row at a time."""
    it = T.BatchIterator(tokenized, batch_size=1, **kw)
    rows = 0
    while it.epoch == 0 and it.index < len(it.pieces):
        next(it)
        rows += 1
    return rows


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("seq_len, seed", [(8, 0), (11, 1), (16, 2), (40, 3)])
def test_rows_per_epoch_counts_the_rows_the_iterator_fills(packing, seq_len, seed):
    rng = np.random.default_rng(seed)
    tokenized = [(rng.integers(0, 30, int(n)).astype(np.int32), np.ones(int(n), bool))
                 for n in rng.integers(1, 12, 23)]  # 1: an empty piece
    kw = dict(seq_len=seq_len, packing=packing, seed=seed)
    it = T.BatchIterator(tokenized, batch_size=3, **kw)
    assert it.rows_per_epoch() == walked_rows_per_epoch(tokenized, **kw)
    if not packing:
        assert it.rows_per_epoch() == 23


def test_epochs_set_the_steps_and_the_run_stops_there(tmp_path, tok_path):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(21))
    kw = dict(batch_size=2, grad_accum=2, seq_len=16, log_every=1, warmup=0, steps=1000)
    tok = T.load_tokenizer(tok_path)
    tokenized = TK.tokenize_examples(tok, E.load_jsonl(data), T.special_tokens(tok, tokenizer_path=tok_path))
    rows = walked_rows_per_epoch(tokenized, seq_len=16, packing=True, seed=3)
    it = T.BatchIterator(tokenized, seq_len=16, batch_size=2, seed=3)
    per_epoch = math.ceil(rows / 4)
    assert rows > 8 and per_epoch > 2
    # fractional epochs round up; the warmup ratio counts in the resolved steps (rounded up)
    for epochs, want in [(2, 2 * per_epoch), (1.5, math.ceil(1.5 * per_epoch))]:
        resolved = resolve_run_length(base_config(tmp_path, tok_path, data, epochs=epochs,
                                                  warmup_ratio=0.3, **kw), it).config
        assert (resolved.steps, resolved.warmup) == (want, math.ceil(0.3 * want))

    seen = []
    cfg = base_config(tmp_path, tok_path, data, epochs=2, warmup_ratio=0.3, save_every=2, **kw)

    def crash(step, m):
        if step == 3:
            raise RuntimeError("simulated interruption")

    with pytest.raises(RuntimeError, match="simulated"):
        T.train(StubLM(), cfg, on_ready=seen.append, on_step=crash)
    assert seen[0].steps == 2 * per_epoch and seen[0].epochs == 2
    res = T.train(StubLM(), cfg, resume=True)  # the resumed run continues towards the same step
    steps = 2 * per_epoch
    assert res.resumed_from == 2 and res.steps == list(range(3, steps + 1))
    assert res.step == res.total_steps == steps
    assert res.lrs[-1] == pytest.approx(closed_form("cosine", 1e-2, math.ceil(0.3 * steps), steps,
                                                    0.0, steps - 1), rel=1e-5)
    with open(res.csv_path) as f:
        assert [int(r[0]) for r in list(csv.reader(f))[1:]] == list(range(1, steps + 1))
    stored = json.loads((res.checkpoint / "state.json").read_text())["extra"]["train_config"]
    assert (stored["steps"], stored["epochs"], stored["warmup"]) == (steps, 2, math.ceil(0.3 * steps))
    with pytest.raises(ValueError, match="rows_per_epoch"):
        resolve_run_length(T.TrainConfig(epochs=1), object())


# ------------------------------------------------------------------------------------------------
# logged metrics, TensorBoard
# ------------------------------------------------------------------------------------------------

def _masked_crc(data: bytes) -> int:
    """The TFRecord format's masked CRC-32C."""
    from tensorboardX.crc32c import crc32c

    c = crc32c(data) & 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path: Path) -> list:
    """Every Event of one event file (TFRecord framing: length, its CRC, data, its CRC)."""
    from tensorboardX.proto import event_pb2

    raw, out, at = path.read_bytes(), [], 0
    while at < len(raw):
        (n,) = struct.unpack_from("<Q", raw, at)
        (hcrc,) = struct.unpack_from("<I", raw, at + 8)
        assert hcrc == _masked_crc(raw[at:at + 8]), path
        data = raw[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack_from("<I", raw, at + 12 + n)
        assert dcrc == _masked_crc(data), path
        out.append(event_pb2.Event.FromString(data))
        at += 12 + n + 4
    return out


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard shows it: files in name order, and a session START at
    step s hides what earlier files logged at steps >= s."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for f in sorted(logdir.iterdir()):
        for ev in read_events(f):
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                for by_step in scalars.values():
                    for s in [s for s in by_step if s >= ev.step]:
                        del by_step[s]
            for v in ev.summary.value:
                scalars.setdefault(v.tag, {})[ev.step] = v.simple_value
    return scalars


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def test_tensorboard_scalars_equal_the_csvs_across_a_resume(tmp_path, tok_path):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(16))
    cfg = base_config(tmp_path, tok_path, data, steps=8, log_every=2, save_every=4, eval_every=4,
                      eval_data_path=str(data), lr_schedule="linear")

    def crash(step, m):
        if step == 7:
            raise RuntimeError("simulated interruption")

    with pytest.raises(RuntimeError):
        T.train(StubLM(), cfg, on_step=crash)  # logs steps 2, 4, 6 (and eval 4); checkpoint at 4
    res = T.train(StubLM(), cfg, resume=True)
    out = Path(cfg.out_dir)
    files = sorted((out / "tensorboard").iterdir())
    assert [f.name.split(".")[-2] for f in files] == ["step00000001", "step00000005"]
    header, rows = read_csv(out / "loss.csv")
    assert header == ["step", "loss", "lr", "tokens_per_s", "grad_norm"]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 6, 8]  # step 1, then every 2; 6 again after the resume from 4
    for r, window in zip(rows[3:], ((5, 6), (7, 8))):  # this call's rows: the loss is the window's mean
        i = res.steps.index(int(r[0]))
        mean = sum(res.losses[res.steps.index(s)] for s in window) / len(window)
        assert [float(r[1]), float(r[2]), float(r[4])] == [pytest.approx(mean, rel=1e-12), res.lrs[i], res.grad_norms[i]]
    assert res.losses[0] != res.losses[1]  # so the mean differs from the row's own step's loss
    tb = tensorboard_scalars(out / "tensorboard")
    assert set(tb) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                       "eval/loss", "eval/perplexity"}
    for col, tag in [(1, "train/loss"), (2, "train/lr"), (3, "train/tokens_per_s"), (4, "train/grad_norm")]:
        assert tb[tag] == {int(r[0]): float(np.float32(float(r[col]))) for r in rows}, tag
    eheader, erows = read_csv(out / "eval.csv")
    assert eheader == ["step", "eval_loss", "perplexity"] and [int(r[0]) for r in erows] == [4, 8]
    for r in erows:
        assert float(r[2]) == pytest.approx(math.exp(float(r[1])), rel=1e-12)
    assert res.eval_losses == [(8, float(erows[-1][1]))]
    assert tb["eval/loss"] == {int(r[0]): float(np.float32(float(r[1]))) for r in erows}
    assert tb["eval/perplexity"] == {int(r[0]): float(np.float32(float(r[2]))) for r in erows}
    # the first file still holds the interrupted call's step 6; only TensorBoard's view drops it
    assert 6 in {ev.step for ev in read_events(files[0]) if ev.summary.value}


def test_tensorboard_off_or_missing(tmp_path, tok_path, monkeypatch):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", pattern_rows(8))
    res = T.train(StubLM(), base_config(tmp_path, tok_path, data, steps=2, tensorboard=False))
    assert not (res.out_dir / "tensorboard").exists() and res.csv_path.is_file()
    from jqlora.train import config as train_config

    for module in (loop, train_config):  # TrainConfig.validate checks, train() decides
        monkeypatch.setattr(module, "tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match="tensorboardX is not installed"):
        base_config(tmp_path, tok_path, data, tensorboard=True).validate()
    res = T.train(StubLM(), base_config(tmp_path, tok_path, data, steps=2, out_dir=str(tmp_path / "b")))
    assert not (res.out_dir / "tensorboard").exists() and res.step == 2


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------

def test_cli_epochs_record_resume_and_progress_lines(nf4_model, tmp_path, capsys, recwarn):  # noqa: F811
    from jqlora.train import load_tokenizer, make_batch_iterator

    it = make_batch_iterator(nf4_model.parent / "train.jsonl", load_tokenizer(nf4_model), seq_len=32,
                             batch_size=4, seed=1, tokenizer_path=nf4_model)
    steps = math.ceil(it.rows_per_epoch() / 4)
    out = tmp_path / "run"
    rc, text, err = run_cli(capsys, *train_args(nf4_model, out, "--epochs", 1, "--warmup-ratio", 0.5,
                                                "--lr-schedule", "constant", "--no-tensorboard"))
    assert rc == 0, err
    assert f"1 epochs = {steps} steps ({it.rows_per_epoch()} rows of 32 tokens per epoch" in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: step")]
    assert lines and all(" grad_norm " in ln for ln in lines), err
    record = json.loads((out / RUN_FILE).read_text())["train"]
    assert (record["steps"], record["epochs"], record["warmup"]) == (steps, 1, math.ceil(steps / 2))
    assert record["lr_schedule"] == "constant" and not (out / "tensorboard").exists()
    rc, text, err = run_cli(capsys, "train", "--resume", "--out-dir", out, "--epochs", 2)
    assert rc == 0 and f"resumed from step {steps}" in text, err
    record = json.loads((out / RUN_FILE).read_text())["train"]
    assert (record["steps"], record["warmup"]) == (2 * steps, steps)  # both counted again
    assert not [w for w in recwarn if "replaced" in str(w.message)]  # the stored ones were derived
    # a later --steps replaces the stored epochs (and --warmup the stored ratio)
    rc, text, _ = run_cli(capsys, "train", "--resume", "--out-dir", out, "--steps", 3 * steps,
                          "--warmup", 1, "--dry-run")
    train = json.loads(text)["train"]
    assert (train["steps"], train["epochs"], train["warmup"], train["warmup_ratio"]) == (3 * steps, None, 1, None)


@pytest.mark.parametrize("extra, needle", [
    (["--epochs", 2, "--steps", 5], "--epochs and --steps both given"),
    (["--warmup", 2, "--warmup-ratio", 0.1], "--warmup-ratio and --warmup both given"),
    (["--epochs", 0], "--epochs must be > 0"),  # the CLI names flags, not TrainConfig fields
    (["--warmup-ratio", 1.5], "--warmup-ratio must be in [0, 1]"),
])
def test_cli_refuses_conflicting_or_bad_lengths(nf4_model, tmp_path, capsys, extra, needle):  # noqa: F811
    rc, _, err = run_cli(capsys, *train_args(nf4_model, tmp_path / "r", *extra))
    assert rc == 2 and needle in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1
    assert not (tmp_path / "r").exists()


def test_cli_config_file_with_both_and_bad_schedule(nf4_model, tmp_path, capsys):  # noqa: F811
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train": {"epochs": 1, "steps": 4}}))
    rc, _, err = run_cli(capsys, *train_args(nf4_model, tmp_path / "r", "--config", cfg))
    assert rc == 2 and f"epochs in {cfg} and steps in {cfg} both given" in err, err
    rc, _, err = run_cli(capsys, *train_args(nf4_model, tmp_path / "r", "--lr-schedule", "step"))
    assert rc == 2 and "invalid choice: 'step'" in err
    from jqlora.cli.train_cmd import _CHOICES

    assert _CHOICES["lr_schedule"] == optim.LR_SCHEDULES
