"""A config file (`jqlora train --config`) or a run record read into a dict, and `RunError`, the
error of every part of `jqlora.runs`."""
from __future__ import annotations

import json
import os
from pathlib import Path

from jqlora.errors import Error


class RunError(Error, ValueError):
    """A run directory, run record, checkpoint choice, setting or config file that cannot be used;
    the message names the file, directory or setting."""


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
