"""Shared helpers of the CLI commands: errors, dtypes, quiet third-party logging, config files.

Nothing heavy is imported here: `jqlora --help` must not pay for jax or torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


class CLIError(Exception):
    """A usage or input error: printed as one line, exit status 2 (no traceback)."""


def expected_errors() -> tuple:
    """Exception types that mean "bad input" (exit 2 with the message), not a bug (traceback)."""
    errs: list = [CLIError, ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError,
                  IsADirectoryError, PermissionError]
    return tuple(errs)


def message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


def quiet_third_party() -> None:
    """Silence import-time chatter of bitsandbytes/transformers (warnings about optional kernels,
    progress bars for tiny checkpoints). Real errors still raise."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("bitsandbytes", "transformers", "peft", "accelerate", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:  # only when transformers is importable; never required here
        import transformers  # noqa: PLC0415

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass


def jnp_dtype(name: str):
    import jax.numpy as jnp  # noqa: PLC0415

    if name not in DTYPES:
        raise CLIError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return jnp.dtype(name)


def default_compute_dtype() -> str:
    """float32 on CPU (fast there and exact for cross-checks), bfloat16 on accelerators."""
    import jax  # noqa: PLC0415

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def require_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CLIError(f"{p}: no such {what}")
    if not p.is_dir():
        raise CLIError(f"{p}: not a directory (expected a {what})")
    return p


def load_config_file(path: str | os.PathLike) -> dict:
    """Read a JSON (.json) or TOML (.toml) config file into a dict; errors name the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise CLIError(f"{p}: cannot read config file: {e}") from None
    if p.suffix.lower() == ".toml":
        import tomllib  # noqa: PLC0415

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise CLIError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CLIError(f"{p}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"{p}: top level must be an object/table, got {type(data).__name__}")
    return data


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    from interop.atomic_io import write_text_atomic  # lazily: importing interop pulls in jax

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(p, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the hand-wrapped descriptions/epilogs and shows defaults."""


def eprint(*a, **kw) -> None:
    print(*a, file=sys.stderr, **kw)
