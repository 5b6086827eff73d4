"""`TrainConfig`: the settings of one training run, the fields of `jqlora train`'s flags and config
files, and `resolve_run_length`, which turns its ``epochs`` into optimizer steps and its
``warmup_ratio`` into warmup steps. A module of its own, with nothing heavy imported, so that
`jqlora train --help` builds its flags without loading jax.

The run length is counted from the training data once it is tokenized and packed, so it is
resolved by :func:`jqlora.train.train`, which stores the resolved config in its checkpoints (and
hands it to ``on_ready``): a resumed run continues towards the same step."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from typing import Any

from jqlora._util import BASE_MATMULS

LR_SCHEDULES = ("cosine", "linear", "constant")
OBJECTIVES = ("sft", "dpo", "grpo")
OPTIMIZERS = ("adamw", "adamw8bit")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs besides the model and data objects; also the fields of
    ``jqlora train``'s config file. :meth:`validate` checks the counts."""

    data_path: str | None = None
    tokenizer_path: str | None = None
    seq_len: int = 512
    batch_size: int = 8          # rows per micro-batch
    grad_accum: int = 1          # micro-batches per optimizer step
    lr: float = 2e-4
    lr_schedule: str = "cosine"  # after warmup: "cosine" or "linear" decay, or "constant"
    warmup: int = 0              # warmup steps
    warmup_ratio: float | None = None  # warmup as a fraction of the steps (replaces warmup)
    steps: int = 1000            # total optimizer steps (also the length of the LR schedule)
    epochs: float | None = None  # passes over the packed training rows (replaces steps)
    seed: int = 0                # data shuffle seed
    out_dir: str = "runs/jqlora"
    save_every: int = 100        # checkpoint every N steps (0: only at the end); always at the end
    log_every: int = 10          # loss.csv row at step 1, every N steps and the last (loss: the mean since the row before)
    remat: bool | str = False    # per-layer rematerialization in the model (see train())
    # "fp8": the frozen 4-bit weights' products on E4M3 operands (load_causal_lm(base_matmul=),
    # which `jqlora train` passes it to); "compute": in the compute dtype
    base_matmul: str = "compute"
    packing: bool = True         # several examples per row; False: one per row, no segment mask
    eval_every: int | None = None
    eval_data_path: str | None = None
    eval_max_batches: int | None = None
    # "adamw8bit": AdamW whose moments are stored in 8 bits, blockwise (bitsandbytes' AdamW8bit;
    # jqlora.train.adamw8bit): about a quarter of AdamW's state memory; fixed on resume
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float | None = 1.0
    final_lr_ratio: float = 0.0
    # mixture-of-experts models: the router's load-balancing loss, added times this (transformers'
    # `router_aux_loss_coef * aux_loss`); None: as config.json says (on, at its router_aux_loss_coef,
    # when output_router_logits is true, as transformers does); 0: off
    router_aux_loss_coef: float | None = None
    bos: Any = "auto"            # see tokenization.special_tokens
    eos: Any = "auto"
    overflow: str = "truncate"   # long examples: "truncate" or "split"
    data_format: str = "auto"    # "auto" (per line, from its keys) or an examples.FORMATS key
    chat_template: str | None = None  # a Jinja file replacing the tokenizer folder's template
    data_split: str | None = None       # the split of a datasets folder or hub id (None: "train")
    eval_data_split: str | None = None  # the same for eval_data_path
    text_field: str | None = None       # the column holding "text" when it has another name
    prompt_field: str | None = None     # ... "prompt"
    completion_field: str | None = None  # ... "completion"
    messages_field: str | None = None   # ... the conversation (messages, or ShareGPT turns)
    role_map: str | None = None         # ShareGPT speakers -> roles, "from=to,from=to" (added to the defaults)
    shuffle: bool = True
    keep_checkpoints: int | None = 2
    progress: bool | None = None  # tqdm bar; None: on a TTY, else plain lines
    tensorboard: bool | None = None  # event files in out_dir/tensorboard; None: if tensorboardX is installed
    resume: bool = False
    mesh: str | None = None      # "data=2,fsdp=2" (or a jax Mesh); None: every device on data
    # objectives other than SFT (jqlora.train.preference, jqlora.train.grpo; TRL's names and meanings)
    objective: str = "sft"       # "sft", "dpo" (prompt/chosen/rejected pairs) or "grpo" (prompts + rewards)
    dpo_beta: float = 0.1        # DPO: beta (IPO: tau)
    dpo_loss: str = "sigmoid"    # DPO: "sigmoid", "ipo" or "hinge"
    dpo_label_smoothing: float = 0.0  # DPO sigmoid: conservative DPO's label smoothing
    precompute_ref: bool = False  # DPO: reference log-probs of every pair once, before step 1
    reward: list[str] | None = None  # GRPO: reward functions, "module:function" or "path.py:function"
    reward_weights: str | None = None  # GRPO: comma-separated weights, one per reward (default 1 each)
    num_generations: int = 8     # GRPO: completions per prompt (one group)
    max_completion_length: int = 64  # GRPO: new tokens per completion at most
    temperature: float = 1.0     # GRPO: sampling temperature (log-probs use logits / temperature)
    top_p: float = 1.0           # GRPO: nucleus sampling
    grpo_beta: float = 0.0       # GRPO: weight of the KL to the reference (0: no reference pass)
    epsilon: float = 0.2         # GRPO: ratio clip, lower side (and upper side unless epsilon_high)
    epsilon_high: float | None = None
    grpo_loss: str = "dapo"      # GRPO: "grpo", "dr_grpo" or "dapo" normalisation
    scale_rewards: str = "group"  # GRPO: advantages divided by the std of the "group", the "batch", or "none"

    def validate(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.warmup < 0:
            raise ValueError("TrainConfig.save_every and warmup must be >= 0")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError("TrainConfig.eval_every must be >= 1 or None")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"TrainConfig.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"TrainConfig.epochs must be > 0 or None, got {self.epochs}")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"TrainConfig.warmup_ratio must be in [0, 1] or None, got {self.warmup_ratio}")
        if self.base_matmul not in BASE_MATMULS:
            raise ValueError(f"TrainConfig.base_matmul must be one of {', '.join(BASE_MATMULS)}, "
                             f"got {self.base_matmul!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"TrainConfig.objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective != "sft":
            from .objectives import validate_objective  # noqa: PLC0415 (no jax there either)

            validate_objective(self)
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float))
                                 or not 0 <= coef < math.inf):
            raise ValueError(f"TrainConfig.router_aux_loss_coef must be a number >= 0 or None, got {coef!r}")
        _check_remat(self.remat)
        if self.tensorboard and not tensorboard_available():
            raise ValueError("TrainConfig.tensorboard is on but tensorboardX is not installed "
                             "(pip install tensorboardX)")


def _check_remat(remat) -> None:
    """``remat`` is a bool, "auto", a policy name or a jax.checkpoint policy (checked before a model
    loads; the policy names are read from jqlora.models.remat only for a name other than "auto")."""
    if isinstance(remat, bool) or remat is None or remat == "auto" or callable(remat):
        return
    from jqlora.models.remat import REMAT_POLICIES  # noqa: PLC0415

    if not isinstance(remat, str) or remat not in REMAT_POLICIES:
        raise ValueError(f"TrainConfig.remat must be true, false, 'auto' or a policy name "
                         f"({', '.join(sorted(REMAT_POLICIES))}), got {remat!r}")


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
