"""The border with PyTorch / bitsandbytes / PEFT / HF files: the only package that knows their layouts.

Reading and writing checkpoints needs no torch; the torch bridge imports torch on first use.
"""
from __future__ import annotations

from interop.bnb_checkpoint import load_bnb_checkpoint, save_bnb_checkpoint
from interop.errors import CheckpointError
from interop.safetensors_io import open_checkpoint, write_safetensors


def from_torch(obj, **kwargs):
    """bitsandbytes Params4bit/Linear4bit -> Weight4bit, Int8Params/Linear8bitLt -> Int8Weight,
    torch tensor / nn.Linear -> jax array. See interop.torch_bridge."""
    from interop.torch_bridge import from_torch as _f

    return _f(obj, **kwargs)


def from_torch_module(module, **kwargs):
    """Linear4bit / Linear8bitLt / nn.Linear -> (weight, bias or None). See interop.torch_bridge."""
    from interop.torch_bridge import from_torch_module as _f

    return _f(module, **kwargs)


def to_torch(x, **kwargs):
    """Weight4bit -> Params4bit, Int8Weight -> Int8Params, array -> torch tensor. See interop.torch_bridge."""
    from interop.torch_bridge import to_torch as _f

    return _f(x, **kwargs)


def to_torch_module(weight, bias=None, **kwargs):
    """(weight, bias) -> Linear4bit / Linear8bitLt / nn.Linear. See interop.torch_bridge."""
    from interop.torch_bridge import to_torch_module as _f

    return _f(weight, bias, **kwargs)


__all__ = [
    "load_bnb_checkpoint",
    "save_bnb_checkpoint",
    "from_torch",
    "from_torch_module",
    "to_torch",
    "to_torch_module",
    "CheckpointError",
    "open_checkpoint",
    "write_safetensors",
]

# ---- PEFT adapters (interop/peft_adapter.py, another engineer's file) -------------------------
# LEAD: save_peft_adapter / load_peft_adapter are exported here. The guard keeps this package
# importable while peft_adapter.py does not exist yet; once it lands the lead may drop the guard.
try:
    from interop.peft_adapter import load_peft_adapter, save_peft_adapter  # noqa: F401
except ModuleNotFoundError as _e:  # only "the file is not there yet"; real import errors propagate
    if _e.name != "interop.peft_adapter":
        raise
else:
    __all__ += ["save_peft_adapter", "load_peft_adapter"]
# -----------------------------------------------------------------------------------------------
