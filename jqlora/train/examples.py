"""Reading training examples: rows of a data source (:mod:`jqlora.train.sources`: JSONL, JSON,
CSV/TSV, Parquet, ``datasets`` folders and cached hub ids) -> validated :class:`Example` objects.

Formats, each recognised by a row's keys (or forced with ``format=``, ``--data-format``):

* ``messages``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``,
  a conversation rendered with the tokenizer's chat template (:mod:`jqlora.tokenizer`); only the
  assistant turns (their text and end-of-turn marker) are training targets. The template writes
  the special tokens: no BOS/EOS is added.
* ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}``:
  each turn's ``from`` goes through the role map (:data:`DEFAULT_ROLE_MAP`, plus
  ``role_map``/``--role-map 'bot=assistant'``), then the conversation is a ``messages`` one. A
  role the map does not name is an error naming it.
* ``alpaca``: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional,
  may be empty), rendered with the Stanford Alpaca prompt (:data:`ALPACA_PROMPT`); the output and
  the EOS after it are training targets.
* ``text``: ``{"text": "..."}``: language modelling; every token after the first is a target.
* ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``: only the completion tokens
  (and the EOS after them) are training targets. Prompt and completion are tokenized separately
  and concatenated, so the boundary is exact.

Other names for the fields: a :class:`Schema` (``text_field``, ``prompt_field``,
``completion_field``, ``messages_field`` of ``TrainConfig``) names the column that holds each; the
column named by ``messages_field`` is read as ShareGPT when its turns have ``from``. A
conversation stored as a JSON string (a CSV or Parquet cell) is decoded.

Other keys on a row are ignored. A row that is not an object, has the keys of no format or of
two, has a field of the wrong type, an empty ``text``/``completion``/``output``/message content,
or a conversation without an assistant turn raises :class:`DataError` naming the file and row
(``data.jsonl, line 3``; ``chat.csv, row 12 (line 13)``).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

from jqlora.errors import SettingError

from .sources import DataError, json_cell, read_rows

__all__ = [
    "DataError",
    "FORMATS",
    "ALPACA_PROMPT",
    "DEFAULT_ROLE_MAP",
    "Example",
    "Schema",
    "load_jsonl",
    "parse_example",
    "parse_role_map",
    "read_examples",
]

# The data formats, with the keys that identify each (a line must have the keys of exactly one).
FORMATS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
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


# ShareGPT's speaker names -> chat-template roles; role_map entries add to these or replace them.
DEFAULT_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                    "system": "system", "tool": "tool", "function": "tool"}
# Schema field -> the key it renames to (messages_field: "messages" or "conversations", by its turns)
_FIELD_KEYS = {"text_field": "text", "prompt_field": "prompt", "completion_field": "completion",
               "messages_field": "messages"}


def parse_role_map(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"bot=assistant,observation=tool"`` (or a dict) -> :data:`DEFAULT_ROLE_MAP` with those
    entries added. Raises :class:`SettingError` on a malformed entry."""
    out = dict(DEFAULT_ROLE_MAP)
    if spec is None:
        return out
    if isinstance(spec, str):
        pairs = []
        for item in filter(None, (x.strip() for x in spec.split(","))):
            src, eq, dst = item.partition("=")
            if not eq:
                raise SettingError(f"role_map: expected 'from=to' pairs separated by commas, got {item!r} "
                                   f"in {spec!r}")
            pairs.append((src.strip(), dst.strip()))
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        raise SettingError(f"role_map must be 'from=to,...' or a dict, got {type(spec).__name__}")
    for src, dst in pairs:
        if not (isinstance(src, str) and isinstance(dst, str) and src and dst):
            raise SettingError(f"role_map: {src!r}={dst!r}: both sides must be non-empty names")
        out[src] = dst
    return out


