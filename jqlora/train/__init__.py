"""Training: JSONL data, AdamW + warmup and a cosine/linear/constant schedule, LoRA-only train loop,
metrics (CSV, TensorBoard), atomic checkpoints.

The names below are the public API; the rest stays importable from its module
(:mod:`jqlora.train.examples`, :mod:`~jqlora.train.tokenization`, :mod:`~jqlora.train.data`,
:mod:`~jqlora.train.step`, :mod:`~jqlora.train.checkpoint`, ...).
"""
from .checkpoint import CheckpointError, list_checkpoints, restore_checkpoint, save_checkpoint
from .data import BatchIterator, make_batch_iterator
from .examples import DataError
from .frozen_jit import frozen_jit
from .loop import NonFiniteLossError, TrainConfig, TrainResult, train
from .optim import make_optimizer, make_schedule
from .step import evaluate, train_step
from .tokenization import load_tokenizer, special_tokens

__all__ = [
    "train", "TrainConfig", "TrainResult", "NonFiniteLossError", "train_step", "evaluate", "frozen_jit",
    "make_optimizer", "make_schedule", "save_checkpoint", "restore_checkpoint", "list_checkpoints",
    "CheckpointError", "BatchIterator", "make_batch_iterator", "load_tokenizer", "special_tokens",
    "DataError",
]
