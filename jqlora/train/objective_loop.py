"""The host loop of the objectives besides SFT (``TrainConfig.objective`` "dpo", "grpo"): what
:func:`jqlora.train.train` runs for them, with SFT's outputs and guarantees (``loss.csv`` with the
objective's metrics as extra columns, ``eval.csv``, TensorBoard, atomic checkpoints, ``resume``,
the non-finite guard, ``on_step`` / ``on_ready``).

An objective is a *task* object (:class:`jqlora.train.preference.DPOTask`,
:class:`jqlora.train.grpo.GRPOTask`) with:

* ``batch_size`` and ``rows_per_epoch()`` (pairs or prompts; for ``epochs``),
* ``columns`` / ``eval_columns`` / ``shown``: its metric names (see :class:`MetricsLog`),
* ``state_dict()`` / ``load_state_dict(state)``: its position in the data and any RNG key, JSON,
  stored in each checkpoint's ``data_state``,
* ``bind(model, optimizer)``, then ``step() -> metrics`` (a dict of floats with ``loss``,
  ``grad_norm``, ``ok``, ``tokens`` and the columns) and ``evaluate() -> metrics``.

Steps run one at a time (each step's rollouts or reference pass depend on the previous update).
One device: a ``mesh`` other than None is refused.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from ..errors import SettingError
from .checkpoint import (NonFiniteStateError, latest_checkpoint, restore_checkpoint, save_checkpoint,
                         stored_loss_window)
from .config import resolve_run_length, tensorboard_available
from .metrics import CSV_NAME, MetricsLog, write_loss_plot
from .optim import make_optimizer, make_schedule, schedule_table

__all__ = ["train_objective", "make_task", "check_objective_data"]


def check_objective_data(config, model_dir=None) -> dict:
    """What ``jqlora train`` checks before loading a model, for DPO and GRPO (as
    :func:`jqlora.train.data.check_training_data` for SFT): the tokenizer, the data (and eval
    data) read and tokenized, the reward functions imported. Hand ``"batches"``,
    ``"eval_batches"`` and ``"tokenizer"`` to ``train(data=..., eval_data=..., tokenizer=...)``:
    the files are read once.

    Raises:
      DataError: the first bad row, naming the file and row.
      jqlora.train.rewards.RewardError: a reward function that cannot be loaded.
    """
    from .data import checkpoint_config, config_vocab_size
    from .tokenization import check_tokenizer_fits, load_tokenizer, special_tokens

    tok = load_tokenizer(config.tokenizer_path, chat_template=config.chat_template)
    special = special_tokens(tok, bos=config.bos, eos=config.eos, tokenizer_path=config.tokenizer_path)
    model_cfg = checkpoint_config(model_dir)
    vocab = config_vocab_size(model_cfg)
    if vocab is not None:
        check_tokenizer_fits(tok, vocab)
    if config.objective == "dpo":
        from .preference import load_pairs

        train = load_pairs(config.data_path, tok, special, config.seq_len, vocab_size=vocab,
                           split=getattr(config, "data_split", None))
        ev = (None if config.eval_data_path is None
              else load_pairs(config.eval_data_path, tok, special, config.seq_len, vocab_size=vocab,
                              split=getattr(config, "eval_data_split", None)))
    else:
        from .grpo import load_prompts, max_prompt_length
        from .rewards import load_rewards

        load_rewards(config.reward)
        train = load_prompts(config.data_path, tok, special, max_prompt_length(config), vocab_size=vocab,
                             split=getattr(config, "data_split", None))
        ev = None
    return {"train": train.summary(), "eval": None if ev is None else ev.summary(), "batches": train,
            "eval_batches": ev, "tokenizer": tok, "model_config": model_cfg}


def make_task(model, config, data, tokenizer, eval_data):
    """The task of ``config.objective``: a DPOTask or a GRPOTask."""
    if data is None and config.data_path is None:
        raise ValueError("no training data: pass data=... or set TrainConfig.data_path")
    if config.objective == "dpo":
        from .preference import DPOTask

        return DPOTask(model, config, data, tokenizer, eval_data)
    from .grpo import GRPOTask

    return GRPOTask(model, config, data, tokenizer, eval_data)


def train_objective(model, config, make_task, *, data, tokenizer, eval_data, on_step, resume,
                    on_ready, result_type, non_finite_error, prepare):
    """:func:`jqlora.train.train` for ``config.objective`` other than "sft", once ``out_dir`` is
    locked. ``make_task(model, config, data, tokenizer, eval_data)`` builds the task; the result
    and error types are :mod:`jqlora.train.loop`'s, and ``prepare(model, optimizer, config)``
    its set-up of a run once the checkpoint is restored (stale temp files, remat, placement)."""
    if config.mesh is not None:
        raise SettingError(f"TrainConfig.mesh is not supported with objective {config.objective!r}: "
                           "it runs on one device")
    out_dir = Path(config.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        raise ValueError("the model has no nnx.LoRAParam variables: nothing to train")
    task = make_task(model, config, data, tokenizer, eval_data)
    if config.eval_every and not task.evaluating:
        raise ValueError("TrainConfig.eval_every is set but there is no eval data: pass "
                         "eval_data=... or set TrainConfig.eval_data_path")
    config = resolve_run_length(config, task).config
    task.config = config
    lrs = schedule_table(make_schedule(config.lr, config.warmup, config.steps,
                                       final_lr_ratio=config.final_lr_ratio, kind=config.lr_schedule),
                         config.steps)
    tx = make_optimizer(config.lr, config.warmup, config.steps, config.weight_decay, config.b1,
                        config.b2, config.grad_clip, final_lr_ratio=config.final_lr_ratio,
                        lr_schedule=config.lr_schedule, optimizer=config.optimizer)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

    start, resumed_from, last_ckpt = 0, None, latest_checkpoint(ckpt_dir)
    if last_ckpt is not None:
        if not resume:
            raise FileExistsError(
                f"{ckpt_dir} already holds checkpoints (latest {last_ckpt.name}); pass "
                f"resume=True to continue that run or choose another out_dir")
        state, start = restore_checkpoint(last_ckpt, model, optimizer)
        if state is not None:
            task.load_state_dict(state)
        resumed_from = start
    if on_ready is not None:
        on_ready(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepare(model, optimizer, config)
    model.train()
    task.bind(model, optimizer)

    log = MetricsLog(out_dir, start=start, total=config.steps, resumed=resumed_from is not None,
                     log_every=config.log_every, evaluating=task.evaluating,
                     tensorboard=(tensorboard_available() if config.tensorboard is None else config.tensorboard),
                     progress=config.progress, progress_every_s=30.0, columns=task.columns,
                     eval_columns=task.eval_columns, shown=task.shown)
    log.restore_window(stored_loss_window(last_ckpt) if resumed_from is not None else None)
    result = result_type(step=start, steps=[], losses=[], lrs=[], grad_norms=[], tokens_per_s=[],
                         eval_losses=[], checkpoint=last_ckpt, resumed_from=resumed_from,
                         out_dir=out_dir, csv_path=out_dir / CSV_NAME, png_path=None,
                         total_steps=config.steps)

    def save(step, m):
        keep = config.keep_checkpoints
        if keep and step < config.steps:
            keep = max(keep, 2)
        try:
            result.checkpoint = save_checkpoint(
                ckpt_dir, model, optimizer, task.state_dict(), step, keep=keep, require_finite=True,
                extra={"train_config": dataclasses.asdict(config), "skipped_batches": 0,
                       "loss_window": log.window_state()})
        except NonFiniteStateError as e:
            raise non_finite_error(step, m["loss"], m["grad_norm"], result.checkpoint,
                                   detail=f"'{e.key}' holds NaN/Inf") from None

    try:
        log.start_clock()
        for step in range(start + 1, config.steps + 1):
            m = task.step()
            m["lr"] = float(lrs[step - 1])
            if not m["ok"]:
                raise non_finite_error(step, m["loss"], m["grad_norm"], result.checkpoint)
            m["tokens_per_s"] = log.step(step, m, int(m["tokens"]))
            result.step = step
            result.steps.append(step)
            result.losses.append(m["loss"])
            result.lrs.append(m["lr"])
            result.grad_norms.append(m["grad_norm"])
            result.tokens_per_s.append(m["tokens_per_s"])
            result.metrics.append(dict(m))
            if task.evaluating and config.eval_every and (step % config.eval_every == 0 or step == config.steps):
                with log.paused():
                    ev = task.evaluate()
                log.evaluation_metrics(step, ev)
                result.eval_losses.append((step, ev["loss"]))
                result.eval_metrics.append((step, ev))
                m.update({f"eval_{k}": v for k, v in ev.items()})
            saved = False
            if (config.save_every and step % config.save_every == 0) or step == config.steps:
                with log.paused():
                    save(step, m)
                saved = True
            if on_step is not None and on_step(step, m) is False:
                if not saved:
                    save(step, m)
                result.stopped_early = step < config.steps
                break
        return result
    finally:
        log.close()
        try:
            result.png_path = write_loss_plot(out_dir)
        except Exception as e:  # a plotting failure must not hide the real outcome
            import warnings

            warnings.warn(f"could not write {out_dir / 'loss.png'}: {e}", stacklevel=2)
