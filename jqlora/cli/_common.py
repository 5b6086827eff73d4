"""What every CLI command shares: the usage error, which exceptions mean "bad input", the help format.

Library errors (`jqlora.runs.RunError`, `interop.CheckpointError`, `jqlora.adapters.AdapterMismatchError`,
...) are ValueErrors: `jqlora.cli.main` prints their message on one line and exits with status 2.
Nothing heavy is imported here: `jqlora --help` must not pay for torch.
"""
from __future__ import annotations

import argparse


class CLIError(Exception):
    """A usage or input error: printed as one line, exit status 2 (no traceback)."""


def expected_errors() -> tuple:
    """Exception types that mean "bad input" (exit 2 with the message), not a bug (traceback)."""
    return (CLIError, ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def message(e: BaseException) -> str:
    """The one-line message of an expected error (a KeyError's key without quotes)."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the hand-wrapped descriptions/epilogs and shows defaults."""
