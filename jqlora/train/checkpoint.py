"""Training checkpoints: LoRA params + optimizer state + RNG state + data position + step.

Layout (``directory`` is the checkpoint root, e.g. ``<out_dir>/checkpoints``)::

    directory/step_00000100/arrays.safetensors   every array, flattened key path -> tensor
    directory/step_00000100/state.json           step, data_state, per-key dtype/shape, sha256

Keys are ``lora/<module path>``, ``rng/<module path>`` (``nnx.RngState``: dropout keys/counts) and
``opt/<optimizer state path>``, path parts joined with ``.``. Typed PRNG keys are stored as their
``key_data`` (uint32) with the key implementation in the JSON; dtypes numpy lacks (bfloat16,
float8...) are stored as same-width unsigned ints with the real dtype in the JSON, so any
safetensors reader loads the file. No pickle anywhere. The file is read and written by
:mod:`interop.safetensors_io` (in memory, so that the checksum covers exactly the bytes written
and read).

Writing is atomic (:func:`interop.atomic_io.atomic_directory`): everything goes into a fresh
``.step_XXXXXXXX.tmp-*`` directory beside the target, files and directory are fsynced, then the
directory is renamed to ``step_XXXXXXXX`` (one ``rename``), and the parent is fsynced. Until that
rename, the previous checkpoints are untouched; a failure midway removes the temp directory. Older
checkpoints beyond ``keep`` are pruned only after the new one is in place. One writer per
directory is assumed (``jqlora.train.lock.lock_run_dir`` makes it so for a run): temp directories a
killed writer left behind are removed by :func:`remove_stale_saves` (at the start of a run and on
each save). An OSError while writing (a full disk, a read-only directory) names the checkpoint.

Restoring validates everything (keys, shapes, dtypes, file checksum) before changing the model or
the optimizer, and raises :class:`CheckpointError` naming the file and the offending key.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from interop.atomic_io import atomic_directory, write_bytes_atomic
from interop.errors import CheckpointError as _FileError
from interop.json_io import read_json_object
from interop.safetensors_io import deserialize, serialize
from jqlora.errors import Error

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "restore_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "remove_stale_saves",
    "read_state",
    "NonFiniteStateError",
]

FORMAT = "jqlora-train-checkpoint"
VERSION = 1
ARRAYS_FILE = "arrays.safetensors"
STATE_FILE = "state.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_STALE = (".step_*.tmp-*", ".step_*.old-*", ".tmp-step_*", ".tmp-old-step_*")  # crashed saves
_NATIVE = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16,
                                  np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                                  np.bool_)}


class CheckpointError(Error, ValueError):
    """A checkpoint that is corrupt or does not match the model/optimizer."""


# ----------------------------------------------------------------------------------------------
# flattening
# ----------------------------------------------------------------------------------------------

def _groups(model, optimizer) -> dict[str, Any]:
    groups = {"lora": nnx.state(model, nnx.LoRAParam), "rng": nnx.state(model, nnx.RngState)}
    if optimizer is not None:
        groups["opt"] = nnx.state(optimizer)
    return groups


def _leaf_value(v):
    if isinstance(v, nnx.Variable):
        return v.get_value()
    return v


def _flatten(model, optimizer) -> dict[str, Any]:
    """-> {key: array} (jax arrays, typed keys kept as typed keys)."""
    flat: dict[str, Any] = {}
    for group, state in _groups(model, optimizer).items():
        for path, var in nnx.to_flat_state(state):
            value = _leaf_value(var)
            if value is None or not hasattr(value, "shape"):
                continue  # e.g. optax EmptyState fields: nothing to store
            key = group + "/" + ".".join(str(p) for p in path)
            flat[key] = value
    return flat


def _is_key_array(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_storable(key: str, x) -> tuple[np.ndarray, dict]:
    meta: dict[str, Any] = {}
    if _is_key_array(x):
        meta["key_impl"] = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    arr = np.asarray(jax.device_get(x))
    meta["dtype"] = arr.dtype.name
    meta["shape"] = list(arr.shape)
    if arr.dtype not in _NATIVE:
        arr = arr.view(np.dtype(f"uint{arr.dtype.itemsize * 8}"))
        meta["stored_as"] = arr.dtype.name
    return np.array(arr, order="C", copy=True), meta


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------

def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (``step_*`` dirs with a state.json) under ``directory``, by step."""
    root = Path(directory)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    cks = list_checkpoints(directory)
    return cks[-1][1] if cks else None


