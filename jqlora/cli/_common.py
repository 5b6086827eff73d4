"""What every CLI command shares: the usage error, which exceptions mean "bad input", the help format.

Library errors (`jqlora.runs.RunError`, `interop.CheckpointError`, `jqlora.adapters.AdapterMismatchError`,
...) and `CLIError` are `jqlora.errors.Error`s: `jqlora.cli.main` prints their message on one line
and exits with status 2, as for a file that is missing or cannot be opened. Any other exception
(a bare ValueError or KeyError included) is a bug and keeps its traceback (exit status 1).
Nothing heavy is imported here: `jqlora --help` must not pay for torch.
"""
from __future__ import annotations

import argparse

from jqlora.errors import Error


class CLIError(Error):
    """A usage or input error: printed as one line, exit status 2 (no traceback)."""


def expected_errors() -> tuple:
    """Exception types that mean "bad input" (exit 2 with the message), not a bug (traceback)."""
    return (Error, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


_DISK_ERRNOS = {"ENOSPC": "no space left on device", "EDQUOT": "disk quota exceeded",
                "EROFS": "read-only file system", "EACCES": "permission denied", "EPERM": "operation not permitted"}


def disk_error(e: OSError) -> CLIError | None:
    """The one-line CLIError for a write that the disk refused (full, quota, read-only, no
    permission), naming the path; None for any other OSError.

    Args:
      e: the error, whose ``filename`` names the path where the writer knew it.
    """
    import errno

    names = {getattr(errno, n): text for n, text in _DISK_ERRNOS.items() if hasattr(errno, n)}
    if e.errno not in names:
        return None
    where = e.filename if e.filename is not None else "(path not reported)"
    return CLIError(f"{where}: {names[e.errno]} ({e.strerror or errno.errorcode.get(e.errno, e.errno)}); "
                    "files already there were left as they were")


def message(e: BaseException) -> str:
    """The one-line message of an expected error."""
    return str(e) or type(e).__name__


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the hand-wrapped descriptions/epilogs and shows defaults."""
