"""Preallocated KV cache for incremental decoding (a plain pytree; no module state).

A sliding-window layer (Gemma 2/3, Mistral, Qwen2 windows) never attends further back than its
window, so its keys and values live in a ring buffer of `ring_len` slots (the largest such window),
slot s at ring entry s mod ring_len: long generations hold window-sized caches for those layers,
as the windowed design intends. Global layers (and windowed layers whose window is not shorter
than the cache) keep the whole sequence.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import jax
import jax.numpy as jnp

from jqlora.models.config import ModelConfig


def ring_layout(config: ModelConfig, max_len: int, ring: bool = True) -> tuple:
    """Per layer ("full" | "ring", row in that kind's arrays), and the ring length (0: no ring).
    A layer is a ring layer when it has a sliding window shorter than `max_len` (and `ring`)."""
    windows = config.sliding_windows or (None,) * config.num_hidden_layers
    is_ring = [ring and w is not None and w < max_len for w in windows]
    rows, n = [], {"full": 0, "ring": 0}
    for r in is_ring:
        kind = "ring" if r else "full"
        rows.append((kind, n[kind]))
        n[kind] += 1
    ring_len = max((w for w, r in zip(windows, is_ring) if r), default=0)
    return tuple(rows), ring_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: (full layers, B, max_len, kv_heads, head_dim) in the compute dtype, one array each
    (stacked like the decoder layers, so the scan over layers writes a layer's row in place).
    segment_ids: (B, max_len) int32 segment of each written slot; 0 = empty or padding (never
    attended). index: () int32, the next slot to write; a call with T tokens writes slots
    [index, index + T) and attends causally by slot.
    ring_k, ring_v: (ring layers, B, ring_len, kv_heads, head_dim): the sliding-window layers'
    last ring_len slots (slot s at entry s mod ring_len), or None. layout: per layer ("full" |
    "ring", row); empty means every layer is a full layer at its own row (`k[l]` is layer l's
    cache). `KVCache.init` chooses it (`ring_layout`)."""

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    index: jax.Array
    ring_k: Optional[jax.Array] = None
    ring_v: Optional[jax.Array] = None
    layout: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @staticmethod
    def kv_shape(config: ModelConfig, batch: int, max_len: int, ring: bool = True) -> tuple:
        """The shape of `k` (and of `v`): the layers that keep the whole sequence."""
        rows, _ = ring_layout(config, max_len, ring)
        full = sum(kind == "full" for kind, _ in rows)
        return (full, batch, max_len, config.num_key_value_heads, config.head_dim)

    @staticmethod
    def ring_shape(config: ModelConfig, batch: int, max_len: int, ring: bool = True) -> Optional[tuple]:
        """The shape of `ring_k` (and of `ring_v`), None when no layer has a ring."""
        rows, ring_len = ring_layout(config, max_len, ring)
        n = sum(kind == "ring" for kind, _ in rows)
        return (n, batch, ring_len, config.num_key_value_heads, config.head_dim) if n else None

    @classmethod
    def nbytes(cls, config: ModelConfig, batch: int, max_len: int, dtype, ring: bool = True) -> int:
        """Bytes of k, v, ring_k and ring_v of `init(config, batch, max_len, dtype, ring=ring)`."""
        shapes = [cls.kv_shape(config, batch, max_len, ring), cls.ring_shape(config, batch, max_len, ring)]
        return 2 * jnp.dtype(dtype).itemsize * sum(math.prod(s) for s in shapes if s is not None)

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, ring: bool = True) -> "KVCache":
        """An empty cache of `max_len` slots. ring=False keeps every layer's whole sequence (the
        reference the ring buffer is tested against)."""
        rows, _ = ring_layout(config, max_len, ring)
        shape = cls.kv_shape(config, batch, max_len, ring)
        rshape = cls.ring_shape(config, batch, max_len, ring)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   segment_ids=jnp.zeros((batch, max_len), jnp.int32), index=jnp.zeros((), jnp.int32),
                   ring_k=None if rshape is None else jnp.zeros(rshape, dtype),
                   ring_v=None if rshape is None else jnp.zeros(rshape, dtype),
                   layout=rows if rshape is not None else ())

    def in_layout_of(self, like: "KVCache") -> "KVCache":
        """This cache (every layer's whole sequence, `ring=False`) in the layout of `like` (same
        shapes and ring arrays): the ring layers keep the last ring_len slots before `index`."""
        if not like.layout:
            return self
        if self.layout:
            raise ValueError("in_layout_of needs a cache that keeps every layer's whole sequence")
        rows = {kind: [layer for layer, (k, _) in enumerate(like.layout) if k == kind] for kind in ("full", "ring")}
        r = like.ring_k.shape[2]
        held = self.index - 1 - jnp.mod(self.index - 1 - jnp.arange(r, dtype=jnp.int32), r)
        take = jnp.maximum(held, 0)  # an entry never written: its segment reads 0 (`ring_attend`)
        ring = jnp.asarray(rows["ring"], jnp.int32)
        full = jnp.asarray(rows["full"], jnp.int32)
        return dataclasses.replace(like, k=self.k[full], v=self.v[full], ring_k=self.k[ring][:, :, take],
                                   ring_v=self.v[ring][:, :, take], segment_ids=self.segment_ids, index=self.index)

    def slot(self, layer: int) -> tuple[bool, int]:
        """(whether layer `layer` lives in the ring arrays, its row there)."""
        if not self.layout:
            return False, layer
        kind, row = self.layout[layer]
        return kind == "ring", row

    @property
    def max_len(self) -> int:
        return int(self.segment_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.segment_ids.shape[0])


def _tuples(x):
    """JSON's lists back as the tuples they were (a static field must hash and compare equal)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _register_export_serialization(cls, serialized_name: str) -> None:
    """Lets `jax.export` serialize a program whose inputs or outputs hold `cls` (a
    `register_dataclass` type whose static fields are JSON values: strings, numbers, tuples): the
    lowered-program cache (`jqlora.lowered_cache`) stores the rollout programs, which return a
    KVCache. jax keeps one registration per type and per name for the process; importing this
    module again finds it there and leaves it."""
    try:
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=serialized_name,
            serialize_auxdata=lambda aux: json.dumps(aux).encode(),
            deserialize_auxdata=lambda data: _tuples(json.loads(data.decode())))
    except ValueError as e:
        if "Duplicate serialization registration" not in str(e):
            raise


_register_export_serialization(KVCache, "jqlora.models.cache.KVCache")
