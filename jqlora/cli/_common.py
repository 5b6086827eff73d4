"""What every CLI command shares: the usage error, which exceptions mean "bad input", the help format.

Library errors (`jqlora.runs.RunError`, `interop.CheckpointError`, `jqlora.adapters.AdapterMismatchError`,
...) and `CLIError` are `jqlora.errors.Error`s: `jqlora.cli.main` prints their message on one line
and exits with status 2, as for a file that is missing or cannot be opened. Any other exception
(a bare ValueError or KeyError included) is a bug and keeps its traceback (exit status 1).
Nothing heavy is imported here: `jqlora --help` must not pay for torch.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from pathlib import Path

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
    """The one-line message of an expected error, in the command line's words (`cli_wording`)."""
    return cli_wording(str(e) or type(e).__name__)


# train()'s arguments that `jqlora train` takes as flags (its TrainConfig fields are flags by name)
_ARGUMENT_FLAGS = {"data": "--data-path", "eval_data": "--eval-data-path", "tokenizer": "--tokenizer-path",
                   "model_path": "--model"}


def cli_wording(text: str) -> str:
    """A library message as a command-line user reads it: `TrainConfig.seq_len` and `seq_len=...`
    become `--seq-len`, `resume=True` becomes `--resume`, `pass data=... or set
    TrainConfig.data_path` becomes `pass --data-path`, `another out_dir` `another --out-dir`.
    Only jqlora's own setting names change; other text (a path, a torch keyword) stays."""
    from jqlora.runs import flag_name, train_field_types

    fields = train_field_types()

    def flag(name: str) -> str | None:
        return flag_name(name) if name in fields else _ARGUMENT_FLAGS.get(name)

    text = re.sub(r"\bTrainConfig\.(\w+)", lambda m: flag(m[1]) or m[0], text)
    text = re.sub(r"(?<![\w./-])(\w+)=(?:True\b|\.\.\.)", lambda m: flag(m[1]) or m[0], text)
    text = re.sub(r"pass (--[\w-]+) or set \1\b", r"pass \1", text)
    return re.sub(r"\banother out_dir\b", "another --out-dir", text)


def model_dir(name: str | os.PathLike, flag: str = "--model") -> Path:
    """The model folder a command's model argument names: a folder, a Hugging Face cache repo
    folder, or a model id `org/name[@revision]` (`jqlora.hub.resolve_model`: the cache, else a
    download). Every command resolves its model arguments here.

    Raises:
      jqlora.hub.ModelNotFoundError: neither a folder nor an id that can be had (the message
        gives the download command)."""
    from jqlora.hub import resolve_model

    return resolve_model(name, what=flag)


QUANTIZE_EXPERTS_CHOICES = ("auto", "none", "nf4", "fp4", "int8")  # load_causal_lm's quantize_experts


def add_quantize_experts(p: argparse.ArgumentParser, default: str) -> None:
    """`--quantize-experts`, for a command whose module (or command object) sets `QUANTIZE_EXPERTS`
    to its default (`jqlora.cli.build_parser` adds it to each such command). Absent from `args`
    when not given (a config file or a run record may set it): read it with `quantize_experts`."""
    p.add_argument("--quantize-experts", dest="quantize_experts", choices=QUANTIZE_EXPERTS_CHOICES,
                   default=argparse.SUPPRESS,
                   help="mixture-of-experts models: the format of expert weights stored dense (bf16). auto: NF4 "
                        "in a quantized checkpoint (transformers + bitsandbytes leave experts in bf16 there, and "
                        "they hold most of a MoE's memory); in a plain one, as its other linear layers (train's "
                        "--quantize). none: keep them as stored; nf4, fp4, int8: that format "
                        f"(default {default})")


def quantize_experts(args: argparse.Namespace, default: str) -> str:
    """The `--quantize-experts` given, else the command's default."""
    return getattr(args, "quantize_experts", default)


@contextlib.contextmanager
def echo_log(name: str):
    """Print logger `name`'s INFO records on stderr, one line each, while the block runs (the
    library logs choices such as `remat: nothing_saveable (predicted ...)`)."""
    logger = logging.getLogger(name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the hand-wrapped descriptions/epilogs and shows defaults."""