@dataclasses.dataclass(frozen=True)
class Schema:
    """Which column holds each field when a source names them otherwise (None: the usual name),
    and the role map of ShareGPT turns. :meth:`from_config` reads ``TrainConfig``'s fields."""

    text_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None
    role_map: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ROLE_MAP))

    @classmethod
    def from_config(cls, config) -> "Schema":
        """The schema of a ``TrainConfig`` (or anything with its ``*_field`` / ``role_map``
        attributes); checks the role map."""
        fields = {}
        for f in _FIELD_KEYS:
            v = getattr(config, f, None)
            if v is not None and (not isinstance(v, str) or not v):
                raise SettingError(f"{f} must be a column name, got {v!r}")
            fields[f] = v
        return cls(**fields, role_map=parse_role_map(getattr(config, "role_map", None)))

    def renames(self) -> dict[str, str]:
        """{column: the field it holds} for the fields given."""
        return {getattr(self, f): key for f, key in _FIELD_KEYS.items() if getattr(self, f)}

    def apply(self, obj: dict, where: str) -> dict:
        """``obj`` with the named columns under their fields' keys; a column with a field's usual
        name that the schema moved elsewhere is dropped (it is not that field)."""
        renames = self.renames()
        if not renames:
            return obj
        moved = set(renames.values())
        out = {k: v for k, v in obj.items() if k not in renames and k not in moved}
        for column, key in renames.items():
            if column in obj:
                v = obj[column]
                if key == "messages":
                    v = json_cell(v, where, column)
                    if _is_sharegpt(v):
                        key = "conversations"
                out[key] = v
        return out

    def describe(self) -> str:
        return ", ".join(f"{key}={col}" for col, key in self.renames().items())


def _is_sharegpt(turns: Any) -> bool:
    return isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and "from" in turns[0]


@dataclasses.dataclass(frozen=True)
class Example:
    """One parsed row: ``text``, or ``prompt`` + ``completion`` (also what an Alpaca row
    becomes), or ``messages`` (also what a ShareGPT row becomes). ``format`` is the row's format
    (a key of :data:`FORMATS`); ``line`` its 1-based line or row number, ``location`` the name
    errors give it (``"data.csv, row 3 (line 4)"``)."""

    source: str
    line: int
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict, ...] | None = None
    format: str = ""
    location: str = ""

    @property
    def where(self) -> str:
        return self.location or f"{self.source}, line {self.line}"


# ----------------------------------------------------------------------------------------------
# rows -> examples
# ----------------------------------------------------------------------------------------------

def _detect_format(obj: dict, where: str, schema: Schema | None = None) -> str:
    found = [f for f, keys in FORMATS.items() if any(k in obj for k in keys)]
    if len(found) == 1:
        return found[0]
    if not found:
        mapped = f"; columns mapped: {schema.describe()}" if schema is not None and schema.renames() else ""
        raise DataError(f"{where}: no known format: needs a 'text' field, 'prompt' and "
                        f"'completion', 'instruction' and 'output', 'messages' or 'conversations' "
                        f"(found keys: {sorted(obj)}{mapped}); name other columns with "
                        f"text_field, prompt_field, completion_field or messages_field")
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


def _turn_list(obj: dict, key: str, where: str) -> list:
    """A conversation's list of turns (a JSON string of one, from a CSV or Parquet cell, decoded)."""
    turns = json_cell(obj.get(key), where, key)
    if not isinstance(turns, list):
        raise DataError(f"{where}: '{key}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise DataError(f"{where}: '{key}' is empty")
    return turns


def _checked_turns(turns: list, where: str, noun: str, keys: tuple[str, str]) -> None:
    """Each turn an object with string ``keys`` (speaker, text), the text not blank."""
    who, text = keys
    for j, t in enumerate(turns, start=1):
        if not isinstance(t, dict):
            raise DataError(f"{where}: {noun} {j} must be an object, got {type(t).__name__}")
        for field in keys:
            if field not in t:
                raise DataError(f"{where}: {noun} {j} has no '{field}'")
            if not isinstance(t[field], str):
                raise DataError(f"{where}: {noun} {j} '{field}' must be a string, got "
                                f"{type(t[field]).__name__}")
        if not t[text].strip():
            raise DataError(f"{where}: {noun} {j} ({t[who]}) has empty content")


def _messages(obj: dict, where: str) -> tuple[dict, ...]:
    msgs = _turn_list(obj, "messages", where)
    _checked_turns(msgs, where, "message", ("role", "content"))
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message (nothing to train on); roles: "
                        f"{[m['role'] for m in msgs]}")
    return tuple(msgs)


