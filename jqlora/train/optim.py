"""Optimizer: AdamW + linear warmup + cosine decay + global-norm clipping (optax).

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
import math

import jax.numpy as jnp
import optax

__all__ = ["make_schedule", "make_optimizer"]


def make_schedule(lr: float, warmup_steps: int, total_steps: int, *,
                  final_lr_ratio: float = 0.0) -> optax.Schedule:
    """Learning rate for optimizer count ``c`` (0-based; the update of training step ``c + 1``).

    Linear warmup ``lr * (c + 1) / warmup_steps`` for ``c < warmup_steps`` (the first update is not
    wasted at lr 0), then cosine decay from ``lr`` to ``lr * final_lr_ratio`` over the remaining
    ``total_steps - warmup_steps`` steps.
    """
    warmup_steps = max(int(warmup_steps), 0)
    total_steps = max(int(total_steps), 1)
    decay_steps = max(total_steps - warmup_steps, 1)
    end = lr * final_lr_ratio

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        warm = lr * (c + 1.0) / max(warmup_steps, 1)
        progress = jnp.clip((c - warmup_steps) / decay_steps, 0.0, 1.0)
        cos = end + (lr - end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(c < warmup_steps, warm, cos)

    return schedule


@functools.lru_cache(maxsize=32)
def make_optimizer(lr: float, warmup_steps: int, total_steps: int, weight_decay: float = 0.0,
                   b1: float = 0.9, b2: float = 0.999, grad_clip: float | None = 1.0, *,
                   eps: float = 1e-8, final_lr_ratio: float = 0.0
                   ) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (skipped when ``grad_clip`` is None or <= 0) followed by
    ``adamw`` with :func:`make_schedule`. Weight decay applies to every trained (LoRA) parameter.

    Memoized: equal arguments return the same (stateless) transformation object, so that
    ``nnx.Optimizer``s built from equal configs share one compiled train step."""
    schedule = make_schedule(lr, warmup_steps, total_steps, final_lr_ratio=final_lr_ratio)
    parts = []
    if grad_clip is not None and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(grad_clip)))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)