def remove_stale_saves(directory: str | os.PathLike) -> list[Path]:
    """Remove the temp directories of checkpoint saves that never finished (a killed or failed
    writer) from the checkpoint root ``directory``; returns what was removed. Only safe while no
    other process writes there (hold ``jqlora.train.lock.lock_run_dir``)."""
    root = Path(directory)
    removed = []
    for pattern in _STALE:
        for stale in root.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


class NonFiniteStateError(CheckpointError):
    """A checkpoint was not written because a LoRA param or optimizer state holds NaN/Inf."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def save_checkpoint(directory: str | os.PathLike, model, optimizer, data_state: dict | None,
                    step: int, *, keep: int | None = None, extra: dict | None = None,
                    require_finite: bool = False) -> Path:
    """Atomically write ``directory/step_{step:08d}``; returns its path.

    Args:
      directory: the checkpoint root (created if missing; stale temp dirs in it are removed).
      model: the model (its ``nnx.LoRAParam`` and ``nnx.RngState`` are stored).
      optimizer: its ``nnx.Optimizer`` (or None).
      data_state: the data iterator's state (JSON-serializable).
      step: the step this checkpoint ends.
      keep: if set, delete all but the newest ``keep`` checkpoints once the new one is in place.
      extra: more JSON-serializable state, stored under ``extra``.
      require_finite: refuse (:class:`NonFiniteStateError`, nothing written) when a floating
        LoRA param or optimizer state holds NaN/Inf: a checkpoint a run may resume from.

    Raises:
      NonFiniteStateError: see ``require_finite``.
      OSError: the write failed; its ``filename`` names the checkpoint.
    """
    root = Path(directory)
    final = root / f"step_{int(step):08d}"
    arrays: dict[str, np.ndarray] = {}
    metas: dict[str, dict] = {}
    for key, value in _flatten(model, optimizer).items():
        arrays[key], metas[key] = _to_storable(key, value)
        if (require_finite and not key.startswith("rng/") and arrays[key].dtype.kind == "f"
                and not np.isfinite(arrays[key]).all()):
            raise NonFiniteStateError(f"{final}: not written: '{key}' holds NaN/Inf", key)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(root)
        return _write(root, final, arrays, metas, data_state, step, keep, extra)
    except OSError as e:
        if e.filename is None and e.errno is not None:  # e.g. ENOSPC from a write(): say which checkpoint
            raise OSError(e.errno, e.strerror, str(final)) from e
        raise


def _write(root: Path, final: Path, arrays, metas, data_state, step, keep, extra) -> Path:
    """The write itself (temp dir, fsync, rename), then pruning beyond ``keep``."""
    state = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "data_state": data_state,
        "extra": extra or {},
        "arrays": metas,
    }
    # re-saving a step (e.g. a resumed run) replaces the old one only once the new one is complete
    with atomic_directory(final, overwrite=True) as tmp:
        blob = serialize(arrays, metadata={"format": FORMAT})
        write_bytes_atomic(tmp / ARRAYS_FILE, blob)
        state["arrays_sha256"] = hashlib.sha256(blob).hexdigest()
        write_bytes_atomic(tmp / STATE_FILE, json.dumps(state, indent=1, sort_keys=True, default=str).encode())
    if keep is not None and keep > 0:
        for _, p in list_checkpoints(root)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def read_state(step_dir: str | os.PathLike) -> dict:
    """The ``state.json`` of one checkpoint directory (``.../step_00000100``), checked: its format,
    its version and the fields every checkpoint has (``step``, ``arrays``, ``arrays_sha256``). The
    one reader of that file: restoring, the training loop (``extra``) and `jqlora.runs` (the run's
    ``train_config`` in ``extra``) take it from here.

    Raises:
      CheckpointError: naming the directory (no state.json) or the file (unreadable, not JSON,
        another format or version, a field missing).
    """
    path = Path(step_dir)
    sfile = path / STATE_FILE
    state = read_json_object(sfile, CheckpointError, missing=f"{{path.parent}}: not a checkpoint (no {STATE_FILE})",
                             unreadable="{path}: corrupt checkpoint state: {error}",
                             not_object=f"{{path}}: not a {FORMAT} file")
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{sfile}: not a {FORMAT} file")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{sfile}: unsupported checkpoint version {state.get('version')}")
    for k in ("step", "arrays", "arrays_sha256"):
        if k not in state:
            raise CheckpointError(f"{sfile}: missing field '{k}'")
    return state


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    state, jfile = read_state(path), path / ARRAYS_FILE
    try:
        blob = jfile.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{jfile}: cannot read: {e}") from None
    if hashlib.sha256(blob).hexdigest() != state["arrays_sha256"]:
        raise CheckpointError(f"{jfile}: checksum mismatch (file corrupt or truncated)")
    try:
        arrays, _ = deserialize(blob, jfile)
    except _FileError as e:
        raise CheckpointError(f"corrupt safetensors file {e}") from None
    return state, arrays


def restore_checkpoint(directory: str | os.PathLike, model, optimizer) -> tuple[dict | None, int]:
    """Load a checkpoint into ``model`` (LoRA params, RNG state) and ``optimizer`` in place.

    ``directory`` is either one checkpoint (``.../step_00000100``) or a root holding ``step_*``
    checkpoints (the latest is used). Returns ``(data_state, step)``. Nothing is modified unless
    the whole checkpoint matches; otherwise :class:`CheckpointError` names the key.
    """
    path = Path(directory)
    if not (path / STATE_FILE).exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        path = latest
    state, arrays = _read(path)
    metas = state["arrays"]
    where = path / ARRAYS_FILE

    groups = _groups(model, optimizer)
    expected = {}
    for group, st in groups.items():
        for p, var in nnx.to_flat_state(st):
            value = _leaf_value(var)
            if value is None or not hasattr(value, "shape"):
                continue
            expected[group + "/" + ".".join(str(x) for x in p)] = (group, p, value)

    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise CheckpointError(f"{where}: missing key '{missing[0]}'"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + ": checkpoint is from a different model/LoRA/optimizer setup")
    unexpected = sorted(set(arrays) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected key '{unexpected[0]}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1
                                 else "")
                              + " not in the model/optimizer: checkpoint is from a different "
                                "model/LoRA/optimizer setup")

    new_flat: dict[str, dict] = {g: {} for g in groups}
    for key, (group, p, current) in expected.items():
        meta = metas.get(key)
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path / STATE_FILE}: no metadata for key '{key}'")
        arr = arrays[key]
        try:
            if "stored_as" in meta:
                arr = arr.view(np.dtype(jnp.dtype(meta["dtype"])))
            if list(arr.shape) != list(meta["shape"]) or arr.dtype.name != meta["dtype"]:
                raise CheckpointError(f"{where}: key '{key}' is {arr.dtype.name}{list(arr.shape)} "
                                      f"but state.json says {meta['dtype']}{meta['shape']}")
        except (TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{where}: key '{key}': bad dtype/shape metadata: {e}") from None
        if _is_key_array(current):
            impl = meta.get("key_impl")
            cur_impl = str(jax.random.key_impl(current))
            if impl != cur_impl:
                raise CheckpointError(f"{where}: key '{key}' is a PRNG key of impl {impl}, "
                                      f"the model's is {cur_impl}")
            cur_data = jax.random.key_data(current)
            if arr.shape != cur_data.shape or arr.dtype != cur_data.dtype:
                raise CheckpointError(f"{where}: key '{key}' has shape {arr.shape}, "
                                      f"expected {tuple(cur_data.shape)}")
            value = jax.random.wrap_key_data(jnp.asarray(arr), impl=impl)
        else:
            if tuple(arr.shape) != tuple(current.shape):
                raise CheckpointError(f"{where}: key '{key}' has shape {tuple(arr.shape)}, "
                                      f"expected {tuple(current.shape)}")
            if arr.dtype != np.dtype(current.dtype):
                raise CheckpointError(f"{where}: key '{key}' has dtype {arr.dtype}, "
                                      f"expected {np.dtype(current.dtype)}")
            value = jnp.asarray(arr)
            sharding = getattr(current, "sharding", None)
            if sharding is not None and isinstance(current, jax.Array):
                value = jax.device_put(value, sharding)
        new_flat[group][p] = value

    for group, st in groups.items():
        flat = nnx.to_flat_state(st)
        upd = [(p, _replace(var, new_flat[group][p])) for p, var in flat if p in new_flat[group]]
        target = optimizer if group == "opt" else model
        nnx.update(target, nnx.from_flat_state(upd))
    return state.get("data_state"), int(state["step"])


def _replace(var, value):
    if isinstance(var, nnx.Variable):
        return var.replace(value)
    return value


def stored_loss_window(checkpoint: Path | None) -> dict | None:
    """The ``loss.csv`` window a checkpoint stored (``MetricsLog.window_state``), or None."""
    if checkpoint is None:
        return None
    try:
        w = (read_state(checkpoint).get("extra") or {}).get("loss_window")
        return w if isinstance(w, dict) else None
    except (ValueError, TypeError, AttributeError):  # CheckpointError is a ValueError
        return None
