"""How long a run is: ``TrainConfig.epochs`` turned into optimizer steps, ``warmup_ratio`` into
warmup steps. Both are counted from the training data once it is tokenized and packed, so they
are resolved by :func:`jqlora.train.train`, which stores the resolved config in its checkpoints
(and hands it to ``on_ready``): a resumed run continues towards the same step.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loop import TrainConfig

__all__ = ["RunLength", "resolve_run_length"]


@dataclasses.dataclass(frozen=True)
class RunLength:
    """What the resolution found: the config with ``steps`` and ``warmup`` filled in, and where
    ``steps`` came from (``rows_per_epoch`` is None when ``epochs`` was not set)."""

    config: TrainConfig
    rows_per_epoch: int | None
    rows_per_step: int

    def describe(self) -> str | None:
        """The log line (``2 epochs = 14 steps (...)``) when the steps came from epochs, else None."""
        if self.rows_per_epoch is None:
            return None
        c = self.config
        return (f"{c.epochs:g} epochs = {c.steps} steps ({self.rows_per_epoch} rows of "
                f"{c.seq_len} tokens per epoch, {self.rows_per_step} rows per step)")


def resolve_run_length(config: TrainConfig, iterator) -> RunLength:
    """``config`` with ``steps = ceil(ceil(rows_per_epoch / rows_per_step) * epochs)`` when
    ``epochs`` is set (rows after packing; ``rows_per_step = batch_size * grad_accum``) and
    ``warmup = ceil(warmup_ratio * steps)`` when ``warmup_ratio`` is set (as Hugging Face's
    Trainer counts it). A ``steps`` that epochs replaces, other than the default, gets a warning.

    ``iterator``: the training :class:`~jqlora.train.data.BatchIterator`, or any iterator with
    ``batch_size`` and ``rows_per_epoch()`` (needed only with ``epochs``)."""
    rows_per_step = int(getattr(iterator, "batch_size", config.batch_size)) * int(config.grad_accum)
    rows_per_epoch = None
    steps = int(config.steps)
    if config.epochs is not None:
        if not hasattr(iterator, "rows_per_epoch"):
            raise ValueError("TrainConfig.epochs needs the number of rows in one pass over the data: "
                             "pass a data path, a list of examples or a BatchIterator (an iterator "
                             "without rows_per_epoch() needs TrainConfig.steps instead)")
        rows_per_epoch = int(iterator.rows_per_epoch())
        steps = max(_ceil(math.ceil(rows_per_epoch / rows_per_step) * float(config.epochs)), 1)
        _warn_replaced(config, "steps", steps, f"epochs={config.epochs:g}")
    warmup = int(config.warmup)
    if config.warmup_ratio is not None:
        warmup = _ceil(float(config.warmup_ratio) * steps)
        _warn_replaced(config, "warmup", warmup, f"warmup_ratio={config.warmup_ratio:g}")
    return RunLength(dataclasses.replace(config, steps=steps, warmup=warmup), rows_per_epoch,
                     rows_per_step)


def _ceil(x: float) -> int:
    """ceil, blind to float round-off (10 * 0.7 is 7.000000000000001, and 7 steps)."""
    return math.ceil(round(x, 9))


def _warn_replaced(config, name: str, value: int, by: str) -> None:
    """Warn when a field given other than its default is replaced by a derived value."""
    given, default = getattr(config, name), getattr(type(config)(), name)
    if given not in (default, value):
        warnings.warn(f"TrainConfig.{name}={given} is replaced by {value}, from {by}",
                      stacklevel=5)  # train()'s caller
