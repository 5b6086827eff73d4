"""The training loop: LoRA-only gradients, grad accumulation, NaN guard, logging, checkpoints.

One training step = ``grad_accum`` micro-batches of ``batch_size`` rows, one optimizer update.
Inside one compiled step (:func:`frozen_jit`) the model is split into (LoRA params | RNG state | everything
else); ``jax.value_and_grad`` differentiates only the LoRA part (frozen weights get no gradient and
no optimizer state), and a ``lax.scan`` over the micro-batches sums the masked fp32 cross-entropy,
the loss-token count and the gradients; the sums are divided by the token count once, so the
result equals one big batch (see :mod:`jqlora.train.optim`).

NaN/Inf guard: the step computes ``ok = isfinite(loss) & isfinite(grad_norm) & all new LoRA params
finite`` and, when not ok, keeps the previous params and optimizer state (selected inside the jit).
The host then raises :class:`NonFiniteLossError` naming the step; no checkpoint is written, so the
last good one stays as it was.

Outputs in ``out_dir``: ``loss.csv`` (step, loss, lr, tokens_per_s: one row per logged step),
``loss.png``, ``eval.csv`` (when evaluating) and ``checkpoints/step_XXXXXXXX``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint
from .frozen_jit import frozen_jit
from .logs import CSV_NAME, EVAL_CSV_NAME, PNG_NAME, CsvLog, write_loss_plot
from .data import (BatchIterator, Example, SegmentTables, check_tokenizer_fits, load_jsonl,
                   load_tokenizer, parse_example, special_tokens, tokenize_examples)
from .optim import make_optimizer, make_schedule

__all__ = ["TrainConfig", "TrainResult", "NonFiniteLossError", "train", "make_train_step", "write_loss_plot",
           "evaluate", "masked_cross_entropy"]

CKPT_DIR = "checkpoints"


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm went NaN/Inf. ``step`` is the 1-based step that failed."""

    def __init__(self, step: int, loss: float, grad_norm: float, checkpoint: Path | None):
        self.step, self.loss, self.grad_norm, self.checkpoint = step, loss, grad_norm, checkpoint
        where = (f"last good checkpoint: {checkpoint}" if checkpoint is not None
                 else "no checkpoint was written yet")
        super().__init__(
            f"non-finite training state at step {step} (loss={loss}, grad_norm={grad_norm}); the "
            f"update was not applied and no checkpoint was written for this step; {where}. "
            f"Lower the learning rate, check the data, or enable/lower grad_clip.")


