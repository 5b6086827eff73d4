"""Small helpers shared by the library, the demo and the CLI: dtype names, quiet third-party logging,
byte counts.

Nothing heavy is imported at module level: the CLI imports this before jax or torch.
"""
from __future__ import annotations

import logging
import os

DTYPES = ("float32", "bfloat16", "float16")


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
    """The jnp dtype of a compute-dtype name.

    Args:
      name: one of `DTYPES` ("float32", "bfloat16", "float16").

    Raises:
      ValueError: for any other name.
    """
    import jax.numpy as jnp  # noqa: PLC0415

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return jnp.dtype(name)


def default_compute_dtype() -> str:
    """float32 on CPU (fast there and exact for cross-checks), bfloat16 on accelerators."""
    import jax  # noqa: PLC0415

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def fmt_bytes(n: float) -> str:
    """A byte count in binary units: 512 B, 1.50 KiB, 2.00 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


__all__ = ["DTYPES", "quiet_third_party", "jnp_dtype", "default_compute_dtype", "fmt_bytes"]
