"""A training run directory: its record, config files, and export of its checkpoints to PEFT.

A run directory (the `out_dir` of `jqlora train` or of the demo) holds `checkpoints/step_*`,
loss.csv / loss.png and the run record `jqlora_run.json`. The record says what a checkpoint alone
does not: the base model, the compute dtype, the LoRA settings and the TrainConfig. It is written
before training starts, so a partial run can still be exported. Its keys:

    format "jqlora-run", version 1, model, compute_dtype, backend, attention (optional),
    quantize (optional), init_adapter (optional), adapter_out (optional),
    lora {rank, alpha, dropout, target_modules, use_rslora}, train {TrainConfig fields}

Config files (`jqlora train --config`) and the record are JSON or TOML objects read by
`load_config_file`. Errors are `RunError`, a ValueError whose message names the file or directory.
Nothing heavy is imported at module level: the CLI imports this before jax.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

RUN_FILE = "jqlora_run.json"
RUN_FORMAT = "jqlora-run"
RUN_VERSION = 1


class RunError(ValueError):
    """A run directory, run record, checkpoint choice or config file that cannot be used; the
    message names the file or directory."""


def load_config_file(path: str | os.PathLike) -> dict:
    """Read a JSON (.json) or TOML (.toml) config file, or a run record, into a dict.

    Args:
      path: the file; a .toml suffix selects TOML, anything else is read as JSON.

    Raises:
      RunError: the file cannot be read, does not parse, or its top level is not an object/table.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RunError(f"{p}: cannot read config file: {e}") from None
    if p.suffix.lower() == ".toml":
        import tomllib

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise RunError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"{p}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RunError(f"{p}: top level must be an object/table, got {type(data).__name__}")
    return data


def lora_record(lora_config) -> dict:
    """The `lora` table of a run record for a `jqlora.lora.LoraConfig` (JSON types only)."""
    targets = lora_config.target_modules
    return {"rank": lora_config.rank, "alpha": lora_config.alpha, "dropout": lora_config.dropout,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "use_rslora": lora_config.use_rslora}


def lora_config_from_record(lora: dict):
    """The `jqlora.lora.LoraConfig` a run record's `lora` table describes (inverse of `lora_record`)."""
    from jqlora.lora import LoraConfig

    targets = lora.get("target_modules")
    return LoraConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora.get("dropout", 0.0)),
                      target_modules=targets if isinstance(targets, str) else tuple(targets),
                      use_rslora=bool(lora.get("use_rslora", False)))


def write_run_record(out_dir: str | os.PathLike, record: dict) -> Path:
    """Write `record` atomically to `out_dir/jqlora_run.json`; returns the path.

    Args:
      out_dir: the run directory (created if missing).
      record: the record (see the module docstring); `format` and `version` are filled in when absent.
    """
    from interop.atomic_io import write_json_atomic

    return write_json_atomic(Path(out_dir) / RUN_FILE,
                             {"format": RUN_FORMAT, "version": RUN_VERSION, **record})


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


def export_adapter(source, out, *, step: Optional[int] = None, model_path=None) -> dict[str, Any]:
    """Restore a run's training checkpoint into its model and write the LoRA weights as a PEFT
    adapter directory (what `jqlora export-peft` does).

    The base model and LoRA settings come from the run record; the checkpoint is validated
    (checksums, keys, shapes) while it is restored.

    Args:
      source: a run directory, its checkpoints/ directory, or one step directory.
      out: the adapter directory to write.
      step: the checkpoint's step (None: the newest).
      model_path: the base checkpoint (None: the `model` of the run record).

    Returns:
      {"checkpoint", "step", "adapter", "modules", "model", "rank", "alpha"}.

    Raises:
      RunError: no such source, no checkpoint, no run record, or no model recorded.
    """
    source = Path(source)
    if not source.exists():
        raise RunError(f"{source}: no such directory")
    ckpt = find_checkpoint(source, step)
    run_file = find_run_file(ckpt.parent if ckpt.parent.name == "checkpoints" else ckpt)
    if run_file is None:
        run_file = find_run_file(source)
    if run_file is None:
        raise RunError(f"no jqlora_run.json found near {ckpt}: it records the base model and LoRA settings "
                       "(written by `jqlora train`)")
    run = load_config_file(run_file)
    model_path = model_path or run.get("model")
    if not model_path:
        raise RunError(f"{run_file}: no 'model' recorded; pass --model")
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{ckpt / 'state.json'}: cannot read: {e}") from None
    tc = (state.get("extra") or {}).get("train_config") or run.get("train") or {}

    from jqlora._util import jnp_dtype, quiet_third_party

    quiet_third_party()
    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import lora_params_by_module
    from jqlora.train import TrainConfig, make_optimizer, restore_checkpoint

    lora_cfg = lora_config_from_record(run.get("lora") or {})
    model = models.load_causal_lm(model_path, lora=lora_cfg, compute_dtype=jnp_dtype(run.get("compute_dtype", "float32")),
                                  quantize=run.get("quantize"), rngs=nnx.Rngs(0))
    d = TrainConfig()
    g = lambda k: tc.get(k, getattr(d, k))  # noqa: E731
    tx = make_optimizer(g("lr"), g("warmup"), g("steps"), g("weight_decay"), g("b1"), g("b2"), g("grad_clip"),
                        final_lr_ratio=g("final_lr_ratio"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _, step_done = restore_checkpoint(ckpt, model, optimizer)
    adapters.save_adapter(out, model, lora_cfg, base_model=str(model_path))
    n = len(lora_params_by_module(model))
    return dict(checkpoint=str(ckpt), step=step_done, adapter=str(out), modules=n, model=str(model_path),
                rank=lora_cfg.rank, alpha=lora_cfg.alpha)


__all__ = ["RUN_FILE", "RUN_FORMAT", "RUN_VERSION", "RunError", "load_config_file", "lora_record",
           "lora_config_from_record", "write_run_record", "find_run_file", "find_checkpoint", "export_adapter"]
