"""Reading a JSON file whose top level must be an object: the one place that does "open, decode
UTF-8, parse, check the top level" for every small JSON file jqlora reads (``config.json``,
``adapter_config.json``, a shard index, ``tokenizer_config.json``, ``generation_config.json``, a
training checkpoint's ``state.json``).

Each caller raises its own error class with its own wording, so the messages are templates the
caller passes: ``{path}`` is the file as the caller gave it (a str, or a :class:`~pathlib.Path`,
whose ``{path.parent}`` works), ``{error}`` the exception caught, ``{type}`` the type name of a top
level that is not an object.

Pure standard library.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["read_json_object"]


def read_json_object(path: str | os.PathLike, error: type[Exception], *, missing: str | None = None,
                     unreadable: str = "{path}: cannot read: {error}", invalid: str | None = None,
                     not_object: str = "{path}: expected a JSON object, got {type}") -> dict:
    """Parse the JSON object in the file `path`, or raise ``error(message)`` saying what is wrong.

    Args:
      path: the file.
      error: the exception class raised (called with the message only).
      missing: the message when `path` is not a file; None: such a path fails to open and gets
        `unreadable`.
      unreadable: the message when the file cannot be read (an OSError), is not UTF-8, or holds
        a value Python cannot convert (an integer too long).
      invalid: the message when the text is not JSON (``{error}`` is the json.JSONDecodeError:
        ``{error.lineno}``, ``{error.colno}`` and ``{error.msg}`` work); None: `unreadable`.
      not_object: the message when the top level is not an object.

    Returns:
      The parsed object (a dict).
    """
    file = Path(path)
    if missing is not None and not file.is_file():
        raise error(missing.format(path=path))
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(unreadable.format(path=path, error=e)) from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error((invalid or unreadable).format(path=path, error=e)) from e
    except ValueError as e:  # not a syntax error: e.g. an integer too long to convert
        raise error(unreadable.format(path=path, error=e)) from e
    if not isinstance(data, dict):
        raise error(not_object.format(path=path, type=type(data).__name__))
    return data
