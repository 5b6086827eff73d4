"""The host side of training: ``TrainConfig``, ``TrainResult`` and :func:`train`, the loop that feeds
batches to the compiled step (:mod:`jqlora.train.step`), logs, evaluates and checkpoints.

One training step = ``grad_accum`` micro-batches of ``batch_size`` rows, one optimizer update
(:data:`~jqlora.train.step.train_step`). When a step reports a NaN/Inf loss, gradient norm or LoRA
param, the step has kept the previous params and optimizer state; the host raises
:class:`NonFiniteLossError` naming the step, and no checkpoint is written for it. A checkpoint
written at the step just before is set aside (renamed ``rejected_step_*``) when the failing step's
loss or gradient norm was non-finite: those came from that checkpoint's weights, so resuming from
it would fail the same way; the error names the last checkpoint whose weights gave a finite loss.
For that, pruning keeps at least two checkpoints until the last step.

Data with no supervised token at all (e.g. every completion cut off by ``seq_len``) is an error
before the first step; a step whose batch has none is skipped and counted
(``TrainResult.skipped_batches``, also stored in checkpoints so that a resumed run keeps counting).

Progress: a tqdm bar on a terminal; when stderr is not a terminal (nohup, SLURM) and
``progress`` is None, plain lines (step, loss, grad_norm, lr, tokens/s, elapsed) at the first and
last step and every :data:`PROGRESS_EVERY_S` seconds.

Length: ``steps`` optimizer steps, or ``epochs`` passes over the tokenized, packed training rows
(:func:`jqlora.train.config.resolve_run_length`); the learning-rate schedule (``lr_schedule``, warmup from
``warmup`` or ``warmup_ratio``) spans them.

One process writes to an ``out_dir`` at a time (:func:`jqlora.train.lock.lock_run_dir`); under that
lock a run removes the temp files of writes a killed process left behind.

Outputs in ``out_dir``: ``loss.csv`` (step, loss, lr, tokens_per_s, grad_norm, and aux_loss when a
mixture-of-experts model adds its router's load-balancing loss (`router_aux_coef`): one row per
logged step), ``loss.png``, ``eval.csv`` (step, eval_loss, perplexity; when evaluating), TensorBoard event
files in ``tensorboard/`` (:mod:`jqlora.train.metrics`) and ``checkpoints/step_XXXXXXXX``.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from .checkpoint import (STATE_FILE, NonFiniteStateError, latest_checkpoint, list_checkpoints, read_state,
                         remove_stale_saves, restore_checkpoint, save_checkpoint, stored_loss_window)
from .config import TrainConfig, resolve_run_length, tensorboard_available
from .data import SegmentTables, training_batches
from .examples import Example, Schema, parse_example
from .metrics import CSV_NAME, EVAL_CSV_NAME, PNG_NAME, MetricsLog, write_loss_plot
from .optim import make_optimizer, make_schedule, schedule_table
from .router_aux import router_aux_coef
from .step import evaluate, train_step, train_step_aux
from .tokenization import check_tokenizer_fits, load_tokenizer, special_tokens, tokenize_examples, tokenize_source
from .. import parallel
from ..ops import sharding

__all__ = ["TrainConfig", "TrainResult", "NonFiniteLossError", "train"]

CKPT_DIR = "checkpoints"
PROGRESS_EVERY_S = 30.0  # plain progress lines (stderr not a terminal): at most this far apart
MAX_SKIPPED_IN_A_ROW = 1000  # consecutive batches without a supervised token before giving up


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm went NaN/Inf. ``step`` is the 1-based step that failed."""

    def __init__(self, step: int, loss: float, grad_norm: float, checkpoint: Path | None,
                 detail: str = ""):
        self.step, self.loss, self.grad_norm, self.checkpoint = step, loss, grad_norm, checkpoint
        where = (f"last good checkpoint: {checkpoint}" if checkpoint is not None
                 else "no good checkpoint on disk")
        super().__init__(
            f"non-finite training state at step {step} (loss={loss}, grad_norm={grad_norm}"
            f"{'; ' + detail if detail else ''}); the update was not applied and no checkpoint "
            f"was written for this step; {where}. "
            f"Lower the learning rate, check the data, or enable/lower grad_clip.")


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` did: per-step metrics of this call, evals, and the files written."""

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
    skipped_batches: int = 0                   # steps' batches without a supervised token (whole run)
    total_steps: int = 0                       # the run's length (from epochs when those were set)
    # objectives other than SFT: every step's metrics (loss.csv's columns), each evaluation's
    metrics: list[dict] = dataclasses.field(default_factory=list)
    eval_metrics: list[tuple[int, dict]] = dataclasses.field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _model_vocab_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    if isinstance(cfg, dict):
        return cfg.get("vocab_size")
    return getattr(cfg, "vocab_size", None)


def _as_examples(data: Sequence, format: str = "auto", schema: Schema | None = None) -> list[Example]:
    out = []
    for i, ex in enumerate(data, start=1):
        out.append(ex if isinstance(ex, Example)
                   else parse_example(ex, source="<data argument>", line=i, format=format, schema=schema))
    return out


def _build_iterator(config: TrainConfig, data, tokenizer, model, *, eval_: bool = False):
    """data: None (use the config's path), a path (a data file, a ``datasets`` folder or a cached
    hub dataset id: :func:`jqlora.train.sources.read_rows`), a sequence of examples (dicts or
    Example), or an iterator with ``__next__``/``state_dict``/``load_state_dict`` (used as is)."""
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
        tokenizer = load_tokenizer(config.tokenizer_path, chat_template=config.chat_template)
    vocab = _model_vocab_size(model)
    if vocab is not None:
        check_tokenizer_fits(tokenizer, vocab)
    special = special_tokens(tokenizer, bos=config.bos, eos=config.eos,
                             tokenizer_path=config.tokenizer_path)
    schema = Schema.from_config(config)
    if isinstance(data, (str, os.PathLike)):
        split = config.eval_data_split if eval_ else config.data_split
        _, tokenized = tokenize_source(data, tokenizer, special, format=config.data_format, schema=schema,
                                       split=split)
    else:
        tokenized = tokenize_examples(tokenizer, _as_examples(data, config.data_format, schema), special)
    return training_batches(config, tokenized, special, eval_=eval_,
                            source=str(data) if isinstance(data, (str, os.PathLike)) else "<data argument>")


def _remove_stale_temp(out_dir: Path) -> None:
    """Remove what killed writes of a run left in ``out_dir``: checkpoint temp dirs, the run
    record's and the CSV/plot temp files, an adapter's temp dirs. Only under the run's lock."""
    remove_stale_saves(out_dir / CKPT_DIR)
    for pattern in (".*.tmp-*", ".*.old-*", CSV_NAME + ".tmp", EVAL_CSV_NAME + ".tmp",
                    PNG_NAME + ".tmp.png"):
        for stale in out_dir.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _stored_skips(checkpoint: Path) -> int:
    """The skipped-batch count stored in a checkpoint (0 for one written without it)."""
    try:
        extra = read_state(checkpoint).get("extra") or {}
        return int(extra.get("skipped_batches", 0))
    except (ValueError, TypeError, AttributeError):  # CheckpointError is a ValueError
        return 0


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


def prepare_single_device_run(model, optimizer, config) -> None:
    """A run's set-up on one device once its checkpoint is restored (the objectives' loop)."""
    _remove_stale_temp(Path(config.out_dir))
    _apply_remat(model, config.remat)
    _commit(model)
    _commit(optimizer)


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
          resume: bool | None = None, on_ready: Callable[[], Any] | None = None,
          lock: bool = True, model_path: str | os.PathLike | None = None) -> TrainResult:
    """Train the model's ``nnx.LoRAParam`` variables in place; everything else stays frozen.

    ``config.objective`` "dpo" (preference pairs) or "grpo" (prompts + reward functions) runs
    :func:`jqlora.train.objective_loop.train_objective` instead of the SFT loop described here,
    with the same arguments (``data``: a path, a list of row dicts, or what
    ``check_objective_data`` returned) and outputs (docs/training.md, "Preference and RL training").

    Steps overlap with the host: without ``on_step``, step N's metrics are read (and logged) after
    step N + 1 is dispatched, except at checkpoints, evals and the last step, where the host waits
    for the step before going on. So when a NaN/Inf stops training at step N, the next step may
    already have updated the in-memory model; checkpoints never contain it. With ``on_step`` every
    step is finished before the next is dispatched, so the callback sees that step's model.

    Args:
      model: an NNX model with ``nnx.LoRAParam`` variables (e.g. from
        ``jqlora.models.load_causal_lm(..., lora=LoraConfig(...))``).
      config: the run's :class:`TrainConfig`. ``config.remat`` (True or a policy name) is handed
        to the model (``set_remat()``, its ``remat`` attribute, or ``config.remat``); a model
        with none of these gets a warning.
      data: None (use ``config.data_path``), a JSONL path, a list of example dicts, or a
        :class:`BatchIterator`-like object (``__next__``, ``state_dict``, ``load_state_dict``;
        its own batch size is used).
      tokenizer: a ``tokenizers.Tokenizer`` (default: loaded from ``config.tokenizer_path``).
      eval_data: like ``data``, for evaluation (default ``config.eval_data_path``).
      on_step: ``on_step(step, metrics)`` runs after each step (after logging and
        checkpointing); returning ``False`` stops training (a checkpoint is written for that
        step). An exception raised by it propagates (the run can be resumed from the last
        checkpoint).
      resume: (default ``config.resume``) continue from the newest checkpoint in
        ``out_dir/checkpoints`` (fresh start if there is none). Without it, an ``out_dir`` that
        already holds checkpoints is refused rather than overwritten.
      on_ready: ``on_ready(config)`` runs once every check has passed (data loaded, checkpoint
        restored), before anything in ``out_dir`` changes, with the run's resolved config
        (``steps`` and ``warmup`` counted from ``epochs`` and ``warmup_ratio``): ``jqlora train``
        writes its run record there, so that a refused or failed run leaves it untouched. Default:
        write the run record of this call (:func:`jqlora.train.run_record.write_api_record`), so
        that ``jqlora export-peft`` / ``export-merged`` take ``out_dir``.
      model_path: the base model's folder for that record (default: ``model.checkpoint_path``,
        which :func:`jqlora.models.load_causal_lm` sets; unknown: the record says none and
        export asks for ``--model``).
      lock: hold ``out_dir``'s writer lock (:func:`jqlora.train.lock.lock_run_dir`) while training;
        False when the caller already holds it.

    Returns:
      A :class:`TrainResult` with the steps run, their metrics and the newest checkpoint.

    Raises:
      NonFiniteLossError: a step's loss, gradient norm or new LoRA params were NaN/Inf (the last
        good checkpoint is kept).
      FileExistsError: ``out_dir`` already holds checkpoints and ``resume`` is off.
      ValueError: no LoRA params, no data or tokenizer, no supervised token in the data, or
        ``eval_every`` without eval data.
      jqlora.train.lock.RunLockedError: another process holds ``out_dir``'s lock.
    """
    config.validate()
    if on_ready is None:
        from .run_record import write_api_record

        on_ready = functools.partial(write_api_record, model=model, model_path=model_path)
    if not lock:
        return _train(model, config, data, tokenizer, eval_data, on_step, resume, on_ready)
    from .lock import lock_run_dir

    with lock_run_dir(config.out_dir):
        return _train(model, config, data, tokenizer, eval_data, on_step, resume, on_ready)


def _train(model, config, data, tokenizer, eval_data, on_step, resume, on_ready) -> TrainResult:
    """:func:`train` once ``out_dir`` is locked."""
    resume = config.resume if resume is None else resume
    if config.objective != "sft":  # DPO, GRPO: jqlora.train.objective_loop
        from .objective_loop import make_task, train_objective

        return train_objective(model, config, make_task, data=data, tokenizer=tokenizer,
                               eval_data=eval_data, on_step=on_step, resume=resume, on_ready=on_ready,
                               result_type=TrainResult, non_finite_error=NonFiniteLossError,
                               prepare=prepare_single_device_run)
    out_dir = Path(config.out_dir)
    ckpt_dir = out_dir / CKPT_DIR

    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise ValueError("the model has no nnx.LoRAParam variables: nothing to train")

    aux_coef = router_aux_coef(model, config)
    it = _build_iterator(config, data, tokenizer, model)
    eval_it = _build_iterator(config, eval_data, tokenizer, model, eval_=True)
    if config.eval_every and eval_it is None:
        raise ValueError("TrainConfig.eval_every is set but there is no eval data: pass "
                         "eval_data=... or set TrainConfig.eval_data_path")
    length = resolve_run_length(config, it)
    config = length.config

    lrs = schedule_table(make_schedule(config.lr, config.warmup, config.steps,
                                       final_lr_ratio=config.final_lr_ratio, kind=config.lr_schedule),
                         config.steps)
    tx = make_optimizer(config.lr, config.warmup, config.steps, config.weight_decay, config.b1,
                        config.b2, config.grad_clip, final_lr_ratio=config.final_lr_ratio,
                        lr_schedule=config.lr_schedule, optimizer=config.optimizer)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    start, resumed_from, last_ckpt = 0, None, latest_checkpoint(ckpt_dir)
    skipped_before = 0
    if last_ckpt is not None:
        if not resume:
            raise FileExistsError(
                f"{ckpt_dir} already holds checkpoints (latest {last_ckpt.name}); pass "
                f"resume=True to continue that run or choose another out_dir")
        data_state, start = restore_checkpoint(last_ckpt, model, optimizer)
        if data_state is not None:
            it.load_state_dict(data_state)
        resumed_from = start
        skipped_before = _stored_skips(last_ckpt)

    if on_ready is not None:
        on_ready(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(out_dir)

    _apply_remat(model, config.remat)
    mesh = parallel.resolve_mesh(config.mesh, config.batch_size)  # None: one device, the plain path
    if mesh is None:
        _commit(model)
        _commit(optimizer)
    else:  # frozen weights cut over fsdp, the rest replicated (jqlora.parallel)
        parallel.place_state(model, optimizer, mesh)
    model.train()
    # bound once: the per-step split/update of the whole model graph is host time the device
    # would wait for whenever the host has nothing queued (at checkpoints, evals, with on_step)
    if aux_coef is None:
        step_fn = sharding.with_mesh(mesh, train_step.bind(model, optimizer))
    else:
        with_aux = train_step_aux.bind(model, optimizer)
        coef = np.float32(aux_coef)
        step_fn = sharding.with_mesh(mesh, lambda b: with_aux(b, coef))
        if config.progress is not False:
            print(f"train: router load-balancing loss on, coefficient {aux_coef:g} (loss.csv: aux_loss)",
                  file=sys.stderr, flush=True)

    if length.describe() is not None and config.progress is not False:
        print(f"train: {length.describe()}", file=sys.stderr, flush=True)
    log = MetricsLog(out_dir, start=start, total=config.steps, resumed=resumed_from is not None,
                     log_every=config.log_every, evaluating=eval_it is not None,
                     tensorboard=(tensorboard_available() if config.tensorboard is None
                                  else config.tensorboard),
                     progress=config.progress, progress_every_s=PROGRESS_EVERY_S,
                     **({} if aux_coef is None else {"columns": ("aux_loss",), "shown": ("aux_loss",)}))
    log.restore_window(stored_loss_window(last_ckpt) if resumed_from is not None else None)
    result = TrainResult(step=start, steps=[], losses=[], lrs=[], grad_norms=[],
                         tokens_per_s=[], eval_losses=[], checkpoint=last_ckpt,
                         resumed_from=resumed_from, out_dir=out_dir, csv_path=out_dir / CSV_NAME,
                         png_path=None, skipped_batches=skipped_before, total_steps=config.steps)

    segment_tables = SegmentTables()

    skipped = skipped_before  # batches skipped up to the newest batch drawn

    def next_batch():
        """(batch, number of real tokens in it, batches skipped so far); batches without a
        supervised token are skipped and counted."""
        nonlocal skipped
        in_a_row = 0
        while True:
            batch = _stack([next(it) for _ in range(config.grad_accum)])
            if np.sum(batch["loss_mask"]) != 0:  # NaN counts as not empty: the guard reports it
                break
            skipped += 1
            in_a_row += 1
            if in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise ValueError(f"{in_a_row} batches in a row have no supervised token "
                                 "(loss_mask all zero): check the data")
        ntok = int(np.count_nonzero(batch["segment_ids"]))
        if not config.packing:
            # One example per row from position 0, padding after it: under plain causal
            # attention no real token sees a padding key, so the segment mask changes nothing
            # for the loss, and without it cuDNN runs its mask-free causal kernels.
            segments = batch.pop("segment_ids")
            if aux_coef is not None:  # the load-balancing loss leaves the padding out
                batch["attention_mask"] = (segments > 0).astype(np.int32)
        elif getattr(model, "attention", None) == "cudnn":
            segment_tables.add(batch)
        return (batch if mesh is None else parallel.shard_batch(batch, mesh)), ntok, skipped

    def save(step, data_state, m):
        # until the last step keep >= 2: the newest checkpoint's weights have not been through a
        # step yet, and the one before is what a non-finite next step falls back to
        keep = config.keep_checkpoints
        if keep and step < config.steps:
            keep = max(keep, 2)
        try:
            result.checkpoint = save_checkpoint(
                ckpt_dir, model, optimizer, data_state, step, keep=keep, require_finite=True,
                extra={"train_config": dataclasses.asdict(config),
                       "skipped_batches": result.skipped_batches, "loss_window": log.window_state()})
        except NonFiniteStateError as e:
            raise NonFiniteLossError(step, m["loss"], m["grad_norm"], result.checkpoint,
                                     detail=f"'{e.key}' holds NaN/Inf") from None

    def non_finite(step, m) -> NonFiniteLossError:
        """The error for a non-finite ``step``. Its loss and gradient norm came from the weights
        of a checkpoint written at ``step - 1``, if any: when they are non-finite, that checkpoint
        is set aside (renamed ``rejected_step_*``) so that resuming does not start from it."""
        prev = ckpt_dir / f"step_{step - 1:08d}"
        if np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) or not (prev / STATE_FILE).is_file():
            return NonFiniteLossError(step, m["loss"], m["grad_norm"], result.checkpoint)
        aside = ckpt_dir / f"rejected_{prev.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(prev, aside)
        warnings.warn(f"{prev} gave a non-finite loss at step {step}: moved to {aside}",
                      stacklevel=4)
        return NonFiniteLossError(step, m["loss"], m["grad_norm"], latest_checkpoint(ckpt_dir),
                                  detail=f"the weights of {prev.name} gave it: moved to {aside.name}")

    def saves_at(step) -> bool:
        return bool(config.save_every and step % config.save_every == 0) or step == config.steps

    def evaluates_at(step) -> bool:
        return bool(eval_it is not None and config.eval_every
                    and (step % config.eval_every == 0 or step == config.steps))

    def must_finish_now(step) -> bool:
        """A step whose end state the host must see before the next dispatch: a checkpoint, an
        eval, or every step when ``on_step`` may stop the run or inspect the model."""
        return on_step is not None or saves_at(step) or evaluates_at(step)

    def finish(step, metrics, ntok_in, step_state, skipped_upto) -> bool:
        """Read a dispatched step's metrics, then log, evaluate, checkpoint and call on_step.
        False: on_step asked to stop."""
        m = {k: v.item() for k, v in jax.device_get(metrics).items()}
        m["lr"] = float(lrs[step - 1])
        if not m["ok"]:
            raise non_finite(step, m)
        tps = log.step(step, m, ntok_in)
        m.update(tokens=ntok_in, tokens_per_s=tps)
        result.step = step
        result.skipped_batches = skipped_upto
        result.steps.append(step)
        result.losses.append(m["loss"])
        result.lrs.append(m["lr"])
        result.grad_norms.append(m["grad_norm"])
        result.tokens_per_s.append(tps)
        if evaluates_at(step):
            with log.paused():  # evaluation is not training throughput
                ev = sharding.with_mesh(mesh, evaluate)(model, eval_it.eval_batches(),
                                                        max_batches=config.eval_max_batches)
                result.eval_losses.append((step, ev))
                m["eval_loss"], m["eval_perplexity"] = ev, log.evaluation(step, ev)
        saved = False
        if saves_at(step):
            with log.paused():  # nor is checkpointing
                save(step, step_state, m)
            saved = True
        if on_step is not None and on_step(step, m) is False:
            if not saved:
                save(step, step_state, m)
            result.stopped_early = step < config.steps
            return False
        return True

    try:
        if start >= config.steps:
            return result
        batch, ntok_next, skipped_next = next_batch()
        batch_state = it.state_dict()  # the data position once this batch is consumed
        log.start_clock()
        # One step in flight: between checkpoints and evals the host reads step N's metrics only
        # after dispatching step N + 1, so the host's own per-step time (dispatch, metrics,
        # logging) overlaps the device's work instead of adding to it.
        pending = None
        for step in range(start + 1, config.steps + 1):
            dispatched = (step, step_fn(batch), ntok_next, batch_state, skipped_next)  # async
            if step < config.steps:  # prepare the next batch while the device works
                batch, ntok_next, skipped_next = next_batch()
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
        log.close()
        try:
            result.png_path = write_loss_plot(out_dir)
        except Exception as e:  # a plotting failure must not hide the real outcome
            warnings.warn(f"could not write {out_dir / PNG_NAME}: {e}", stacklevel=2)
