"""Training: JSONL data, AdamW + warmup/cosine, LoRA-only train loop, atomic checkpoints."""
from .checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints,
                         restore_checkpoint, save_checkpoint)
from .data import (BatchIterator, DataError, Example, SpecialTokens, check_tokenizer_fits,
                   load_jsonl, load_tokenizer, make_batch_iterator, parse_example,
                   special_tokens, tokenize_example, tokenize_examples)
from .frozen_jit import frozen_jit
from .loop import (NonFiniteLossError, TrainConfig, TrainResult, evaluate, make_train_step,
                   masked_cross_entropy, train, train_step, write_loss_plot)
from .optim import make_optimizer, make_schedule

__all__ = [
    "BatchIterator", "CheckpointError", "DataError", "Example", "NonFiniteLossError",
    "SpecialTokens", "TrainConfig", "TrainResult", "check_tokenizer_fits", "evaluate", "frozen_jit",
    "latest_checkpoint", "list_checkpoints", "load_jsonl", "load_tokenizer",
    "make_batch_iterator", "make_optimizer", "make_schedule", "make_train_step",
    "masked_cross_entropy", "parse_example", "restore_checkpoint", "save_checkpoint",
    "special_tokens", "tokenize_example", "tokenize_examples", "train", "train_step",
    "write_loss_plot",
]
