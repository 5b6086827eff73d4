"""Read and write bitsandbytes-quantized Hugging Face checkpoints without torch.

Key scheme of ``params`` (what load returns and save takes)
-----------------------------------------------------------
* A quantized linear weight is keyed by its **module name**, without ``.weight``:
  ``params["model.layers.0.self_attn.q_proj"]`` is a :class:`jqlora.quant.Weight4bit` or
  :class:`jqlora.quant.Int8Weight` (logical shape (out_features, in_features), y = x @ W.T).
* Every other tensor is keyed by its **full tensor key** and is a jax array in its stored dtype:
  ``"model.embed_tokens.weight"``, ``"model.layers.0.input_layernorm.weight"``,
  ``"model.layers.0.self_attn.q_proj.bias"``, ``"lm_head.weight"`` (unquantized lm_head).
  So a quantized module ``m`` is ``params[m]`` and its bias is ``params[m + ".bias"]``; a dense
  linear is ``params[m + ".weight"]``. The two kinds of keys never collide.

Where the code lives
--------------------
* :mod:`interop.bnb_load`: load_bnb_checkpoint and all validation of what is on disk
  (on-disk format, shape check and transposed weights are documented there).
* :mod:`interop.bnb_save`: save_bnb_checkpoint and build_quantization_config.
* :mod:`interop.bnb_common`: read_config and expected_linear_shape, shared by both.

This module only re-exports their public names so existing imports keep working.
"""
from __future__ import annotations

from interop.bnb_common import CONFIG_FILE, LLAMA_FAMILY, expected_linear_shape, read_config
from interop.bnb_load import WEIGHT_FORMATS, load_bnb_checkpoint
from interop.bnb_save import build_quantization_config, save_bnb_checkpoint

__all__ = [
    "CONFIG_FILE",
    "LLAMA_FAMILY",
    "WEIGHT_FORMATS",
    "build_quantization_config",
    "expected_linear_shape",
    "load_bnb_checkpoint",
    "read_config",
    "save_bnb_checkpoint",
]
