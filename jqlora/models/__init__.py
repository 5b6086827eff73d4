"""Llama-family causal LMs (Llama 2/3, Mistral, Qwen2, Qwen3) in Flax NNX over frozen quantized weights.

The names below are the public API; the layers (``Attention``, ``DecoderLayer``, ``MLP``, ...) and
helpers stay importable from :mod:`jqlora.models.llama`, :mod:`~jqlora.models.attention` (RoPE,
masks, the attention implementations), :mod:`~jqlora.models.config` and :mod:`~jqlora.models.generate`.
"""
from jqlora.models.build import from_params, init_params
from jqlora.models.cache import KVCache
from jqlora.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError
from jqlora.models.generate import generate
from jqlora.models.llama import CausalLM
from jqlora.models.loader import load_causal_lm
from jqlora.models.remat import REMAT_POLICIES, RematPlan, remat_plan
from jqlora.models.rollout import Rollouts, generate_batch

__all__ = [
    "CausalLM", "ModelConfig", "KVCache", "load_causal_lm", "from_params", "init_params", "generate",
    "UnsupportedModelError", "SUPPORTED_MODEL_TYPES", "REMAT_POLICIES",
    "RematPlan", "remat_plan", "generate_batch", "Rollouts",
]
