"""A training run directory: its record, config files, and export of its checkpoints to PEFT.

A run directory (the `out_dir` of `jqlora train` or of the demo) holds `checkpoints/step_*`,
loss.csv / loss.png and the run record `jqlora_run.json`. The record says what a checkpoint alone
does not: the base model, the compute dtype, the LoRA settings and the TrainConfig. It is written
once every check of a run has passed, before its first step (so a partial run can still be
exported, and a refused or failed command leaves the record of the run already there untouched),
and again at the end. Its keys:

    format "jqlora-run", version 1, model, compute_dtype, backend, attention (optional),
    quantize (optional), init_adapter (optional), adapter_out (optional),
    lora {rank, alpha, dropout, target_modules, use_rslora}, train {TrainConfig fields},
    skipped_batches (optional: steps' batches skipped for having no supervised token)

One process writes to a run directory at a time: `lock_run_dir` holds an exclusive `flock` on
`<out_dir>/jqlora.lock` (released by the OS however the holder ends, kill -9 included).

Config files (`jqlora train --config`) and the record are JSON or TOML objects read by
`load_config_file`. Errors are `RunError`, a ValueError whose message names the file or directory.
Nothing heavy is imported at module level: the CLI imports this before jax.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

RUN_FILE = "jqlora_run.json"
LOCK_FILE = "jqlora.lock"
RUN_FORMAT = "jqlora-run"
RUN_VERSION = 1


class RunError(ValueError):
    """A run directory, run record, checkpoint choice or config file that cannot be used; the
    message names the file or directory."""


class RunLockedError(RunError):
    """Another live process holds the run directory's lock; the message names the lock file and
    the holder's pid."""


def _lock_holder(fd: int) -> str:
    """The pid written in an open lock file, or '' (a holder writes it just after locking)."""
    try:
        return os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""


@contextlib.contextmanager
def lock_run_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold the exclusive writer lock of a run directory while the `with` body runs.

    Why a `flock` and not a pid file alone: the OS drops it when its holder ends in any way
    (kill -9 included), so a lock can never outlive its process, and a pid that was reused by an
    unrelated process cannot keep the directory locked. The lock file holds the holder's pid (for
    the message) and is removed on release; one left behind by a killed process is stale and is
    taken over with a message on stderr. A directory this call creates and leaves empty is removed
    again on release, so a refused command leaves no trace.

    Args:
      out_dir: the run directory (created if missing).

    Yields:
      The lock file's path.

    Raises:
      RunLockedError: another live process holds the lock.
      OSError: the directory or the lock file cannot be created (read-only, permissions, disk full).
    """
    import fcntl

    d = Path(out_dir)
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_FILE
    try:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                raise RunLockedError(
                    f"{path}: {d} is in use by another jqlora process (pid {holder or 'unknown'}); "
                    "wait for it to end or choose another out_dir") from None
            try:  # the previous holder may have removed the file between our open and our flock
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    try:
        stale = _lock_holder(fd)
        if stale:
            print(f"{path}: taking over the stale lock of pid {stale}, which is no longer running",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before unlocking: a waiter then retries on a fresh file
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty


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

    path = Path(out_dir) / RUN_FILE
    try:
        return write_json_atomic(path, {"format": RUN_FORMAT, "version": RUN_VERSION, **record})
    except OSError as e:
        if e.filename is None and e.errno is not None:  # e.g. ENOSPC from a write(): say which file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


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
                        final_lr_ratio=g("final_lr_ratio"), lr_schedule=g("lr_schedule"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _, step_done = restore_checkpoint(ckpt, model, optimizer)
    adapters.save_adapter(out, model, lora_cfg, base_model=str(model_path))
    n = len(lora_params_by_module(model))
    return dict(checkpoint=str(ckpt), step=step_done, adapter=str(out), modules=n, model=str(model_path),
                rank=lora_cfg.rank, alpha=lora_cfg.alpha)


__all__ = ["RUN_FILE", "RUN_FORMAT", "RUN_VERSION", "LOCK_FILE", "RunError", "RunLockedError", "lock_run_dir",
           "load_config_file", "lora_record",
           "lora_config_from_record", "write_run_record", "find_run_file", "find_checkpoint", "export_adapter"]
