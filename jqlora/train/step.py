"""The device side of training: masked / chunked cross-entropy, the compiled train step, evaluation.

One training step = ``grad_accum`` micro-batches of ``batch_size`` rows, one optimizer update.
Inside one compiled step (:func:`frozen_jit`) the model is split into (LoRA params | RNG state |
everything else); ``jax.value_and_grad`` differentiates only the LoRA part (frozen weights get no
gradient and no optimizer state), and a ``lax.scan`` over the micro-batches sums the masked fp32
cross-entropy, the loss-token count and the gradients; the sums are divided by the token count
once, so the result equals one big batch (see :mod:`jqlora.train.optim`).

Mixture-of-experts models may add the router's load-balancing loss (`train_step_aux`, with its
coefficient): per micro-batch, transformers' ``load_balancing_loss_func`` over every MoE layer's
router logits, padding left out; the step's loss is the mean cross-entropy over the loss tokens
plus ``coef`` times the mean of the micro-batches' aux losses (with one micro-batch, transformers'
``outputs.loss`` with ``output_router_logits=True``).

NaN/Inf guard: the step computes ``ok = isfinite(loss) & isfinite(grad_norm) & all new LoRA params
finite`` and, when not ok, keeps the previous params and optimizer state (selected inside the
jit). The host loop (:mod:`jqlora.train.loop`) turns ``ok == False`` into an error.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .frozen import frozen_jit

__all__ = ["LOSS_CHUNK", "masked_cross_entropy", "chunked_cross_entropy", "train_step", "train_step_aux",
           "router_aux_loss", "evaluate"]

# Tokens per chunk of the LM head + cross-entropy: at the 8B shape a larger chunk needs more XLA
# temp memory and a smaller one saves none (evidence: benchmarks/results/JOURNAL.md).
LOSS_CHUNK = 256


def masked_cross_entropy(logits, targets, mask):
    """-> (sum of per-token CE over mask, number of mask tokens); computed in float32."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def _global_norm(tree):
    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


def chunked_cross_entropy(lm_logits, h, targets, mask, chunk: int = LOSS_CHUNK):
    """masked_cross_entropy(lm_logits(h), ...) without ever holding all (B, T, vocab) logits.

    The sequence is cut into chunks (the last one padded with masked tokens) and a `lax.scan`
    applies the LM head + loss to one chunk at a time; each chunk's logits are recomputed in the
    backward pass (jax.checkpoint). The scan makes "one chunk alive" a guarantee rather than a
    scheduling accident: with independent per-chunk calls XLA may overlap several chunks. For a
    128k vocabulary at 2048 tokens the full float32 logits alone would be 1 GB."""
    b, t = targets.shape
    if t <= chunk:
        return masked_cross_entropy(lm_logits(h), targets, mask)
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))  # padded tokens carry no loss
    chunks = lambda a: jnp.swapaxes(a.reshape(b, n, chunk, *a.shape[2:]), 0, 1)  # noqa: E731

    @jax.checkpoint
    def part(hc, tc, mc):
        return masked_cross_entropy(lm_logits(hc), tc, mc)

    def body(carry, xs):
        s_, n_ = part(*xs)
        return (carry[0] + s_, carry[1] + n_), None

    zero = jnp.zeros((), jnp.float32)
    (total, count), _ = jax.lax.scan(body, (zero, zero), (chunks(h), chunks(targets), chunks(mask)))
    return total, count


def router_aux_loss(model, router_logits, batch):
    """transformers' load-balancing loss of one forward (`jqlora.models.moe.load_balancing_loss`):
    over the router logits of every MoE layer, the tokens that transformers' attention_mask would
    keep (not padding: ``segment_ids > 0``, or the batch's ``attention_mask`` where the unpacked
    rows dropped their segment ids); prompt tokens count too, as they are routed."""
    from jqlora.models.moe import load_balancing_loss  # noqa: PLC0415

    if "segment_ids" in batch:
        mask = batch["segment_ids"] > 0
    else:
        mask = batch.get("attention_mask")
    cfg = model.config
    return load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, mask)


def _forward_sums(model, batch, loss_chunk: int = LOSS_CHUNK, router_aux: bool = False):
    """(sum of the masked CE, loss tokens), and with `router_aux` the forward's load-balancing loss."""
    # A batch without segment_ids (unpacked, right-padded rows: see loop.train) runs plain causal
    # attention, with no (T, T) mask.
    kw = dict(positions=batch["positions"], segment_ids=batch.get("segment_ids"))
    if hasattr(model, "lm_logits"):  # jqlora CausalLM: chunked LM head + loss
        if "segment_lengths" in batch:  # packed rows for cuDNN's packed layout (see loop.train)
            kw["segment_runs"] = (batch["segment_lengths"], batch["segment_offsets"])
        if router_aux:
            h, router = model(batch["input_ids"], return_hidden=True, return_router_logits=True, **kw)
            s, n = chunked_cross_entropy(model.lm_logits, h, batch["targets"], batch["loss_mask"], loss_chunk)
            return s, n, router_aux_loss(model, router, batch)
        h = model(batch["input_ids"], return_hidden=True, **kw)
        return chunked_cross_entropy(model.lm_logits, h, batch["targets"], batch["loss_mask"], loss_chunk)
    if router_aux:
        raise ValueError("the router's load-balancing loss needs a jqlora CausalLM")
    logits = model(batch["input_ids"], **kw)
    return masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])


