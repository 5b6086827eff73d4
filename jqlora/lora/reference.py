"""The reference model of preference and RL training: the policy's own base, LoRA switched off.

No second copy of the model exists. Inside a compiled step the model is split into (LoRA params |
everything else); :func:`reference_view` merges the same graph definition with every LoRA leaf
replaced by zeros. Each `QLoRALinear` then adds ``scale * (x @ 0.T) @ 0.T``, an exact zero, so the
view computes the base model bit for bit, through the same program structure as the policy (no
graph change, no recompilation of the policy, and the frozen weights are shared, not copied).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["lora_off", "reference_view"]


def lora_off(lora_state):
    """``lora_state`` (an ``nnx.LoRAParam`` state or pure tree) with every leaf zero."""
    return jax.tree.map(jnp.zeros_like, lora_state)


def reference_view(graphdef, lora_state, *rest):
    """A model over ``graphdef`` and ``rest`` (the frozen weights, RNG state: what
    ``nnx.split(model, nnx.LoRAParam, ...)`` gave besides ``lora_state``) with every LoRA delta
    off. Use it under ``jax.lax.stop_gradient`` on its outputs: nothing of it is trained."""
    return nnx.merge(graphdef, lora_off(lora_state), *rest, copy=True)
