"""Small helpers shared by the library, the demo and the CLI: dtype names, quiet third-party logging,
byte counts, and what the CLI's `auto` defaults (attention, remat) resolve to on this machine.

Nothing heavy is imported at module level: the CLI imports this before jax or torch.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from jqlora.errors import SettingError

DTYPES = ("float32", "bfloat16", "float16")
# the qmatmul backends (`jqlora.ops.BACKENDS`) and the formats `load_causal_lm(quantize=)` takes,
# named here, with nothing imported, for the flags and settings checks the CLI makes before jax loads
BACKENDS = ("auto", "pallas", "interpret", "xla")
QUANTIZE_FORMATS = ("nf4", "fp4", "int8")
# the frozen 4-bit base products (`load_causal_lm(base_matmul=)`, TrainConfig.base_matmul): in the
# compute dtype, or on FP8 operands scaled per row (jqlora.ops.fp8)
BASE_MATMULS = ("compute", "fp8")


def quiet_third_party() -> None:
    """Silence import-time chatter of bitsandbytes/transformers (warnings about optional kernels,
    progress bars for tiny checkpoints). Real errors still raise.

    Imports nothing: transformers takes seconds to import and most commands never use it. Its
    environment variables quiet it if it is imported later; an already imported one is set here."""
    import sys  # noqa: PLC0415

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("bitsandbytes", "transformers", "peft", "accelerate", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        try:
            transformers.utils.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
        except Exception:  # noqa: BLE001 - a partly imported or unusual transformers
            pass


# XLA's cap on the pinned host memory of one GPU (offloaded activations): 64 GB unless this is set.
HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_HOST_LIMIT_GB = 64
HOST_LIMIT_SHARE = 0.85  # of the machine's RAM, when that is above XLA's default


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def raise_host_offload_limit(environ=None, ram_bytes: int | None = None) -> int:
    """Let XLA pin up to `HOST_LIMIT_SHARE` of the RAM for offloaded activations (remat policy
    `offload_layer_inputs`), where that is more than XLA's 64 GB default and the user has not set
    `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`: the default made a step that `remat="auto"` planned with
    88 GiB of layer inputs in host memory fail on a 128 GiB machine. Takes effect when set before
    the GPU client starts (the CLI calls it first). Returns the limit in GB now in force."""
    env = os.environ if environ is None else environ
    if env.get(HOST_LIMIT_ENV):
        return host_offload_limit_gb(env)
    ram = physical_memory() if ram_bytes is None else ram_bytes
    gb = int(HOST_LIMIT_SHARE * ram / 2**30) if ram else 0
    if gb > XLA_HOST_LIMIT_GB:
        env[HOST_LIMIT_ENV] = str(gb)
        return gb
    return XLA_HOST_LIMIT_GB


def host_offload_limit_gb(environ=None) -> int:
    """The pinned host memory XLA lets one GPU use, in GB: `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, else 64."""
    env = os.environ if environ is None else environ
    try:
        return max(int(float(env.get(HOST_LIMIT_ENV, "") or XLA_HOST_LIMIT_GB)), 0)
    except ValueError:
        return XLA_HOST_LIMIT_GB


def jnp_dtype(name: str):
    """The jnp dtype of a compute-dtype name.

    Args:
      name: one of `DTYPES` ("float32", "bfloat16", "float16").

    Raises:
      SettingError: for any other name (a ValueError).
    """
    import jax.numpy as jnp  # noqa: PLC0415

    if name not in DTYPES:
        raise SettingError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return jnp.dtype(name)


def default_compute_dtype() -> str:
    """float32 on CPU (fast there and exact for cross-checks), bfloat16 on accelerators."""
    import jax  # noqa: PLC0415

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


ATTENTION_CHOICES = ("auto", "einsum", "xla", "cudnn")

# What `auto` picks, said once here and in every command's --help.
ATTENTION_AUTO_HELP = ("auto = cudnn (cuDNN flash attention; packed rows run cuDNN's packed layout) on a GPU "
                       "where cuDNN attention runs the compute dtype (bf16/fp16), einsum (jnp, float32 "
                       "scores) elsewhere and for soft-capped attention (Gemma 2)")


def cudnn_attention_available() -> bool:
    """Whether cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) can
    run here: a GPU of compute capability >= 8.0 (Ampere on) and cuDNN >= 8.9.4."""
    import jax  # noqa: PLC0415

    if jax.default_backend() != "gpu":
        return False
    try:
        cc = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version  # noqa: PLC0415

        return cc >= 8.0 and check_cudnn_version() >= 8904
    except Exception:  # noqa: BLE001 - no cuDNN, or a jax without this wrapper: the jnp path
        return False


def resolve_attention(name: str, compute_dtype: str, *, soft_capped: bool = False, backend: str | None = None,
                      cudnn: bool | None = None) -> tuple[str, str]:
    """The attention implementation a model runs for the CLI's `--attention NAME`, and why.

    `auto` is cuDNN flash attention where it runs (a GPU, bf16/fp16 compute; the model then runs
    packed training rows through cuDNN's packed layout, `jqlora.models.packed_attention`), and the
    einsum path elsewhere (float32 scores: the reference the cross-checks use). A model with
    soft-capped attention scores (Gemma 2) runs the einsum path only: neither cuDNN's nor XLA's
    fused attention can cap the scores.

    Args:
      name: one of `ATTENTION_CHOICES`; anything but "auto" is returned as is.
      compute_dtype: the compute dtype name ("float32", "bfloat16", "float16").
      soft_capped: the model soft-caps its attention scores (`ModelConfig.attn_softcap`).
      backend: the JAX backend ("gpu", "cpu", ...); None: `jax.default_backend()`.
      cudnn: whether cuDNN flash attention runs here; None: `cudnn_attention_available()`.

    Returns:
      (implementation, reason): the implementation for `load_causal_lm(attention=...)` and a
      short phrase saying why it was chosen.

    Raises:
      SettingError: an unknown name, or "cudnn" / "xla" for a soft-capped model (a ValueError).
    """
    if name not in ATTENTION_CHOICES:
        raise SettingError(f"unknown attention {name!r}; expected one of {', '.join(ATTENTION_CHOICES)}")
    if soft_capped and name in ("cudnn", "xla"):
        raise SettingError(f"--attention {name} cannot soft-cap attention scores, which this model does "
                           "(attn_logit_softcapping); use --attention einsum or auto")
    if name != "auto":
        return name, "requested"
    if soft_capped:
        return "einsum", "auto: the model soft-caps its attention scores, which only the einsum path applies"
    if backend is None:
        import jax  # noqa: PLC0415

        backend = jax.default_backend()
    if backend != "gpu":
        return "einsum", f"auto: no GPU (JAX backend {backend})"
    if compute_dtype not in ("bfloat16", "float16"):
        return "einsum", f"auto: cuDNN attention needs bf16/fp16, the compute dtype is {compute_dtype}"
    if not (cudnn_attention_available() if cudnn is None else cudnn):
        return "einsum", "auto: cuDNN flash attention is not available on this GPU/cuDNN"
    return "cudnn", "auto: GPU with cuDNN flash attention"


def fmt_bytes(n: float) -> str:
    """A byte count in binary units: 512 B, 1.50 KiB, 2.00 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


__all__ = ["DTYPES", "BACKENDS", "QUANTIZE_FORMATS", "quiet_third_party", "raise_host_offload_limit", "host_offload_limit_gb", "physical_memory",
           "jnp_dtype", "default_compute_dtype", "fmt_bytes", "ATTENTION_CHOICES",
           "ATTENTION_AUTO_HELP", "cudnn_attention_available", "resolve_attention"]


def user_cache_dir(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/jqlora/<name>`, else `~/.cache/jqlora/<name>`: where jqlora keeps what it
    builds once per user (compiled programs, converted models)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "jqlora" / name
