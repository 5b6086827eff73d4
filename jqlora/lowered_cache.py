"""Programs stored lowered, keyed by their traced form, so that a warm start skips JAX's lowering.

JAX's persistent compilation cache (`jqlora.compile_cache`) keys a program by its lowered
(StableHLO) form: every process lowers every program before it can look the executable up. For
generation on a GPU that lowering is 2-3 s of every warm `jqlora generate` (the Mosaic GPU kernels
are lowered again each time; docs/training.md, compilation cache). This cache stores the lowered
program (`jax.export`, serialized) beside JAX's cache, under a hash of everything lowering reads:
the traced jaxpr as printed (every primitive and its parameters, Pallas kernel bodies included) and
its constants' bytes, the nested jaxprs the printer leaves out (a Pallas kernel's index maps), a
hash of jqlora's and pallas_kernels' sources, the argument types, the jax and jaxlib versions, the
backend, the device kind and the JAX options that lowering consults. A hit deserializes the program
and runs `jax.jit(exported.call)`, whose compilation JAX's own cache then finds. A changed program
hashes differently: it is a miss, never a stale hit.

`call(fun, args, static=..., fallback=...)` runs `fun(*args, **static)` compiled, with that cache
in front. It is active only when JAX's persistent cache is on (`jax_compilation_cache_dir` set:
the CLI does it), `jax.export` can serialize (it needs `flatbuffers`) and the arguments live on one
device; otherwise it returns `fallback()` (the caller's own `jax.jit` of `fun`), and when exporting
fails it runs plain `jax.jit`. Each signature is traced once per process, as `jax.jit` does. The
program takes the flat arguments, but its outputs keep their pytree types: a custom type among them
needs `jax.export.register_pytree_node_serialization` (`jqlora.models.cache` registers KVCache,
which the rollout programs return), else the program is not stored.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from jax.extend import core as jex_core

log = logging.getLogger(__name__)

SUBDIR = "lowered"  # under JAX's compilation cache directory
SUFFIX = ".exported"
# JAX options read while lowering (not visible in the jaxpr).
_LOWERING_OPTIONS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_use_shardy_partitioner")


def cache_dir() -> Optional[Path]:
    """`<JAX's persistent cache directory>/lowered`, or None when that cache is off."""
    base = jax.config.jax_compilation_cache_dir
    return Path(base) / SUBDIR if base else None


@functools.lru_cache(maxsize=1)
def _serialization_available() -> bool:
    try:
        from jax._src.export import serialization  # noqa: F401, PLC0415  (needs flatbuffers)
    except ImportError:
        return False
    return True


def _one_device(leaves) -> bool:
    devices = set()
    for a in leaves:
        if isinstance(a, jax.Array):
            if len(a.sharding.device_set) != 1:
                return False
            devices |= a.sharding.device_set
    return len(devices) <= 1


def _hidden_jaxprs(value, inside_object: bool = False, depth: int = 0):
    """(jaxpr, printed) pairs held in an equation parameter. Jaxprs that are parameters themselves
    (scan, while and cond bodies, a Pallas kernel's body) appear in the program's printed text;
    jaxprs inside other objects (a Pallas GridMapping's index maps) do not: printed=False."""
    if depth > 5 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr, not inside_object
    elif isinstance(value, jex_core.Jaxpr):
        yield value, not inside_object
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _hidden_jaxprs(v, inside_object, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _hidden_jaxprs(getattr(value, f.name, None), True, depth + 1)


def _describe(jaxpr, out: list, seen: set, printed: bool = False) -> None:
    """The program as text: the printed jaxpr, plus every nested jaxpr the printer leaves out."""
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    if not printed:
        out.append(str(jaxpr))
    for eqn in jaxpr.eqns:
        for v in eqn.params.values():
            for sub, shown in _hidden_jaxprs(v):
                _describe(sub, out, seen, printed=shown)


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """A hash of jqlora's and pallas_kernels' Python sources: an edited kernel or model is a new
    program even where a jaxpr shows it only by name (callbacks, custom rules)."""
    h = hashlib.sha256()
    roots = [Path(__file__).resolve().parent]
    try:
        import pallas_kernels  # noqa: PLC0415

        roots.append(Path(pallas_kernels.__file__).resolve().parent)
    except ImportError:
        pass
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root.parent)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def program_key(closed: jex_core.ClosedJaxpr, in_tree, name: str) -> str:
    """The hex digest naming a traced program: what its lowering depends on."""
    h = hashlib.sha256()
    from jax import version as jax_version  # noqa: PLC0415

    import jaxlib  # noqa: PLC0415

    device = jax.devices()[0]
    texts: list = []
    _describe(closed.jaxpr, texts, set())
    for part in (name, _source_digest(), jax_version.__version__, getattr(jaxlib, "__version__", ""),
                 jax.default_backend(), device.device_kind, str(in_tree),
                 *(f"{o}={getattr(jax.config, o)}" for o in _LOWERING_OPTIONS if hasattr(jax.config, o)),
                 str(closed.in_avals), str(closed.out_avals), *texts):
        h.update(part.encode())
        h.update(b"\0")
    for c in closed.consts:
        a = np.asarray(c)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _slot(key) -> dict:
    """One holder per (function, statics, signature, directory): the runnable program, once made."""
    return {}


def _make(fun: Callable, static: Mapping[str, Any], leaves: list, in_tree, directory: Path, name: str,
          donate: tuple) -> Callable:
    """The runnable program of the flat arguments: a stored lowering, a new one (stored), or plain jit.
    The program takes the leaves (exported programs keep no custom pytree types)."""
    def flat(*xs):
        return fun(*jax.tree.unflatten(in_tree, xs), **static)

    jitted = jax.jit(flat, donate_argnums=donate)
    closed = jitted.trace(*leaves).jaxpr  # jit's trace cache: exporting below does not trace again
    key = program_key(closed, in_tree, name)
    path = directory / f"{name}-{key[:40]}{SUFFIX}"
    exported = None
    if path.is_file():
        try:
            exported = jax.export.deserialize(bytearray(path.read_bytes()))
        except Exception as e:  # noqa: BLE001 - a damaged entry is a miss, never an error
            log.warning("%s: cannot read the stored program (%s); lowering again", path, e)
    if exported is None:
        try:
            exported = jax.export.export(jitted, disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("ALL")])(*leaves)  # read back here only
            from interop.atomic_io import write_bytes_atomic  # noqa: PLC0415

            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, exported.serialize(), fsync=False)  # a lost entry is a miss
        except Exception as e:  # noqa: BLE001 - storing is an optimisation: run uncached
            log.warning("%s: not stored (%s: %s); running without the lowered-program cache", name,
                        type(e).__name__, e)
            return jitted
    return jax.jit(exported.call, donate_argnums=donate)


