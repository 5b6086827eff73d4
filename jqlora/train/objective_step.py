"""The compiled step of the objectives besides SFT (DPO, GRPO): one optimizer update of the LoRA
params from a loss that an objective defines per micro-batch.

As in :mod:`jqlora.train.step`, the model is split into (LoRA params | RNG state | the rest),
``jax.value_and_grad`` differentiates the LoRA part only, a ``lax.scan`` sums the micro-batches'
losses, gradients and metrics, and a step that is not finite keeps the previous params and
optimizer state (``ok`` False). The objective's ``micro(model, reference, batch)`` returns its
micro-batch's share of the step's loss (already divided by the step's normaliser, so the shares
add up to the loss) and a dict of float32 sums to log; ``reference()`` builds the same model
with LoRA off (:func:`jqlora.lora.reference.reference_view`), whose outputs it must wrap in
``jax.lax.stop_gradient``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..lora.reference import reference_view
from .frozen import frozen_jit

__all__ = ["make_update_step", "make_eval_fn"]


def _global_norm(tree):
    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


def _update_impl(model, optimizer, batches, *, micro_fn):
    graphdef, lora, rngs, rest = nnx.split(model, nnx.LoRAParam, nnx.RngState, ...)
    old_lora = nnx.as_pure(lora)
    old_opt = nnx.as_pure(nnx.state(optimizer))

    def micro(lora_, rngs_, mb):
        m = nnx.merge(graphdef, lora_, rngs_, rest, copy=True)
        loss, sums = micro_fn(m, lambda: reference_view(graphdef, lora_, rngs_, rest), mb)
        return loss, (sums, nnx.state(m, nnx.RngState))

    grad_fn = jax.value_and_grad(micro, has_aux=True)  # w.r.t. the LoRA state only

    def body(carry, mb):
        gsum, lsum, msum, rngs_ = carry
        (loss, (sums, rngs_)), g = grad_fn(lora, rngs_, mb)
        gsum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), gsum, g)
        msum = jax.tree.map(jnp.add, msum, sums)
        return (gsum, lsum + loss, msum, rngs_), None

    first = jax.tree.map(lambda a: a[0], batches)
    sums_shape = jax.eval_shape(lambda mb: micro(lora, rngs, mb)[1][0], first)
    zero = jnp.zeros((), jnp.float32)
    init = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), lora), zero,
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape), rngs)
    (gsum, loss, sums, rngs), _ = jax.lax.scan(body, init, batches)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), gsum, lora)
    grad_norm = _global_norm(grads)

    nnx.update(model, rngs)
    optimizer.update(model, grads)
    new_lora = nnx.as_pure(nnx.state(model, nnx.LoRAParam))
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    for leaf in jax.tree.leaves(new_lora):
        ok &= jnp.all(jnp.isfinite(leaf))
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    nnx.update(model, jax.tree.map(keep, new_lora, old_lora))
    nnx.update(optimizer, jax.tree.map(keep, nnx.as_pure(nnx.state(optimizer)), old_opt))
    return {"loss": loss, "grad_norm": grad_norm, "ok": ok, **sums}


def make_update_step(micro_fn):
    """``step(model, optimizer, batches) -> metrics`` (compiled with :func:`frozen_jit`, LoRA
    params and optimizer state donated), for an objective's ``micro_fn`` (see the module
    docstring). ``batches``: a tree of arrays with a leading micro-batch axis."""
    def objective_step(model, optimizer, batches):
        return _update_impl(model, optimizer, batches, micro_fn=micro_fn)

    return frozen_jit(objective_step, nodes=2, donate=True)


def _eval_impl(model, batch, *, fn):
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    return fn(model, lambda: reference_view(graphdef, lora, rest), batch)


def make_eval_fn(fn):
    """``f(model, batch) -> fn(model, reference, batch)`` compiled with :func:`frozen_jit`, no
    gradient, nothing updated: reference log-probabilities, evaluation."""
    def objective_eval(model, batch):
        return _eval_impl(model, batch, fn=fn)

    return frozen_jit(objective_eval)
