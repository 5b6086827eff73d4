"""What one ``jqlora train`` run reads, watched at run time: every file opened (``open`` and
``io.open``, which ``Path.read_text``/``read_bytes`` use) with the functions on the stack when it
was opened, and every example tokenized.

* ``config.json`` is parsed by `interop.bnb_common.read_config` only, twice per run (the data
  check's vocab_size, then the loader, which hands its parsed config to the checkpoint reader);
* ``tokenizer_config.json`` by `jqlora.tokenizer.read_tokenizer_config` only;
* a checkpoint's ``state.json`` by `jqlora.train.checkpoint.read_state` only (a resumed run);
* the training and eval files are read once and each example tokenized once: the data check's
  batches are what training consumes.

`tests/test_one_reader_per_format.py` checks the same in the source.
"""
from __future__ import annotations

import builtins
import io
import os
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
N_TRAIN, N_EVAL = 24, 8
# file name -> (file, function) that must be on the stack whenever it is opened
READERS = {
    "config.json": ("bnb_common.py", "read_config"),
    "tokenizer_config.json": ("tokenizer.py", "read_tokenizer_config"),
    "state.json": ("checkpoint.py", "read_state"),
}
WATCHED = (*READERS, "train.jsonl", "eval.jsonl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny NF4 Llama checkpoint + tokenizer, with train.jsonl and eval.jsonl beside it."""
    from interop.bnb_save import save_bnb_checkpoint
    from jqlora import models, quant
    from jqlora.demo import task

    root = tmp_path_factory.mktemp("reads")
    params = models.init_params(CONFIG, seed=0, std=0.1)
    for k in [k for k in params if k.endswith("_proj.weight")]:
        params[k[: -len(".weight")]] = quant.quantize_4bit(params.pop(k), "nf4", 64, True)
    save_bnb_checkpoint(root / "model", params, CONFIG)
    task.save_tokenizer(root / "model")
    split = task.make_split(N_TRAIN, N_EVAL, seed=5)
    task.write_jsonl(root / "train.jsonl", split.train)
    task.write_jsonl(root / "eval.jsonl", split.heldout)
    return root / "model"


@pytest.fixture
def reads(monkeypatch):
    """Records ``(file name, [(file, function) on the stack, innermost first])`` for each watched
    file opened, and counts the examples tokenized (under "tokenized")."""
    import jqlora.train.tokenization as tk

    log: dict = {"opened": [], "tokenized": 0}
    real_open, real_io_open = builtins.open, io.open

    def note(file):
        name = os.path.basename(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else None
        if name in WATCHED:
            frames, f = [], sys._getframe(2)
            while f is not None:
                frames.append((os.path.basename(f.f_code.co_filename), f.f_code.co_name))
                f = f.f_back
            log["opened"].append((name, frames))

    def watched_open(file, *a, **k):
        note(file)
        return real_open(file, *a, **k)

    def watched_io_open(file, *a, **k):
        note(file)
        return real_io_open(file, *a, **k)

    real_tokenize = tk.tokenize_example

    def counted_tokenize(*a, **k):
        log["tokenized"] += 1
        return real_tokenize(*a, **k)

    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(io, "open", watched_io_open)
    monkeypatch.setattr(tk, "tokenize_example", counted_tokenize)
    return log


def _args(model: Path, out: Path, *extra) -> list[str]:
    return ["train", "--model", model, "--compute-dtype", "float32", "--rank", "4", "--alpha", "8",
            "--target-modules", "q_proj,v_proj", "--data-path", model.parent / "train.jsonl",
            "--eval-data-path", model.parent / "eval.jsonl", "--eval-every", "2", "--seq-len", "32",
            "--batch-size", "4", "--out-dir", out, "--attention", "einsum", "--remat", "false", *extra]


def _opened(log, name) -> list[list]:
    return [frames for n, frames in log["opened"] if n == name]


def _who(frames) -> str:
    """The innermost library functions on a stack, as "file:function" from the inside out."""
    lib = [f"{file}:{fn}" for file, fn in frames if not file.startswith(("<", "pathlib", "test_"))]
    return " <- ".join(lib[:5])


def _outside_reader(log) -> list[str]:
    """The watched files opened without their one reader on the stack, with who opened them."""
    return [f"{n} opened by {_who(frames)}" for n, frames in log["opened"]
            if n in READERS and READERS[n] not in frames]


def _counts(log) -> dict[str, list[str]]:
    """file name -> who opened it, once per opening."""
    out: dict[str, list[str]] = {}
    for n, frames in log["opened"]:
        out.setdefault(n, []).append(_who(frames))
    return out


def test_train_reads_each_file_through_its_reader_and_tokenizes_once(model_dir, tmp_path, capsys, reads):
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, *_args(model_dir, out, "--steps", 2))
    assert rc == 0, err
    assert not _outside_reader(reads), _outside_reader(reads)
    opened = _counts(reads)
    assert len(opened["config.json"]) == 2, opened["config.json"]  # the data check, the loader
    assert len(opened["train.jsonl"]) == 1 and len(opened["eval.jsonl"]) == 1, opened
    assert reads["tokenized"] == N_TRAIN + N_EVAL
    assert _opened(reads, "tokenizer_config.json")  # the watch sees this reader at all

    reads["opened"].clear()
    reads["tokenized"] = 0
    rc, text, err = run_cli(capsys, *_args(model_dir, out, "--steps", 3, "--resume"))
    assert rc == 0 and "resumed from step 2" in text, err
    assert not _outside_reader(reads), _outside_reader(reads)
    assert _opened(reads, "state.json"), _counts(reads)  # restored (and its skip count) through read_state
    assert reads["tokenized"] == N_TRAIN + N_EVAL