def _conversations(obj: dict, where: str, role_map: Mapping[str, str]) -> tuple[dict, ...]:
    """ShareGPT turns (``from``/``value``; ``role``/``content`` taken too) -> messages, each
    speaker through ``role_map``."""
    turns = _turn_list(obj, "conversations", where)
    keys = ("role", "content") if isinstance(turns[0], dict) and "from" not in turns[0] else ("from", "value")
    _checked_turns(turns, where, "conversation turn", keys)
    msgs = []
    for j, t in enumerate(turns, start=1):
        role = role_map.get(t[keys[0]])
        if role is None:
            raise DataError(f"{where}: conversation turn {j} is from {t[keys[0]]!r}, a role the role "
                            f"map does not name (it maps {', '.join(sorted(role_map))}); map it with "
                            f"role_map (--role-map '{t[keys[0]]}=assistant')")
        msgs.append({"role": role, "content": t[keys[1]]})
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no turn maps to 'assistant' (nothing to train on); speakers: "
                        f"{[t[keys[0]] for t in turns]}; map one with role_map (--role-map)")
    return tuple(msgs)


def parse_example(obj: Any, *, source: str = "<data>", line: int = 0,
                  format: str = "auto", where: str | None = None,
                  schema: Schema | None = None) -> Example:
    """Validate one row; raise :class:`DataError` naming where it is.

    Args:
      obj: the row (a dict).
      source, line: where it comes from; ``where`` (``"x.csv, row 3 (line 4)"``) replaces the
        ``"source, line N"`` the messages give it otherwise.
      format: "auto" (from the keys) or a key of :data:`FORMATS`.
      schema: other column names, and the role map of ShareGPT turns (default: the usual names
        and :data:`DEFAULT_ROLE_MAP`).
    """
    where = where or f"{source}, line {line}"
    if format != "auto" and format not in FORMATS:
        raise SettingError(f"data format must be 'auto' or one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if schema is not None:
        obj = schema.apply(obj, where)
    fmt = _detect_format(obj, where, schema) if format == "auto" else format
    at = dict(location=where, format=fmt)
    if fmt in ("messages", "sharegpt"):
        key = FORMATS[fmt][0]
        if key not in obj:
            raise DataError(f"{where}: missing field '{key}' (data format '{fmt}')")
        msgs = (_messages(obj, where) if fmt == "messages" else
                _conversations(obj, where, schema.role_map if schema is not None else DEFAULT_ROLE_MAP))
        return Example(source, line, messages=msgs, **at)
    if fmt == "text":
        return Example(source, line, text=_string(obj, "text", where, fmt), **at)
    if fmt == "alpaca":
        instruction = _string(obj, "instruction", where, fmt)
        inp = _string(obj, "input", where, fmt, required=False, nonempty=False)
        output = _string(obj, "output", where, fmt)
        has_input = bool(inp and inp.strip())
        prompt = ALPACA_PROMPT[has_input].format(instruction=instruction, input=inp)
        return Example(source, line, prompt=prompt, completion=output, **at)
    prompt = _string(obj, "prompt", where, fmt, nonempty=False)
    completion = _string(obj, "completion", where, fmt)
    return Example(source, line, prompt=prompt, completion=completion, **at)


def read_examples(path: str | os.PathLike, *, format: str = "auto", schema: Schema | None = None,
                  split: str | None = None) -> Iterator[Example]:
    """The validated examples of a data source (any :func:`jqlora.train.sources.read_rows`
    takes), lazily. Raises :class:`DataError` naming the file and row of the first bad one."""
    if format != "auto" and format not in FORMATS:
        raise SettingError(f"data format must be 'auto' or one of {', '.join(FORMATS)}, got {format!r}")
    for i, (where, obj) in enumerate(read_rows(path, split=split), start=1):
        yield parse_example(obj, source=str(path), line=i, format=format, where=where, schema=schema)


def load_jsonl(path: str | os.PathLike, format: str = "auto", *, schema: Schema | None = None,
               split: str | None = None) -> list[Example]:
    """Every example of a data source, in a list (:func:`read_examples`; the name is from when
    JSONL was the one format). Raises :class:`DataError` naming the file and row."""
    return list(read_examples(path, format=format, schema=schema, split=split))
