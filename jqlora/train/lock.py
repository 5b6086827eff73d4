"""The writer lock of a run directory: one process writes to an ``out_dir`` at a time.

`lock_run_dir` holds an exclusive `flock` on ``<out_dir>/jqlora.lock``, released by the OS however
the holder ends (kill -9 included). Training takes it (`jqlora.train.train(lock=True)`), and so does
the CLI for the whole command, before anything is written.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from jqlora.errors import Error

LOCK_FILE = "jqlora.lock"


class RunLockedError(Error, RuntimeError):
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


__all__ = ["LOCK_FILE", "RunLockedError", "lock_run_dir"]
