"""Preallocated KV cache for incremental decoding (a plain pytree; no module state)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jqlora.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: (num_layers, B, max_len, kv_heads, head_dim) in the compute dtype, one array each
    (stacked like the decoder layers, so the scan over layers writes layer l's row in place;
    `k[l]` is layer l's cache). segment_ids: (B, max_len) int32 segment of each written slot;
    0 = empty or padding (never attended). index: () int32, the next slot to write; a call with T
    tokens writes slots [index, index + T) and attends causally by slot."""

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    index: jax.Array

    @staticmethod
    def kv_shape(config: ModelConfig, batch: int, max_len: int) -> tuple:
        """The shape of `k` (and of `v`)."""
        return (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = cls.kv_shape(config, batch, max_len)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   segment_ids=jnp.zeros((batch, max_len), jnp.int32), index=jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return int(self.segment_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.segment_ids.shape[0])
