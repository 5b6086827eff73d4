"""Atomic file and directory writes: the one place that does "temp name, fsync, rename".

Why: invariant 7 of docs/design.md, nothing is ever half-written. A reader (or a crash, or a full disk)
sees either the previous file/directory or the complete new one, never a partial one, and a
failure leaves no temporary litter behind. Every writer in jqlora (safetensors files, bitsandbytes
checkpoint dirs, PEFT adapters, training checkpoints, JSON run records, the lowered-program cache's
entries, without fsync) goes through here.

How: data is written under a hidden temporary name in the *same* directory as the target (so the
final ``os.replace``/``os.rename`` stays on one filesystem and is atomic), fsynced, renamed into
place, and then the parent directory is fsynced so the rename itself is durable.

Pure standard library.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "fsync_dir",
    "fsync_file",
    "tmp_name",
    "atomic_path",
    "write_bytes_atomic",
    "write_text_atomic",
    "write_json_atomic",
    "atomic_directory",
]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (makes renames/creations in it durable); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync a regular file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh hidden name beside `path`: ``.<name>.<kind>-<random>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; the caller writes the file there by any means. On
    success it is fsynced, ``os.replace``d onto `path` and the directory fsynced; on any error
    (including KeyboardInterrupt) the temporary file is removed and `path` is untouched.
    ``fsync=False`` skips both fsyncs: readers still never see a partial file, but a crash may
    lose the write (for a cache, where a lost entry is only a miss)."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        yield tmp
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> Path:
    """Write `data` to `path` atomically (see :func:`atomic_path`, also for `fsync`). Returns the
    path."""
    path = Path(path)
    with atomic_path(path, fsync=fsync) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically (see :func:`atomic_path`). Returns the path."""
    return write_bytes_atomic(path, text.encode(encoding))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON with sorted keys to `path` atomically, creating the parent
    directory if missing. Values JSON does not know (paths, dtypes) are written as their str().

    Args:
      path: the file to write.
      obj: a JSON-serialisable value (after str() of unknown leaves).

    Returns:
      The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `target` to fill. On success its files and itself
    are fsynced, it is renamed to `target` and the parent is fsynced; on any error it is removed
    and `target` is untouched.

    An existing `target` is a FileExistsError (raised before yielding, and again before the
    rename if one appeared meanwhile) unless `overwrite`: then it is moved aside only once the new
    directory is complete, put back if the final rename fails, and deleted after it succeeded.
    The parent directory is created if missing. Files and folders get the mode the umask gives.
    """
    target = Path(target)
    if not overwrite and os.path.lexists(target):
        raise FileExistsError(f"{target} already exists")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: the folder gets the umask's mode (mkdtemp's is 0700, and the
    # rename would hand that to the finished folder)
    tmp = tmp_name(target)
    tmp.mkdir()
    old = None
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.lexists(target):
            if not overwrite:
                raise FileExistsError(f"{target} already exists")
            old = tmp_name(target, "old")
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
                old = None
            raise
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
