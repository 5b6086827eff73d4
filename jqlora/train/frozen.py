"""`frozen_jit`: jit a function of NNX objects whose frozen weights are inputs only.

`nnx.jit` returns the whole state of every object it is given, so that Python-side updates
propagate. For a model whose frozen weights (`FrozenParam`: packed 4-bit/int8 bases, embeddings,
norms) never change, that makes every frozen array an output too, and XLA copies each one into a
fresh output buffer on every call: one extra copy of the model at the step's peak
(`compiled.memory_analysis()` shows an output size equal to the argument size). Here the objects are split once per call into
(frozen | everything else); the frozen part goes in as a plain argument and is never returned,
and only the rest (LoRA params, optimizer state, RNG counts) is written back.

Writes to a `FrozenParam` inside the function are not propagated (they are frozen by contract).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx

from jqlora import lowered_cache
from jqlora.lora.linear import FrozenParam

__all__ = ["frozen_jit"]


def _has_hooks_or_ref(variable) -> bool:
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    return bool(meta.get("on_set_value")) or bool(meta.get("ref")) or bool(meta.get("hijax"))


def _paths_and_variables(state) -> tuple[tuple, tuple]:
    """(paths, Variables) of a State, in its flat (sorted-path) order."""
    flat = list(nnx.to_flat_state(state))
    return tuple(p for p, _ in flat), tuple(v for _, v in flat)


def frozen_jit(fn: Callable, *, nodes: int = 1, donate: bool = False) -> Callable:
    """Compile ``fn(*objects, *arrays)``; the first `nodes` positional arguments are NNX objects.

    donate: donate the non-frozen state (LoRA params, optimizer state) so XLA updates it in
    place; arrays of that state taken before the call are invalid afterwards. The frozen weights
    are never donated (a caller may share them with another model).
    Returns a callable with the same signature; ``.lower(*args)`` gives the `jax.stages.Lowered`
    of the pure function (for `memory_analysis`), and ``.bind(*objects)`` a callable of the
    remaining arguments that skips the per-call graph traversal (for loops over many steps).
    """
    if nodes < 1:
        raise ValueError(f"frozen_jit: nodes must be >= 1, got {nodes}")

    def pure(graphdef, frozen, mutable, *rest):
        objects = nnx.merge(graphdef, frozen, mutable)
        out = fn(*objects, *rest)
        return nnx.state(objects, nnx.Not(FrozenParam)), out

    jitted = jax.jit(pure, static_argnums=0, donate_argnums=(2,) if donate else ())

    def split(args):
        if len(args) < nodes:
            raise TypeError(f"{fn.__name__}: expected at least {nodes} NNX objects, got {len(args)} arguments")
        objects = tuple(args[:nodes])
        graphdef, frozen, mutable = nnx.split(objects, FrozenParam, ...)
        return objects, (graphdef, frozen, mutable, *args[nodes:])

    @functools.wraps(fn)
    def wrapper(*args):
        objects, pure_args = split(args)
        new_mutable, out = jitted(*pure_args)
        nnx.update(objects, new_mutable)
        return out

    def bind(*objects):
        """``fn`` with its NNX objects bound: ``bound(*arrays)`` is ``wrapper(*objects, *arrays)``
        without the per-call graph traversal.

        `nnx.split` and `nnx.update` walk the whole object graph on every call: host time that
        grows with the number of Variables, during which the device waits whenever the caller
        reads a result each step. A bound step splits once, keeps the
        live `Variable`s, and per call only reads their values and writes the new ones back.
        Contract (as with `nnx.cached_partial`): the objects' structure and static attributes
        (for example train/eval mode) are those at bind time; bind again after changing them.
        Variable values, frozen or not, may change between calls and are read afresh.
        """
        if len(objects) != nodes:
            raise TypeError(f"{fn.__name__}: bind takes exactly {nodes} NNX objects, got {len(objects)}")
        graphdef, frozen, mutable = nnx.split(tuple(objects), FrozenParam, ...)
        paths, live = _paths_and_variables(mutable)
        bound_jit = _bound_jit(graphdef, paths)

        # set_value copies the value tree and runs hooks, per Variable per call; plain Variables
        # (no hooks, no array refs: every one in jqlora's models) take the raw assignment.
        setters = [v.set_value if _has_hooks_or_ref(v) else v.set_raw_value for v in live]

        @functools.wraps(fn)
        def bound(*rest):
            args = (frozen, mutable, *rest)
            new_values, out = lowered_cache.call(
                _flat_pure, args, static={"graphdef": graphdef, "paths": paths}, name=fn.__name__,
                fallback=lambda: bound_jit(*args), donate_argnums=(1,) if donate else ())
            for set_, value in zip(setters, new_values):
                set_(value)
            return out

        bound.lower = lambda *rest: bound_jit.lower(frozen, mutable, *rest)
        return bound

    @functools.lru_cache(maxsize=8)  # binds of equal structure share one compiled step
    def _bound_jit(graphdef, paths):
        return jax.jit(functools.partial(_flat_pure, graphdef=graphdef, paths=paths),
                       donate_argnums=(1,) if donate else ())

    def _flat_pure(frozen, mutable, *rest, graphdef, paths):
        objects = nnx.merge(graphdef, frozen, mutable)
        out = fn(*objects, *rest)
        new_paths, new_vars = _paths_and_variables(nnx.state(objects, nnx.Not(FrozenParam)))
        if new_paths != paths:  # checked once, at trace time
            raise ValueError(f"{fn.__name__} changed the structure of its non-frozen state; a bound "
                             "step needs the same variables after the call as before")
        return [v.get_value() for v in new_vars], out

    wrapper.lower = lambda *args: jitted.lower(*split(args)[1])
    wrapper.bind = bind
    return wrapper
