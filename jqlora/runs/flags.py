"""TrainConfig's fields as flags: each field's type, its flag name, and a flag's text parsed by that
type (what `jqlora train` and a run's layered settings read)."""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Union

from jqlora.runs.config_file import RunError
from jqlora.train.config import TrainConfig


@functools.cache
def train_field_types() -> dict[str, Any]:
    """TrainConfig's field name -> its type (`typing.get_type_hints`: `int`, `float | None`,
    `bool | str`, `Any`), in field order."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _type_args(hint) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union \
        else (hint,)


def type_name(hint) -> str:
    """A TrainConfig field type as its annotation spells it: "int", "float | None", "Any"."""
    if hint is Any:
        return "Any"
    return " | ".join("None" if a is type(None) else a.__name__ for a in _type_args(hint))


def is_switch(hint) -> bool:
    """Whether a TrainConfig field is an on/off switch (`bool` or `bool | None`): a --x/--no-x flag."""
    return set(_type_args(hint)) - {type(None)} == {bool}


def flag_name(key: str) -> str:
    """The flag of a setting: `seq_len` -> `--seq-len`."""
    return "--" + key.replace("_", "-")


def parse_flag(key: str, text: str):
    """The value of the flag of TrainConfig field `key` from its text, by the field's type:
    `none`/`null` is None where the field may be None; true/false, yes/no, on/off, 1/0 where it is
    a bool; an int or float where it is one; the text where it may be a string. `bos`/`eos`
    (`Any`): 'auto', true/false, none, a token id or a token string.

    Raises:
      RunError: the text is none of what the field takes ("--seq-len: cannot parse 'x' as int").
    """
    hint = train_field_types()[key]
    low = text.lower()
    if hint is Any:
        if low in ("none", "null", "false"):
            return None
        if low == "true":
            return True
        return int(text) if text.lstrip("-").isdigit() else text
    kinds = _type_args(hint)
    if type(None) in kinds and low in ("none", "null"):
        return None
    if bool in kinds and low in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return low in ("true", "yes", "on", "1")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                if str not in kinds:
                    break
    if str in kinds:
        return text
    raise RunError(f"{flag_name(key)}: cannot parse {text!r} as {type_name(hint)}")
