"""Quantized weight types as JAX pytrees: arrays are leaves, format metadata is static.

So they pass through jit, grad, vmap and sharding like any array container, and two weights
with different formats never share a compiled function by accident.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import numpy as np

from jqlora.quant.tables import BLOCKSIZES_4BIT, NESTED_BLOCKSIZE, QUANT_TYPES

STORED_DTYPES = ("float16", "bfloat16", "float32")


def _shape_of(x):
    return tuple(getattr(x, "shape", ()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weight4bit:
    """A bitsandbytes 4-bit (NF4/FP4) weight.

    packed:        uint8 ((n + 1) // 2,), row-major codes, element 2j in the HIGH nibble.
    absmax:        float32 (nblocks,), or uint8 (nblocks,) codes when double-quantized.
    code:          float32 (16,), the 4-bit table (nf4 or fp4).
    nested_absmax: float32 (ceil(nblocks / 256),) or None.
    nested_code:   float32 (256,) dynamic map, or None.
    offset:        float32 () mean subtracted before nesting, or None.
    shape:         logical shape; for a linear layer (out_features, in_features), y = x @ W.T.
    stored_dtype:  the weight's dtype when it was quantized (checkpoint metadata). Never the
                   compute dtype: that is always the caller's argument.
    """

    packed: jax.Array
    absmax: jax.Array
    code: jax.Array
    nested_absmax: Optional[jax.Array] = None
    nested_code: Optional[jax.Array] = None
    offset: Optional[jax.Array] = None
    shape: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    quant_type: str = dataclasses.field(default="nf4", metadata=dict(static=True))
    blocksize: int = dataclasses.field(default=64, metadata=dict(static=True))
    stored_dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes held on device (packed codes + scales + nested statistics)."""
        leaves = jax.tree_util.tree_leaves(self)
        return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in leaves))

    def validate(self, name: str = "weight") -> "Weight4bit":
        """Check every array against the metadata; raise ValueError naming `name` on a mismatch."""
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"{name}: unknown quant_type {self.quant_type!r}; expected one of {QUANT_TYPES}")
        if self.blocksize not in BLOCKSIZES_4BIT:
            raise ValueError(f"{name}: blocksize {self.blocksize} not allowed; expected one of {BLOCKSIZES_4BIT}")
        if self.stored_dtype not in STORED_DTYPES:
            raise ValueError(f"{name}: stored dtype {self.stored_dtype!r}; expected one of {STORED_DTYPES}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"{name}: invalid shape {self.shape}")
        n, nb = self.numel, self.nblocks
        checks = [
            ("packed codes", self.packed, (((n + 1) // 2),), np.uint8),
            ("code table", self.code, (16,), np.float32),
        ]
        if self.nested:
            ngroups = -(-nb // NESTED_BLOCKSIZE)
            checks += [
                ("absmax (nested codes)", self.absmax, (nb,), np.uint8),
                ("nested_absmax", self.nested_absmax, (ngroups,), np.float32),
                ("nested_quant_map", self.nested_code, (256,), np.float32),
                ("nested_offset", self.offset, (), np.float32),
            ]
        else:
            checks.append(("absmax", self.absmax, (nb,), np.float32))
        for what, arr, shape, dtype in checks:
            if arr is None:
                raise ValueError(f"{name}: {what} is missing")
            if _shape_of(arr) != shape:
                raise ValueError(
                    f"{name}: {what} has shape {_shape_of(arr)}, expected {shape} "
                    f"(weight shape {self.shape}, blocksize {self.blocksize}, {n} elements, {nb} blocks)"
                )
            if np.dtype(arr.dtype) != np.dtype(dtype):
                raise ValueError(f"{name}: {what} has dtype {arr.dtype}, expected {np.dtype(dtype).name}")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """An LLM.int8 weight: W ~= CB * SCB[:, None] / 127.

    cb:  int8 (out_features, in_features).
    scb: float32 (out_features,), the row absmax of the float16-rounded weight.
    threshold: the outlier threshold recorded with the checkpoint (llm_int8_threshold); used only
               by the bitsandbytes-numerics mode, never by the default weight-only matmul.
    """

    cb: jax.Array
    scb: jax.Array
    threshold: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    stored_dtype: str = dataclasses.field(default="float16", metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        return tuple(self.cb.shape)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.cb.shape) + 4 * math.prod(self.scb.shape))

    def validate(self, name: str = "weight") -> "Int8Weight":
        if len(_shape_of(self.cb)) != 2:
            raise ValueError(f"{name}: int8 weight must be 2-D (out, in), got shape {_shape_of(self.cb)}")
        if np.dtype(self.cb.dtype) != np.int8:
            raise ValueError(f"{name}: int8 weight has dtype {self.cb.dtype}, expected int8")
        if _shape_of(self.scb) != (self.cb.shape[0],):
            raise ValueError(f"{name}: SCB has shape {_shape_of(self.scb)}, expected ({self.cb.shape[0]},)")
        if np.dtype(self.scb.dtype) != np.float32:
            raise ValueError(f"{name}: SCB has dtype {self.scb.dtype}, expected float32")
        return self
