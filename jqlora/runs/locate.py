"""A run's record and checkpoint found from a path: the run directory, its checkpoints/ directory
or one step directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from jqlora.runs.config_file import RunError
from jqlora.train.run_record import RUN_FILE


def find_run_file(source: str | os.PathLike) -> Optional[Path]:
    """The run record in `source`, its parent or its grandparent (a run dir, its checkpoints/ dir,
    or one step dir), or None."""
    source = Path(source)
    for d in (source, source.parent, source.parent.parent):
        if (d / RUN_FILE).is_file():
            return d / RUN_FILE
    return None


def find_checkpoint(source: str | os.PathLike, step: Optional[int] = None) -> Path:
    """The checkpoint directory `source` names.

    Args:
      source: a run directory, its checkpoints/ directory, or one checkpoints/step_XXXXXXXX directory.
      step: the step to pick; None picks the newest checkpoint.

    Raises:
      RunError: no checkpoint, or none for `step`.
    """
    from jqlora.train import list_checkpoints

    source = Path(source)
    if (source / "state.json").is_file():
        if step is not None and not source.name.endswith(f"{step:08d}"):
            raise RunError(f"{source} is a single checkpoint; --step {step} does not name it")
        return source
    for root in (source / "checkpoints", source):
        cks = list_checkpoints(root)
        if cks:
            if step is None:
                return cks[-1][1]
            for s, p in cks:
                if s == step:
                    return p
            raise RunError(f"{root}: no checkpoint for step {step} (have {[s for s, _ in cks]})")
    raise RunError(f"{source}: no training checkpoint found (expected checkpoints/step_XXXXXXXX)")