@dataclasses.dataclass
class TrainConfig:
    data_path: str | None = None
    tokenizer_path: str | None = None
    seq_len: int = 512
    batch_size: int = 8          # rows per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    lr: float = 2e-4
    warmup: int = 0              # warmup steps
    steps: int = 1000            # total optimizer steps (also the length of the LR schedule)
    seed: int = 0                # data shuffle seed
    out_dir: str = "runs/jqlora"
    save_every: int = 100        # checkpoint every N steps (0: only at the end); always at the end
    log_every: int = 10          # CSV row every N steps (and at the last step)
    remat: bool | str = False    # per-layer rematerialization in the model (see train())
    packing: bool = True         # several examples per row; False: one per row, no segment mask
    eval_every: int | None = None
    eval_data_path: str | None = None
    eval_max_batches: int | None = None
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float | None = 1.0
    final_lr_ratio: float = 0.0
    bos: Any = "auto"            # see data.special_tokens
    eos: Any = "auto"
    overflow: str = "truncate"   # long examples: "truncate" or "split"
    shuffle: bool = True
    keep_checkpoints: int | None = 2
    progress: bool | None = None  # tqdm bar; None: only when stderr is a TTY
    resume: bool = False

    def validate(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.warmup < 0:
            raise ValueError("TrainConfig.save_every and warmup must be >= 0")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError("TrainConfig.eval_every must be >= 1 or None")


@dataclasses.dataclass
class TrainResult:
    step: int                                  # last completed step
    steps: list[int]                           # steps run in this call
    losses: list[float]                        # their losses (mean over loss tokens)
    lrs: list[float]
    grad_norms: list[float]
    tokens_per_s: list[float]                  # per step (first one includes compilation)
    eval_losses: list[tuple[int, float]]
    checkpoint: Path | None                    # newest checkpoint on disk
    resumed_from: int | None
    out_dir: Path
    csv_path: Path
    png_path: Path | None
    stopped_early: bool = False


# ----------------------------------------------------------------------------------------------
# the compiled step
# ----------------------------------------------------------------------------------------------

def masked_cross_entropy(logits, targets, mask):
    """-> (sum of per-token CE over mask, number of mask tokens); computed in float32."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def _global_norm(tree):
    tree_norm = getattr(getattr(optax, "tree", None), "norm", None)
    return tree_norm(tree) if tree_norm is not None else optax.global_norm(tree)


# tokens per chunk of the LM head + cross-entropy. XLA's plan on an H200 at the 8B shape cut to 4
# layers: 256 needs 1.7 GiB less temp memory than 512, and 128 no less than 256.
LOSS_CHUNK = 256


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


def _forward_sums(model, batch, loss_chunk: int = LOSS_CHUNK):
    # A batch without segment_ids (unpacked, right-padded rows: see train()) runs plain causal
    # attention, with no (T, T) mask.
    kw = dict(positions=batch["positions"], segment_ids=batch.get("segment_ids"))
    if hasattr(model, "lm_logits"):  # jqlora CausalLM: chunked LM head + loss
        if "segment_lengths" in batch:  # packed rows for cuDNN's packed layout (see train())
            kw["segment_runs"] = (batch["segment_lengths"], batch["segment_offsets"])
        h = model(batch["input_ids"], return_hidden=True, **kw)
        return chunked_cross_entropy(model.lm_logits, h, batch["targets"], batch["loss_mask"], loss_chunk)
    logits = model(batch["input_ids"], **kw)
    return masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])


def _train_step_impl(model, optimizer, batches, *, loss_chunk: int = LOSS_CHUNK):
    graphdef, lora, rngs, rest = nnx.split(model, nnx.LoRAParam, nnx.RngState, ...)
    old_lora = nnx.as_pure(lora)
    old_opt = nnx.as_pure(nnx.state(optimizer))

    def micro(lora_, rngs_, mb):
        # copy=True: fresh Variables at this trace level (dropout mutates the RNG counts)
        m = nnx.merge(graphdef, lora_, rngs_, rest, copy=True)
        s, n = _forward_sums(m, mb, loss_chunk)
        return s, (n, nnx.state(m, nnx.RngState))

    grad_fn = jax.value_and_grad(micro, has_aux=True)  # w.r.t. the LoRA state only

    def body(carry, mb):
        gsum, lsum, nsum, rngs_ = carry
        (s, (n, rngs_)), g = grad_fn(lora, rngs_, mb)
        gsum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), gsum, g)
        return (gsum, lsum + s, nsum + n, rngs_), None

    zero = jnp.zeros((), jnp.float32)
    # gradients are accumulated in float32 whatever the LoRA dtype, then cast back
    init = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), lora), zero, zero, rngs)
    (gsum, lsum, nsum, rngs), _ = jax.lax.scan(body, init, batches)
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
    return {"loss": loss, "grad_norm": grad_norm, "ntokens": nsum, "ok": ok}


# frozen_jit, not nnx.jit: the frozen weights stay inputs only (nnx.jit would copy the whole model
# into its outputs every step); the LoRA params and optimizer state are donated and updated in place.
train_step = frozen_jit(_train_step_impl, nodes=2, donate=True)
train_step.__doc__ = """``train_step(model, optimizer, batches) -> metrics`` (compiled with `frozen_jit`).

``batches``: dict of arrays shaped ``(grad_accum, batch, seq_len)``. Returns device scalars
``loss`` (mean CE over loss tokens), ``grad_norm`` (before clipping), ``ntokens`` (loss tokens),
``ok``. Updates the model (LoRA params, RNG state) and the optimizer in place, unless not ok, in
which case both keep their previous values. Compiled once per model structure/optimizer/shape
(``make_optimizer`` is memoized so equal configs share the compiled step). The LoRA params and
optimizer state are donated: arrays of them taken out of the model before a step are invalid after
it (copy them first, e.g. ``jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))``)."""


def make_train_step():
    """The compiled train step (kept for API symmetry; see :data:`train_step`)."""
    return train_step


def _eval_step_impl(model, batch):
    return _forward_sums(model, batch)


_eval_step = frozen_jit(_eval_step_impl)


def evaluate(model, batches, *, max_batches: int | None = None) -> float:
    """Mean masked cross-entropy over ``batches`` with the model in eval mode (dropout off)."""
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


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _model_vocab_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    if isinstance(cfg, dict):
        return cfg.get("vocab_size")
    return getattr(cfg, "vocab_size", None)


def _as_examples(data: Sequence) -> list[Example]:
    out = []
    for i, ex in enumerate(data, start=1):
        out.append(ex if isinstance(ex, Example)
                   else parse_example(ex, source="<data argument>", line=i))
    return out


def _build_iterator(config: TrainConfig, data, tokenizer, model, *, eval_: bool = False):
    """data: None (use the config's path), a path, a sequence of examples (dicts or Example),
    or an iterator with ``__next__``/``state_dict``/``load_state_dict`` (used as is)."""
    if data is not None and hasattr(data, "__next__") and hasattr(data, "state_dict"):
        return data
    path = config.eval_data_path if eval_ else config.data_path
    if data is None:
        data = path
    if data is None:
        if eval_:
            return None
        raise ValueError("no training data: pass data=... or set TrainConfig.data_path")
    if tokenizer is None:
        if config.tokenizer_path is None:
            raise ValueError("no tokenizer: pass tokenizer=... or set TrainConfig.tokenizer_path")
        tokenizer = load_tokenizer(config.tokenizer_path)
    vocab = _model_vocab_size(model)
    if vocab is not None:
        check_tokenizer_fits(tokenizer, vocab)
    special = special_tokens(tokenizer, bos=config.bos, eos=config.eos,
                             tokenizer_path=config.tokenizer_path)
    if isinstance(data, (str, os.PathLike)):
        examples = load_jsonl(data)
    else:
        examples = _as_examples(data)
    tokenized = tokenize_examples(tokenizer, examples, special)
    return BatchIterator(tokenized, seq_len=config.seq_len, batch_size=config.batch_size,
                         packing=config.packing, seed=config.seed,
                         shuffle=config.shuffle and not eval_, pad_id=special.pad_id,
                         overflow=config.overflow)


def _apply_remat(model, remat) -> None:
    """Turn on per-layer rematerialization in the model. ``remat``: False, True or a policy name
    understood by the model. Tries, in order: ``model.set_remat(remat)``, a ``model.remat``
    attribute (``jqlora.models.CausalLM`` reads it at call time), a mutable ``model.config.remat``.
    A model with none of these gets a warning and trains without remat."""
    if not remat:
        return
    if hasattr(model, "set_remat"):
        model.set_remat(remat)
        return
    if hasattr(model, "remat"):
        if not model.remat or remat is not True:  # keep a policy the model already has
            model.remat = remat
        return
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "remat"):
        try:
            setattr(cfg, "remat", remat)
            return
        except (AttributeError, dataclasses.FrozenInstanceError):
            pass
    warnings.warn("remat requested but the model has no set_remat() method, remat attribute or "
                  "mutable config.remat field: training without rematerialization", stacklevel=3)


def _commit(obj) -> None:
    """Commit every array of ``obj``'s state to its current sharding (no copy). The train step's
    outputs are committed; without this the first step sees uncommitted inputs and the second
    step compiles again."""
    def c(x):
        return jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x
    nnx.update(obj, jax.tree.map(c, nnx.as_pure(nnx.state(obj))))


def _stack(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


# ----------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------

def train(model, config: TrainConfig, *, data=None, tokenizer=None, eval_data=None,
          on_step: Callable[[int, dict], Any] | None = None,
          resume: bool | None = None) -> TrainResult:
    """Train the model's ``nnx.LoRAParam`` variables in place; everything else stays frozen.

    ``data``/``eval_data``: None (use ``config.data_path``/``eval_data_path``), a JSONL path, a
    list of example dicts, or a :class:`BatchIterator`-like object (``__next__``, ``state_dict``,
    ``load_state_dict``; its own batch size is used). ``tokenizer``: a ``tokenizers.Tokenizer``
    (default: loaded from ``config.tokenizer_path``).

    ``on_step(step, metrics)`` runs after each step (after logging and checkpointing); returning
    ``False`` stops training (a checkpoint is written for that step). An exception raised by it
    propagates (the run can be resumed from the last checkpoint).

    Steps overlap with the host: without ``on_step``, step N's metrics are read (and logged) after
    step N + 1 is dispatched, except at checkpoints, evals and the last step, where the host waits
    for the step before going on. So when a NaN/Inf stops training at step N, the next step may
    already have updated the in-memory model; checkpoints never contain it. With ``on_step`` every
    step is finished before the next is dispatched, so the callback sees that step's model.

    ``resume`` (default ``config.resume``): continue from the newest checkpoint in
    ``out_dir/checkpoints`` (fresh start if there is none). Without it, an ``out_dir`` that already
    holds checkpoints is refused (FileExistsError) rather than overwritten.

    ``config.remat`` (True or a policy name): handed to the model (``set_remat()``, its ``remat``
    attribute, or ``config.remat``); a model with none of these gets a warning.

    Raises :class:`NonFiniteLossError` on NaN/Inf (the last good checkpoint is kept).
    """
    config.validate()
    resume = config.resume if resume is None else resume
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / CKPT_DIR

    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise ValueError("the model has no nnx.LoRAParam variables: nothing to train")

    it = _build_iterator(config, data, tokenizer, model)
    eval_it = _build_iterator(config, eval_data, tokenizer, model, eval_=True)
    if config.eval_every and eval_it is None:
        raise ValueError("TrainConfig.eval_every is set but there is no eval data: pass "
                         "eval_data=... or set TrainConfig.eval_data_path")

    schedule = make_schedule(config.lr, config.warmup, config.steps,
                             final_lr_ratio=config.final_lr_ratio)
    tx = make_optimizer(config.lr, config.warmup, config.steps, config.weight_decay, config.b1,
                        config.b2, config.grad_clip, final_lr_ratio=config.final_lr_ratio)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    start, resumed_from, last_ckpt = 0, None, latest_checkpoint(ckpt_dir)
    if last_ckpt is not None:
        if not resume:
            raise FileExistsError(
                f"{ckpt_dir} already holds checkpoints (latest {last_ckpt.name}); pass "
                f"resume=True to continue that run or choose another out_dir")
        data_state, start = restore_checkpoint(last_ckpt, model, optimizer)
        if data_state is not None:
            it.load_state_dict(data_state)
        resumed_from = start

    _apply_remat(model, config.remat)
    _commit(model)
    _commit(optimizer)
    model.train()
    # bound once: the per-step split/update of the whole model graph is host time the device
    # would wait for whenever the host has nothing queued (at checkpoints, evals, with on_step)
    step_fn = train_step.bind(model, optimizer)

    log = CsvLog(out_dir / CSV_NAME, ["step", "loss", "lr", "tokens_per_s"],
                  keep_upto=start if resumed_from is not None else None)
    eval_log = (CsvLog(out_dir / EVAL_CSV_NAME, ["step", "eval_loss"],
                        keep_upto=start if resumed_from is not None else None)
                if eval_it is not None else None)
    result = TrainResult(step=start, steps=[], losses=[], lrs=[], grad_norms=[],
                         tokens_per_s=[], eval_losses=[], checkpoint=last_ckpt,
                         resumed_from=resumed_from, out_dir=out_dir, csv_path=out_dir / CSV_NAME,
                         png_path=None)
    show = config.progress if config.progress is not None else sys.stderr.isatty()
    from tqdm import tqdm
    bar = tqdm(total=config.steps, initial=start, disable=not show, desc="train",
               dynamic_ncols=True, file=sys.stderr)

    segment_tables = SegmentTables()

    def next_batch():
        """(batch, number of real tokens in it)."""
        batch = _stack([next(it) for _ in range(config.grad_accum)])
        ntok = int(np.count_nonzero(batch["segment_ids"]))
        if not config.packing:
            # One example per row from position 0, padding after it: under plain causal
            # attention no real token sees a padding key, so the segment mask changes nothing
            # for the loss, and without it cuDNN runs its mask-free causal kernels.
            del batch["segment_ids"]
        elif getattr(model, "attention", None) == "cudnn":
            segment_tables.add(batch)
        return batch, ntok

    def save(step, data_state):
        result.checkpoint = save_checkpoint(ckpt_dir, model, optimizer, data_state, step,
                                            keep=config.keep_checkpoints,
                                            extra={"train_config": dataclasses.asdict(config)})

    def saves_at(step) -> bool:
        return bool(config.save_every and step % config.save_every == 0) or step == config.steps

    def evaluates_at(step) -> bool:
        return bool(eval_it is not None and config.eval_every
                    and (step % config.eval_every == 0 or step == config.steps))

    def must_finish_now(step) -> bool:
        """A step whose end state the host must see before the next dispatch: a checkpoint, an
        eval, or every step when ``on_step`` may stop the run or inspect the model."""
        return on_step is not None or saves_at(step) or evaluates_at(step)

    t_prev = window_t0 = 0.0
    window_tokens = 0

    def finish(step, metrics, ntok_in, step_state) -> bool:
        """Read a dispatched step's metrics, then log, evaluate, checkpoint and call on_step.
        False: on_step asked to stop."""
        nonlocal t_prev, window_tokens, window_t0
        m = {k: v.item() for k, v in jax.device_get(metrics).items()}
        m["lr"] = float(schedule(step - 1))
        now = time.perf_counter()
        if not m["ok"]:
            raise NonFiniteLossError(step, m["loss"], m["grad_norm"], result.checkpoint)
        tps = ntok_in / max(now - t_prev, 1e-9)
        t_prev = now
        window_tokens += ntok_in
        m.update(tokens=ntok_in, tokens_per_s=tps)
        result.step = step
        result.steps.append(step)
        result.losses.append(m["loss"])
        result.lrs.append(m["lr"])
        result.grad_norms.append(m["grad_norm"])
        result.tokens_per_s.append(tps)
        if step % config.log_every == 0 or step == config.steps:
            log.write([step, repr(m["loss"]), repr(m["lr"]),
                       f"{window_tokens / max(now - window_t0, 1e-9):.2f}"])
            window_tokens, window_t0 = 0, now
        if evaluates_at(step):
            ev = evaluate(model, eval_it.eval_batches(), max_batches=config.eval_max_batches)
            result.eval_losses.append((step, ev))
            eval_log.write([step, repr(ev)])
            m["eval_loss"] = ev
            t_prev = window_t0 = time.perf_counter()  # don't count eval in tokens/s
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tps:,.0f}", lr=f"{m['lr']:.2e}")
        saved = False
        if saves_at(step):
            save(step, step_state)
            saved = True
            t_prev = time.perf_counter()  # don't count checkpointing in the next step's rate
        if on_step is not None and on_step(step, m) is False:
            if not saved:
                save(step, step_state)
            result.stopped_early = step < config.steps
            return False
        return True

    try:
        if start >= config.steps:
            return result
        batch, ntok_next = next_batch()
        batch_state = it.state_dict()  # the data position once this batch is consumed
        t_prev = window_t0 = time.perf_counter()
        # One step in flight: between checkpoints and evals the host reads step N's metrics only
        # after dispatching step N + 1, so the host's own per-step time (dispatch, metrics, logging:
        # about 13 ms per 8B step on an H200) overlaps the device's work instead of adding to it.
        pending = None
        for step in range(start + 1, config.steps + 1):
            dispatched = (step, step_fn(batch), ntok_next, batch_state)  # async dispatch
            if step < config.steps:  # prepare the next batch while the device works
                batch, ntok_next = next_batch()
                batch_state = it.state_dict()
            if pending is not None:
                finish(*pending)  # a pending step is never one where on_step could stop the run
                pending = None
            if not must_finish_now(step):
                pending = dispatched
            elif not finish(*dispatched):
                break
        return result
    finally:
        bar.close()
        log.close()
        if eval_log is not None:
            eval_log.close()
        try:
            result.png_path = write_loss_plot(out_dir)
        except Exception as e:  # a plotting failure must not hide the real outcome
            warnings.warn(f"could not write {out_dir / PNG_NAME}: {e}", stacklevel=2)
