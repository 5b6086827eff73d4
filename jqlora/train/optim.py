"""Optimizer: AdamW + a learning-rate schedule (linear warmup, then cosine, linear or constant) +
global-norm clipping, all from optax; ``optimizer="adamw8bit"`` keeps the Adam moments in 8 bits
(:mod:`jqlora.train.adamw8bit`, bitsandbytes' ``AdamW8bit``).

Gradient accumulation is NOT done here with ``optax.MultiSteps``: the train step
(:mod:`jqlora.train.loop`) runs an explicit ``lax.scan`` over the ``grad_accum`` micro-batches,
summing the *unnormalized* masked cross-entropy and the loss-token count, and divides once at the
end. That makes ``k`` micro-batches give exactly the gradient of one big batch even when the
micro-batches hold different numbers of loss tokens (``MultiSteps`` averages per-micro-batch means,
which weights tokens unequally), keeps no extra gradient buffer in the optimizer state, and keeps one
optimizer step = one training step (schedule, logging and checkpoints count the same thing).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from .adamw8bit import scale_by_adam_8bit
from .config import LR_SCHEDULES, OPTIMIZERS

__all__ = ["LR_SCHEDULES", "OPTIMIZERS", "make_schedule", "make_optimizer", "schedule_table"]


def make_schedule(lr: float, warmup_steps: int, total_steps: int, *,
                  final_lr_ratio: float = 0.0, kind: str = "cosine") -> optax.Schedule:
    """Learning rate for optimizer count ``c`` (0-based; the update of training step ``c + 1``).

    Linear warmup ``lr * (c + 1) / warmup_steps`` for ``c < warmup_steps`` (the first update is not
    wasted at lr 0), then over the remaining ``total_steps - warmup_steps`` counts:

    * ``"cosine"``: cosine decay from ``lr`` to ``lr * final_lr_ratio``,
    * ``"linear"``: linear decay from ``lr`` to ``lr * final_lr_ratio``,
    * ``"constant"``: ``lr`` (``final_lr_ratio`` does not apply).

    The decays reach their end value at ``c = total_steps`` and stay there.
    """
    if kind not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; expected one of {', '.join(LR_SCHEDULES)}")
    warmup_steps = max(int(warmup_steps), 0)
    total_steps = max(int(total_steps), 1)
    decay_steps = max(total_steps - warmup_steps, 1)
    end = lr * final_lr_ratio
    if kind == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=final_lr_ratio)
    elif kind == "linear":
        after = optax.linear_schedule(lr, end, decay_steps)
    else:
        after = optax.constant_schedule(lr)
    if warmup_steps == 0:
        return after
    # lr/W at count 0 up to lr at count W - 1: linear_schedule over W - 1 transitions (a single
    # warmup step is lr itself)
    warmup = (optax.linear_schedule(lr / warmup_steps, lr, warmup_steps - 1) if warmup_steps > 1
              else optax.constant_schedule(lr))
    return optax.join_schedules([warmup, after], [warmup_steps])


def schedule_table(schedule: optax.Schedule, total_steps: int) -> np.ndarray:
    """``schedule(c)`` for every count ``c`` in ``[0, total_steps)`` as a host float32 array, computed
    in one call before training starts.

    The train loop logs each step's learning rate from this table. Calling the schedule per step
    would run it on the default device, queued behind the step in flight: reading it back would
    wait for that step, and the device would then idle while the host dispatches the next one."""
    counts = np.arange(max(int(total_steps), 1), dtype=np.int32)
    return np.asarray(jax.device_get(jax.jit(jax.vmap(schedule))(counts)), np.float32)


@functools.lru_cache(maxsize=32)
def make_optimizer(lr: float, warmup_steps: int, total_steps: int, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, grad_clip: float | None = 1.0, *,
                   eps: float = 1e-8, final_lr_ratio: float = 0.0, lr_schedule: str = "cosine",
                   optimizer: str = "adamw") -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (skipped when ``grad_clip`` is None or <= 0) followed by
    ``adamw`` with :func:`make_schedule` (``lr_schedule`` is its ``kind``). Weight decay applies to
    every trained (LoRA) parameter. The optimizer state has the same structure for every schedule.

    ``optimizer="adamw8bit"``: the same chain with :func:`~jqlora.train.adamw8bit.scale_by_adam_8bit`
    in place of ``scale_by_adam`` (the composition ``optax.adamw`` is made of), so the moments of
    leaves of 4096 elements or more are stored in 8 bits. Its state differs from AdamW's: a run
    keeps one optimizer from start to end.

    Memoized: equal arguments return the same (stateless) transformation object, so that
    ``nnx.Optimizer``s built from equal configs share one compiled train step."""
    schedule = make_schedule(lr, warmup_steps, total_steps, final_lr_ratio=final_lr_ratio,
                             kind=lr_schedule)
    parts = []
    if grad_clip is not None and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(grad_clip)))
    if optimizer == "adamw":
        parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    elif optimizer == "adamw8bit":
        parts.append(optax.chain(scale_by_adam_8bit(b1=b1, b2=b2, eps=eps),
                                 optax.add_decayed_weights(weight_decay),
                                 optax.scale_by_learning_rate(schedule)))
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    return optax.chain(*parts)
