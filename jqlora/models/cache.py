"""Preallocated KV cache for incremental decoding (a plain pytree; no module state)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jqlora.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k[l], v[l]: (B, max_len, kv_heads, head_dim) per layer, in the compute dtype.
    segment_ids: (B, max_len) int32 segment of each written slot; 0 = empty or padding (never
    attended). index: () int32, the next slot to write; a call with T tokens writes slots
    [index, index + T) and attends causally by slot."""

    k: tuple
    v: tuple
    segment_ids: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
        zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
        n = config.num_hidden_layers
        return cls(k=tuple(zeros() for _ in range(n)), v=tuple(zeros() for _ in range(n)),
                   segment_ids=jnp.zeros((batch, max_len), jnp.int32), index=jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return int(self.segment_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.segment_ids.shape[0])
