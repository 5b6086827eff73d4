"""`load_causal_lm`: the one place in jqlora.models that reads a checkpoint (through interop)."""
from __future__ import annotations

import json
import os
from typing import Optional

import jax.numpy as jnp
from flax import nnx

from jqlora.lora.config import LoraConfig
from jqlora.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError
from jqlora.models.llama import CausalLM, from_params


def _check_model_type(path: str) -> None:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return  # interop raises its own error naming the file
    with open(cfg_file) as f:
        mt = json.load(f).get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{cfg_file}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def load_causal_lm(path: str, lora: Optional[LoraConfig] = None, compute_dtype=jnp.bfloat16,
                   quantize: Optional[str] = None, rngs: Optional[nnx.Rngs] = None, remat=False, *,
                   backend: str = "auto", param_dtype=None, int8_numerics: str = "weight_only",
                   attention: str = "einsum") -> CausalLM:
    """Load an HF folder (bitsandbytes 4-bit, bitsandbytes 8-bit, or plain safetensors) as a
    `CausalLM`. quantize ("nf4" | "fp4" | "int8") quantizes dense linear weights at load (an
    already-quantized checkpoint keeps its own format). compute_dtype is the caller's choice,
    never the checkpoint's dtype. lora: a `LoraConfig` to add LoRA (rngs default nnx.Rngs(0)).
    Raises UnsupportedModelError for model types other than llama/mistral/qwen2/qwen3, and
    KeyError naming the tensor when one is missing."""
    import interop  # noqa: PLC0415  (the only jqlora.models module that touches files)

    path = os.fspath(path)
    _check_model_type(path)
    params, config = interop.load_bnb_checkpoint(path)
    ModelConfig.from_hf(config)  # fail on the architecture before building anything
    return from_params(params, config, lora=lora, compute_dtype=compute_dtype, quantize=quantize, rngs=rngs,
                       remat=remat, backend=backend, param_dtype=param_dtype, int8_numerics=int8_numerics,
                       attention=attention)
