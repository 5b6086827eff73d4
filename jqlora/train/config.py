"""`TrainConfig`: the settings of one training run, the fields of `jqlora train`'s flags and config
files. A module of its own, with nothing heavy imported, so that `jqlora train --help` builds its
flags without loading jax."""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

LR_SCHEDULES = ("cosine", "linear", "constant")


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
    bos: Any = "auto"            # see tokenization.special_tokens
    eos: Any = "auto"
    overflow: str = "truncate"   # long examples: "truncate" or "split"
    data_format: str = "auto"    # "auto" (per line, from its keys) or an examples.FORMATS key
    chat_template: str | None = None  # a Jinja file replacing the tokenizer folder's template
    shuffle: bool = True
    keep_checkpoints: int | None = 2
    progress: bool | None = None  # tqdm bar; None: on a TTY, else plain lines
    tensorboard: bool | None = None  # event files in out_dir/tensorboard; None: if tensorboardX is installed
    resume: bool = False
    mesh: str | None = None      # "data=2,fsdp=2" (or a jax Mesh); None: every device on data

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
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"TrainConfig.epochs must be > 0 or None, got {self.epochs}")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"TrainConfig.warmup_ratio must be in [0, 1] or None, got {self.warmup_ratio}")
        if self.tensorboard and not tensorboard_available():
            raise ValueError("TrainConfig.tensorboard is on but tensorboardX is not installed "
                             "(pip install tensorboardX)")