def call(fun: Callable, args: tuple, *, static: Mapping[str, Any], name: str, fallback: Callable[[], Any],
         donate_argnums: tuple = ()):
    """`fun(*args, **static)` compiled, through the lowered-program cache (module docstring).

    Args:
      fun: a plain (not jitted) function of `args` (a pytree of arrays and None) and keyword-only
        `static` values (hashable: the NNX graphdef, sizes, flags).
      args: the traced arguments.
      static: the static keyword arguments.
      name: the program's name in file names and logs.
      fallback: what runs when the cache is off: the caller's `jax.jit` of `fun` on these arguments.
      donate_argnums: positions in `args` whose arrays are donated (as `jax.jit`'s).
    """
    directory = cache_dir()
    if directory is None or not _serialization_available():
        return fallback()
    leaves, in_tree = jax.tree.flatten(args)
    if not _one_device(leaves):
        return fallback()
    signature = (in_tree, tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a))),
                                 bool(getattr(a, "weak_type", False))) for a in leaves))
    slot = _slot((fun, tuple(sorted(static.items())), signature, str(directory), tuple(donate_argnums)))
    if "run" not in slot:
        starts = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
        donate = tuple(j for i in donate_argnums for j in range(starts[i], starts[i + 1]))
        slot["run"] = _make(fun, static, leaves, in_tree, directory, name, donate)
    return slot["run"](*leaves)
