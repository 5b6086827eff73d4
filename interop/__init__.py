"""The border with PyTorch / bitsandbytes / PEFT / HF files: the only package that knows their layouts.

Reading and writing checkpoints and adapters needs no torch; the torch bridge
(:mod:`interop.torch_bridge`) imports torch and bitsandbytes only when one of its functions runs,
so ``import interop`` works without them.

Key scheme of ``params`` (what :func:`load_bnb_checkpoint` returns and :func:`save_bnb_checkpoint`
takes):

* A quantized linear weight is keyed by its **module name**, without ``.weight``:
  ``params["model.layers.0.self_attn.q_proj"]`` is a :class:`jqlora.quant.Weight4bit` or
  :class:`jqlora.quant.Int8Weight` (logical shape (out_features, in_features), y = x @ W.T).
* Every other tensor is keyed by its **full tensor key** and is a jax array in its stored dtype:
  ``"model.embed_tokens.weight"``, ``"model.layers.0.input_layernorm.weight"``,
  ``"model.layers.0.self_attn.q_proj.bias"``, ``"lm_head.weight"`` (unquantized lm_head).
  So a quantized module ``m`` is ``params[m]`` and its bias is ``params[m + ".bias"]``; a dense
  linear is ``params[m + ".weight"]``. The two kinds of keys never collide.

Modules: :mod:`interop.bnb_load` (loading and every check of what is on disk),
:mod:`interop.bnb_save` (writing, ``build_quantization_config``), :mod:`interop.bnb_common`
(``config.json`` and the shapes a config implies), :mod:`interop.peft_adapter` (PEFT LoRA adapter
directories), :mod:`interop.safetensors_io` (the one safetensors reader and writer),
:mod:`interop.torch_bridge` (live torch / bitsandbytes objects), :mod:`interop.atomic_io` (atomic
writes), :mod:`interop.json_io` (reading a JSON object from a file, or a named error).
"""
from __future__ import annotations

from interop.bnb_load import load_bnb_checkpoint
from interop.bnb_save import save_bnb_checkpoint
from interop.errors import CheckpointError
from interop.peft_adapter import load_peft_adapter, save_peft_adapter
from interop.safetensors_io import open_checkpoint, write_safetensors
from interop.torch_bridge import from_torch, from_torch_module, to_torch, to_torch_module

__all__ = [
    "load_bnb_checkpoint",
    "save_bnb_checkpoint",
    "load_peft_adapter",
    "save_peft_adapter",
    "from_torch",
    "from_torch_module",
    "to_torch",
    "to_torch_module",
    "CheckpointError",
    "open_checkpoint",
    "write_safetensors",
]
