"""The run record's file (`jqlora_run.json`): its one writer, and the record of a run started from
Python (`jqlora.train.train` without ``on_ready``), so that `jqlora export-peft RUN` and
`jqlora export-merged RUN` take such a run as they take one of `jqlora train`.

The record's keys are `jqlora.runs`' (its module docstring); `jqlora.runs.RunSettings` writes the
command line's record through `write_run_record` and reads every record. Here, below `runs` in the
layers, the record is built from the model and the TrainConfig: the base model's folder
(``model_path``, else ``model.checkpoint_path`` that `jqlora.models.load_causal_lm` sets; None
when unknown, and export then asks for ``--model``), its compute dtype, backend, attention and
quantization at load, and the LoRA read off the model's LoRA layers.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

RUN_FILE = "jqlora_run.json"
RUN_FORMAT = "jqlora-run"
RUN_VERSION = 1


def write_run_record(out_dir: str | os.PathLike, record: dict) -> Path:
    """Write ``record`` atomically to ``<out_dir>/jqlora_run.json`` (the directory is created if
    missing); returns its path.

    Raises:
      OSError: the write failed; its filename is the record's path."""
    from interop.atomic_io import write_json_atomic  # noqa: PLC0415

    path = Path(out_dir) / RUN_FILE
    try:
        return write_json_atomic(path, record)
    except OSError as e:
        if e.filename is None and e.errno is not None:  # e.g. ENOSPC from a write(): say which file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def model_lora(model) -> Optional[dict]:
    """The record's ``lora`` table of a model's LoRA layers (rank, alpha, dropout, use_rslora
    and the module names as target suffixes), or None when it has none."""
    from flax import nnx  # noqa: PLC0415

    from jqlora.lora.linear import QLoRALinear  # noqa: PLC0415

    found = [(path, n) for path, n in nnx.iter_graph(model) if isinstance(n, QLoRALinear) and n.rank > 0]
    if not found:
        return None
    first = found[0][1]
    dropout = getattr(first.dropout, "rate", 0.0) if first.dropout is not None else 0.0
    targets = sorted({str(path[-1]) for path, _ in found})
    return {"rank": int(first.rank), "alpha": float(first.alpha), "dropout": float(dropout),
            "target_modules": targets, "use_rslora": bool(first.use_rslora)}


def api_record(model, config, model_path: Optional[str | os.PathLike] = None) -> dict:
    """The run record of ``train(model, config)`` called from Python (module docstring); every
    path in it absolute."""
    path = model_path if model_path is not None else getattr(model, "checkpoint_path", None)
    dtype = getattr(model, "compute_dtype", None)
    rec = {"format": RUN_FORMAT, "version": RUN_VERSION,
           "model": None if path is None else os.path.abspath(path),
           "compute_dtype": None if dtype is None else str(getattr(dtype, "name", dtype)),
           "backend": getattr(model, "backend", "auto")}
    if isinstance(getattr(model, "attention", None), str):
        rec["attention"] = model.attention
    if getattr(model, "checkpoint_quantize", None):
        rec["quantize"] = model.checkpoint_quantize
    if getattr(model, "checkpoint_quantize_experts", "auto") != "auto":
        rec["quantize_experts"] = model.checkpoint_quantize_experts
    rec["lora"] = model_lora(model)
    train = dataclasses.asdict(config)
    for key in ("data_path", "eval_data_path", "tokenizer_path", "chat_template"):
        if isinstance(train.get(key), str) and os.path.exists(train[key]):
            train[key] = os.path.abspath(train[key])
    train["out_dir"] = os.path.abspath(train["out_dir"])
    rec["train"] = {k: v for k, v in train.items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    return rec


def write_api_record(config, *, model, model_path=None) -> Path:
    """`train`'s default ``on_ready``: the record of this run, in ``config.out_dir``."""
    return write_run_record(config.out_dir, api_record(model, config, model_path))


__all__ = ["RUN_FILE", "RUN_FORMAT", "RUN_VERSION", "write_run_record", "api_record", "write_api_record", "model_lora"]
