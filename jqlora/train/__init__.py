"""Training: JSONL data, AdamW + warmup and a cosine/linear/constant schedule, LoRA-only train loop,
metrics (CSV, TensorBoard), atomic checkpoints.

The names below are the public API; the rest stays importable from its module
(:mod:`jqlora.train.examples`, :mod:`~jqlora.train.tokenization`, :mod:`~jqlora.train.data`,
:mod:`~jqlora.train.step`, :mod:`~jqlora.train.checkpoint`, ...).
"""
import importlib

from .config import TrainConfig

# name -> submodule; imported on first use (PEP 562), so `from jqlora.train import TrainConfig`
# (what `jqlora train --help` needs) does not load jax
_LAZY = {
    "CheckpointError": "checkpoint", "list_checkpoints": "checkpoint", "restore_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint", "BatchIterator": "data", "make_batch_iterator": "data",
    "DataError": "examples", "frozen_jit": "frozen", "NonFiniteLossError": "loop", "TrainResult": "loop",
    "train": "loop", "make_optimizer": "optim", "make_schedule": "optim", "schedule_table": "optim",
    "evaluate": "step", "train_step": "step", "load_tokenizer": "tokenization", "special_tokens": "tokenization",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "train", "TrainConfig", "TrainResult", "NonFiniteLossError", "train_step", "evaluate", "frozen_jit",
    "make_optimizer", "make_schedule", "schedule_table", "save_checkpoint", "restore_checkpoint",
    "list_checkpoints", "CheckpointError", "BatchIterator", "make_batch_iterator", "load_tokenizer", "special_tokens",
    "DataError",
]