def _train_step_impl(model, optimizer, batches, aux_coef=None, *, loss_chunk: int = LOSS_CHUNK):
    """The step :data:`train_step` (``aux_coef`` None) and :data:`train_step_aux` compile, as a
    plain function of NNX objects (uncompiled)."""
    graphdef, lora, rngs, rest = nnx.split(model, nnx.LoRAParam, nnx.RngState, ...)
    old_lora = nnx.as_pure(lora)
    old_opt = nnx.as_pure(nnx.state(optimizer))
    zero = jnp.zeros((), jnp.float32)
    if aux_coef is not None:
        # the sums below are divided by the loss tokens at the end: each micro-batch's aux term is
        # scaled by them here, so that coef * (mean aux over the micro-batches) comes out
        aux_scale = (jnp.asarray(aux_coef, jnp.float32) * jnp.maximum(jnp.sum(batches["loss_mask"]), 1.0)
                     / batches["input_ids"].shape[0])

    def micro(lora_, rngs_, mb):
        # copy=True: fresh Variables at this trace level (dropout mutates the RNG counts)
        m = nnx.merge(graphdef, lora_, rngs_, rest, copy=True)
        if aux_coef is None:
            s, n = _forward_sums(m, mb, loss_chunk)
            return s, (n, zero, nnx.state(m, nnx.RngState))
        s, n, aux = _forward_sums(m, mb, loss_chunk, router_aux=True)
        return s + aux_scale * aux, (n, aux, nnx.state(m, nnx.RngState))

    grad_fn = jax.value_and_grad(micro, has_aux=True)  # w.r.t. the LoRA state only

    def body(carry, mb):
        gsum, lsum, nsum, asum, rngs_ = carry
        (s, (n, aux, rngs_)), g = grad_fn(lora, rngs_, mb)
        gsum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), gsum, g)
        return (gsum, lsum + s, nsum + n, asum + aux, rngs_), None

    # gradients are accumulated in float32 whatever the LoRA dtype, then cast back
    init = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), lora), zero, zero, zero, rngs)
    (gsum, lsum, nsum, asum, rngs), _ = jax.lax.scan(body, init, batches)
    denom = jnp.maximum(nsum, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), gsum, lora)
    loss = lsum / denom
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
    out = {"loss": loss, "grad_norm": grad_norm, "ntokens": nsum, "ok": ok}
    if aux_coef is not None:
        out["aux_loss"] = asum / batches["input_ids"].shape[0]
    return out


# frozen_jit, not nnx.jit: the frozen weights stay inputs only (nnx.jit would copy the whole model
# into its outputs every step); the LoRA params and optimizer state are donated and updated in place.
@functools.partial(frozen_jit, nodes=2, donate=True)
def train_step(model, optimizer, batches):
    """One optimizer step over ``grad_accum`` micro-batches, compiled with :func:`frozen_jit`.

    Updates the model (LoRA params, RNG state) and the optimizer in place, unless the step is not
    ``ok``, in which case both keep their previous values. Compiled once per model structure,
    optimizer and shape (:func:`~jqlora.train.optim.make_optimizer` is memoized, so equal configs
    share the compiled step). ``train_step.bind(model, optimizer)`` gives a callable of
    ``batches`` alone that skips the per-call graph traversal (what :func:`~jqlora.train.train`
    runs).

    The LoRA params and optimizer state are donated: arrays of them taken out of the model before
    a step are invalid after it (copy them first, e.g.
    ``jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))``).

    Args:
      model: an NNX model with ``nnx.LoRAParam`` variables (e.g. a ``jqlora.models.CausalLM``).
      optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``.
      batches: dict of arrays shaped ``(grad_accum, batch, seq_len)``: ``input_ids``,
        ``targets``, ``loss_mask``, ``positions`` and optionally ``segment_ids`` (see
        :mod:`jqlora.train.data`).

    Returns:
      dict of device scalars: ``loss`` (mean CE over loss tokens), ``grad_norm`` (before
      clipping), ``ntokens`` (loss tokens) and ``ok`` (loss, gradient norm and new params finite).
    """
    return _train_step_impl(model, optimizer, batches)


@functools.partial(frozen_jit, nodes=2, donate=True)
def train_step_aux(model, optimizer, batches, aux_coef):
    """:data:`train_step` with the router's load-balancing loss of a mixture-of-experts model
    added, times ``aux_coef`` (a float32 scalar; the module docstring says how micro-batches
    combine). ``loss`` is then the cross-entropy plus ``aux_coef`` times ``aux_loss``, the mean
    of the micro-batches' load-balancing losses, which the result also holds."""
    return _train_step_impl(model, optimizer, batches, aux_coef)


def _eval_step_impl(model, batch):
    return _forward_sums(model, batch)


_eval_step = frozen_jit(_eval_step_impl)


def evaluate(model, batches, *, max_batches: int | None = None) -> float:
    """Mean masked cross-entropy over ``batches`` with the model in eval mode (dropout off).

    Args:
      model: the model to evaluate; it is put back in train mode afterwards.
      batches: an iterable of batch dicts shaped ``(batch, seq_len)`` (e.g.
        ``BatchIterator.eval_batches()``).
      max_batches: stop after this many batches (None: all of them).

    Returns:
      The loss summed over all loss tokens divided by their number (NaN when there are none).
    """
    model.eval()
    try:
        step = _eval_step.bind(model)  # bound after eval(): the graph split once, not per batch
        total, ntok = 0.0, 0.0
        for i, b in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            s, n = step({k: jnp.asarray(v) for k, v in b.items()})
            total += float(s)
            ntok += float(n)
    finally:
        model.train()
    return total / ntok if ntok else float("nan")
