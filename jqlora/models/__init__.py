"""Llama-family causal LMs (Llama 2/3, Mistral, Qwen2, Qwen3) in Flax NNX over frozen quantized weights."""
from jqlora.models.cache import KVCache
from jqlora.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError, rope_inv_freq
from jqlora.models.generate import generate, sample_token
from jqlora.models.llama import (REMAT_POLICIES, Attention, CausalLM, DecoderLayer, Embedding, LlamaModel, MLP,
                                 RMSNorm, from_params, init_params, segment_positions)
from jqlora.models.loader import load_causal_lm

__all__ = [
    "CausalLM", "LlamaModel", "DecoderLayer", "Attention", "MLP", "RMSNorm", "Embedding", "KVCache",
    "ModelConfig", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES", "REMAT_POLICIES", "from_params",
    "init_params", "load_causal_lm", "generate", "sample_token", "segment_positions", "rope_inv_freq",
]
