"""Reading training examples: JSONL lines -> validated :class:`Example` objects.

Input formats, one JSON object per line, each recognised by its keys (or forced with
``format=``, ``--data-format``):

* ``messages``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``,
  a conversation rendered with the tokenizer's chat template (:mod:`jqlora.tokenizer`); only the
  assistant turns (their text and end-of-turn marker) are training targets. The template writes
  the special tokens: no BOS/EOS is added.
* ``alpaca``: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional,
  may be empty), rendered with the Stanford Alpaca prompt (:data:`ALPACA_PROMPT`); the output and
  the EOS after it are training targets.
* ``text``: ``{"text": "..."}``: language modelling; every token after the first is a target.
* ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``: only the completion tokens
  (and the EOS after them) are training targets. Prompt and completion are tokenized separately
  and concatenated, so the boundary is exact.

Other keys on a line are ignored. A line that is not valid JSON, is not an object, is blank, has
the keys of no format or of two, has a field of the wrong type, an empty ``text``/``completion``/
``output``/message content, or a conversation without an assistant turn raises
:class:`DataError` naming the file and the 1-based line number.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jqlora.errors import Error, SettingError

__all__ = [
    "DataError",
    "FORMATS",
    "ALPACA_PROMPT",
    "Example",
    "load_jsonl",
    "parse_example",
]

# The data formats, with the keys that identify each (a line must have the keys of exactly one).
FORMATS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "input", "output"),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
}

# The Stanford Alpaca prompts (with and without an input); the output follows "### Response:\n".
ALPACA_PROMPT = {
    True: ("Below is an instruction that describes a task, paired with an input that provides "
           "further context. Write a response that appropriately completes the request.\n\n"
           "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"),
    False: ("Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"),
}


class DataError(Error, ValueError):
    """Bad training data or tokenizer; the message names the file and line where there is one."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One parsed JSONL line: ``text``, or ``prompt`` + ``completion`` (also what an Alpaca line
    becomes), or ``messages``. ``format`` is the line's format (a key of :data:`FORMATS`)."""

    source: str
    line: int
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict, ...] | None = None
    format: str = ""

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------

def _detect_format(obj: dict, where: str) -> str:
    found = [f for f, keys in FORMATS.items() if any(k in obj for k in keys)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DataError(f"{where}: no known format: needs a 'text' field, 'prompt' and "
                        f"'completion', 'instruction' and 'output', or 'messages' "
                        f"(found keys: {sorted(obj)})")
    keys = " and ".join(f"{f} ({', '.join(repr(k) for k in FORMATS[f] if k in obj)})" for f in found)
    raise DataError(f"{where}: has the keys of {'both' if len(found) == 2 else 'several'} "
                    f"formats, {keys}; use one format per line")


def _string(obj: dict, field: str, where: str, fmt: str, *, required=True, nonempty=True) -> str | None:
    if field not in obj:
        if required:
            need = " and ".join(repr(k) for k in FORMATS[fmt] if k != "input")
            raise DataError(f"{where}: missing field '{field}' (the {fmt} format needs {need})")
        return None
    v = obj[field]
    if not isinstance(v, str):
        raise DataError(f"{where}: '{field}' must be a string, got {type(v).__name__}")
    if nonempty and not v.strip():
        raise DataError(f"{where}: '{field}' is empty")
    return v


def _messages(obj: dict, where: str) -> tuple[dict, ...]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise DataError(f"{where}: 'messages' must be a list, got {type(msgs).__name__}")
    if not msgs:
        raise DataError(f"{where}: 'messages' is empty")
    for j, m in enumerate(msgs, start=1):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {j} must be an object, got {type(m).__name__}")
        for field in ("role", "content"):
            if field not in m:
                raise DataError(f"{where}: message {j} has no '{field}'")
            if not isinstance(m[field], str):
                raise DataError(f"{where}: message {j} '{field}' must be a string, got "
                                f"{type(m[field]).__name__}")
        if not m["content"].strip():
            raise DataError(f"{where}: message {j} ({m['role']}) has empty content")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message (nothing to train on); roles: "
                        f"{[m['role'] for m in msgs]}")
    return tuple(msgs)


def parse_example(obj: Any, *, source: str = "<data>", line: int = 0,
                  format: str = "auto") -> Example:
    """Validate one decoded JSON value; raise :class:`DataError` naming ``source:line``.

    Args:
      obj: the decoded line.
      source, line: where it comes from (for messages).
      format: "auto" (from the keys) or a key of :data:`FORMATS`.
    """
    where = f"{source}, line {line}"
    if format != "auto" and format not in FORMATS:
        raise SettingError(f"data format must be 'auto' or one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fmt = _detect_format(obj, where) if format == "auto" else format
    if fmt == "messages":
        if "messages" not in obj:
            raise DataError(f"{where}: missing field 'messages' (data format 'messages')")
        return Example(source, line, messages=_messages(obj, where), format=fmt)
    if fmt == "text":
        return Example(source, line, text=_string(obj, "text", where, fmt), format=fmt)
    if fmt == "alpaca":
        instruction = _string(obj, "instruction", where, fmt)
        inp = _string(obj, "input", where, fmt, required=False, nonempty=False)
        output = _string(obj, "output", where, fmt)
        has_input = bool(inp and inp.strip())
        prompt = ALPACA_PROMPT[has_input].format(instruction=instruction, input=inp)
        return Example(source, line, prompt=prompt, completion=output, format=fmt)
    prompt = _string(obj, "prompt", where, fmt, nonempty=False)
    completion = _string(obj, "completion", where, fmt)
    return Example(source, line, prompt=prompt, completion=completion, format=fmt)


def load_jsonl(path: str | os.PathLike, format: str = "auto") -> list[Example]:
    """Read and validate a JSONL file. Raises :class:`DataError` naming the file and line number.

    A final newline is fine; any other blank line is an error (it usually means a broken file).

    Args:
      path: the JSONL file.
      format: "auto" (each line's format from its keys) or a key of :data:`FORMATS`.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e}") from e
    examples = []
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # trailing newline
    for i, bline in enumerate(lines, start=1):
        where = f"{path}, line {i}"
        try:
            sline = bline.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 ({e})") from None
        if sline.endswith("\r"):
            sline = sline[:-1]
        if not sline.strip():
            raise DataError(f"{where}: empty line")
        try:
            obj = json.loads(sline)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        examples.append(parse_example(obj, source=str(path), line=i, format=format))
    if not examples:
        raise DataError(f"{path}: no examples (file is empty)")
    return examples
