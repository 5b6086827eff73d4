"""GRPO's reward functions: loaded from ``module:function`` (an importable module) or
``path/to/file.py:function``, and called with TRL's convention::

    f(prompts=[...], completions=[...], **fields) -> list of floats, one per completion

``prompts`` holds each completion's prompt as the data row gives it (a string, or a list of
messages), ``completions`` the completion text (for a conversation prompt: ``[{"role":
"assistant", "content": text}]``, as TRL passes it), and every other field of the data rows
comes as a keyword argument holding one value per completion. A function that cannot be loaded,
raises, returns something other than one finite number per completion (None included) is a
:class:`RewardError` naming it.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jqlora.errors import Error

__all__ = ["RewardError", "RewardFunction", "load_reward", "load_rewards", "score"]


class RewardError(Error, ValueError):
    """A reward function that cannot be loaded or that returned what GRPO cannot use."""


class RewardFunction:
    """A loaded reward function: ``spec`` as given, ``name`` (the function's ``__name__``, TRL's
    metric name), ``fn`` the callable."""

    def __init__(self, spec: str, fn: Callable):
        self.spec, self.fn = spec, fn
        self.name = getattr(fn, "__name__", None) or spec.rpartition(":")[2]

    def __repr__(self) -> str:
        return f"RewardFunction({self.spec!r})"


def _module(spec: str, target: str):
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise RewardError(f"reward {spec}: no such file {path}")
        name = f"_jqlora_reward_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise RewardError(f"reward {spec}: cannot import module {target!r}: {e}") from None
    except Exception as e:
        raise RewardError(f"reward {spec}: importing {target} failed: {type(e).__name__}: {e}") from None


def load_reward(spec) -> RewardFunction:
    """``"module:function"``, ``"file.py:function"`` or a callable -> :class:`RewardFunction`."""
    if callable(spec):
        return RewardFunction(getattr(spec, "__name__", repr(spec)), spec)
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardError(f"reward {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    target, _, name = spec.rpartition(":")
    module = _module(spec, target)
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardError(f"reward {spec}: {target} has no function {name!r}")
    if not callable(fn):
        raise RewardError(f"reward {spec}: {name} is a {type(fn).__name__}, not a function")
    return RewardFunction(spec, fn)


def load_rewards(specs: Sequence) -> list[RewardFunction]:
    sys.path_importer_cache.clear()  # modules written since start-up are found
    return [load_reward(s) for s in specs]


def score(funcs: Sequence[RewardFunction], prompts: list, completions: list, fields: dict[str, list]
          ) -> np.ndarray:
    """(completions, functions) float32 rewards; a function's failure is a :class:`RewardError`."""
    n = len(completions)
    out = np.zeros((n, len(funcs)), np.float32)
    for j, f in enumerate(funcs):
        try:
            values = f.fn(prompts=prompts, completions=completions, **fields)
        except Exception as e:
            raise RewardError(f"reward function {f.spec} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {f.spec} returned a {type(values).__name__}, not a "
                              f"list of {n} numbers") from None
        if len(values) != n:
            raise RewardError(f"reward function {f.spec} returned {len(values)} values for {n} completions")
        for i, v in enumerate(values):
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"reward function {f.spec} returned {v!r} for completion {i + 1}: "
                                  "not a number") from None
            if not math.isfinite(x):
                raise RewardError(f"reward function {f.spec} returned {x} for completion {i + 1} "
                                  f"(prompt {prompts[i]!r})")
            out[i, j] = x
    return out
