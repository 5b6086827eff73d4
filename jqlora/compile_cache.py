"""JAX's persistent compilation cache in one per-user directory: a second run of the same model,
settings and shapes loads its compiled programs from disk instead of compiling them again.

Compiling is most of a command's start-up on a warm disk (docs/training.md, compile time). The `jqlora` command line turns the cache on at start-up, before anything
compiles, in `default_dir()` (`$XDG_CACHE_HOME/jqlora/xla`, else `~/.cache/jqlora/xla`);
`JQLORA_COMPILE_CACHE=/some/dir` chooses another directory, `JQLORA_COMPILE_CACHE=0` or the global
flag `--no-compile-cache` turns it off (`cli_dir`). Importing jqlora changes no global JAX setting:
a Python program that wants the cache calls `enable()` itself.

Every program is cached, however small or quick to compile (JAX's defaults skip programs that
compile in under a second, which is most of what generation and the loss compile on a CPU).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from jqlora._util import user_cache_dir

ENV = "JQLORA_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")
_ON = ("1", "on", "true", "yes")


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user cache directory: `$XDG_CACHE_HOME/jqlora/xla`, else `~/.cache/jqlora/xla`.

    Args:
      environ: the environment to read (default `os.environ`).
    """
    return user_cache_dir("xla", environ)


def cli_dir(environ: Mapping[str, str] | None = None, *, disabled: bool = False) -> Path | None:
    """The directory the command line caches in, or None when the cache is off.

    `JQLORA_COMPILE_CACHE`: unset, empty or `1`/`on` -> `default_dir()` (or JAX's own
    `JAX_COMPILATION_CACHE_DIR` when the user set that); `0`/`off`/`false`/`no` -> off; anything
    else is the directory.

    Args:
      environ: the environment to read (default `os.environ`).
      disabled: the `--no-compile-cache` flag: off whatever the environment says.
    """
    if disabled:
        return None
    env = os.environ if environ is None else environ
    value = (env.get(ENV) or "").strip()
    if value.lower() in _OFF:
        return None
    if value and value.lower() not in _ON:
        return Path(value).expanduser()
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    return default_dir(env)


def enable(path: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache in `path` for this process, for every program.

    Call it before the programs to cache are compiled; programs compiled earlier stay uncached.

    Args:
      path: the cache directory, created if missing (default `default_dir()`).

    Returns:
      The directory.

    Raises:
      ValueError: the directory cannot be created (the message names it).
    """
    import jax  # noqa: PLC0415  (only when asked: the CLI's --help never imports jax)

    p = Path(path).expanduser() if path is not None else default_dir()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{p}: cannot create the compilation cache directory: {e.strerror or e}") from None
    jax.config.update("jax_compilation_cache_dir", str(p))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size limit, no override
    return p


__all__ = ["ENV", "default_dir", "cli_dir", "enable"]
