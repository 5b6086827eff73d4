"""A mixture-of-experts projection: E frozen (N, K) linear weights stacked on a leading axis.

`ExpertWeights.stack` is one of the dense weight types with every array leaf carrying a leading
expert axis: a `Weight4bit` (NF4/FP4, each expert its own bitsandbytes blockwise layout, nested
absmax with one offset per expert), an `Int8Weight` (LLM.int8 row-wise: CB (E, N, K), SCB (E, N))
or a plain float array (E, N, K). So `expert(e)` is an ordinary dense weight, and dequantizing the
stack is the dense dequantization mapped over experts: bit-identical to bitsandbytes per expert.

The fused 3-D bitsandbytes parameter (`bitsandbytes.nn.parametrize.replace_parameter_4bit`, a
Weight4bit of logical shape (E, N, K) whose blocks run row-major over the flattened stack and
whose double-quantized scales share one offset) becomes this layout in `from_fused`: the blocks
of expert e are a contiguous slice whenever N*K is a multiple of the blocksize.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jqlora.quant.fourbit import _quantize_4bit_impl, absmax_f32, dequantize_4bit
from jqlora.quant.int8 import dequantize_int8, quantize_int8
from jqlora.quant.tables import BLOCKSIZES_4BIT, NESTED_BLOCKSIZE, QUANT_TYPES
from jqlora.quant.weights import Int8Weight, Weight4bit

FORMATS = ("nf4", "fp4", "int8", "dense")


def _leaf_shapes(tree):
    return [tuple(getattr(a, "shape", ())) for a in jax.tree_util.tree_leaves(tree)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """E frozen expert weights of logical shape (N, K) each; y_e = x @ W_e.T (torch Linear layout).

    stack: a Weight4bit or an Int8Weight whose array leaves all have a leading axis of length E
           (static metadata, `shape` included, is that of one expert), or a float (E, N, K) array.
    """

    stack: object
    num_experts: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def format(self) -> str:
        """"nf4", "fp4", "int8" or "dense"."""
        if isinstance(self.stack, Weight4bit):
            return self.stack.quant_type
        if isinstance(self.stack, Int8Weight):
            return "int8"
        return "dense"

    @property
    def expert_shape(self) -> tuple:
        """(N, K) of one expert: (out_features, in_features)."""
        if isinstance(self.stack, Weight4bit):
            return tuple(self.stack.shape)
        if isinstance(self.stack, Int8Weight):
            return tuple(self.stack.cb.shape[1:])
        return tuple(self.stack.shape[1:])

    @property
    def shape(self) -> tuple:
        """(E, N, K)."""
        return (self.num_experts, *self.expert_shape)

    @property
    def blocksize(self) -> int:
        """The 4-bit blocksize; 0 for int8 and dense stacks (what the kernels' supports() take)."""
        return self.stack.blocksize if isinstance(self.stack, Weight4bit) else 0

    @property
    def nbytes(self) -> int:
        return int(sum(np.dtype(a.dtype).itemsize * math.prod(a.shape)
                       for a in jax.tree_util.tree_leaves(self.stack)))

    def expert(self, e: int):
        """Expert e as a dense weight type (Weight4bit, Int8Weight or (N, K) array)."""
        return jax.tree_util.tree_map(lambda a: a[e], self.stack)

    def validate(self, name: str = "experts") -> "ExpertWeights":
        """Check the stack against its metadata; raise ValueError naming `name` on a mismatch."""
        e = self.num_experts
        if e < 1:
            raise ValueError(f"{name}: an expert stack needs at least one expert, got {e}")
        bad = [s for s in _leaf_shapes(self.stack) if not s or s[0] != e]
        if bad:
            raise ValueError(f"{name}: every array of the stack needs a leading expert axis of length {e}, "
                             f"got shapes {bad}")
        if isinstance(self.stack, (Weight4bit, Int8Weight)):
            self.expert(0).validate(f"{name} (expert 0)")
        else:
            dt = np.dtype(self.stack.dtype)
            if len(self.stack.shape) != 3 or not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"{name}: a dense expert stack is a float (E, N, K) array, got "
                                 f"{dt.name}{tuple(self.stack.shape)}")
        return self

    # ---- constructors -----------------------------------------------------------------------

    @classmethod
    def from_experts(cls, weights, name: str = "experts") -> "ExpertWeights":
        """Stack per-expert weights: all Weight4bit of one format, shape, blocksize and nesting,
        all Int8Weight of one shape, or all (N, K) float arrays."""
        weights = list(weights)
        if not weights:
            raise ValueError(f"{name}: no expert weights to stack")
        kinds = {type(w) if isinstance(w, (Weight4bit, Int8Weight)) else "array" for w in weights}
        if len(kinds) != 1:
            raise ValueError(f"{name}: experts mix weight types {sorted(map(str, kinds))}")
        first = weights[0]
        if isinstance(first, (Weight4bit, Int8Weight)):
            meta = _static_meta(first)
            for e, w in enumerate(weights):
                w.validate(f"{name} expert {e}")
                if _static_meta(w) != meta or _leaf_shapes(w) != _leaf_shapes(first):
                    raise ValueError(f"{name}: expert {e} has format {_static_meta(w)}, expert 0 has {meta}")
            stack = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *weights)
        else:
            shapes = {tuple(w.shape) for w in weights}
            if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                raise ValueError(f"{name}: dense experts must all be (N, K) of one shape, got {sorted(shapes)}")
            stack = jnp.stack([jnp.asarray(w) for w in weights])
        return cls(stack=stack, num_experts=len(weights)).validate(name)

    @classmethod
    def from_dense(cls, w, name: str = "experts") -> "ExpertWeights":
        """A float (E, N, K) stack, kept as it is (no quantization)."""
        w = jnp.asarray(w)
        if w.ndim != 3:
            raise ValueError(f"{name}: expert stack must be (E, N, K), got shape {tuple(w.shape)}")
        return cls(stack=w, num_experts=int(w.shape[0])).validate(name)

    @classmethod
    def from_fused(cls, q: Weight4bit, name: str = "experts") -> "ExpertWeights":
        """The fused 3-D bitsandbytes parameter (a Weight4bit of shape (E, N, K), blocks running
        row-major over the whole stack, one nested offset) as per-expert layouts.

        Blocks are sliced per expert; nested scales are too when each expert holds whole groups
        of 256 blocks, otherwise they are de-nested here to float32 (the values bitsandbytes'
        dequantize_4bit computes, so the weight stays bit-identical)."""
        if not isinstance(q, Weight4bit):
            raise ValueError(f"{name}: from_fused takes a Weight4bit, got {type(q).__name__}")
        q.validate(name)
        if len(q.shape) != 3:
            raise ValueError(f"{name}: a fused expert parameter is 3-D (E, N, K), got shape {q.shape}")
        e, n, k = q.shape
        per = n * k
        if per % q.blocksize:
            raise ValueError(f"{name}: one expert holds {n}x{k} = {per} values, not a multiple of the "
                             f"blocksize {q.blocksize}: quantization blocks span experts")
        nb = per // q.blocksize
        common = dict(shape=(n, k), quant_type=q.quant_type, blocksize=q.blocksize, stored_dtype=q.stored_dtype)
        packed = q.packed.reshape(e, per // 2)
        tile = lambda a: jnp.broadcast_to(a, (e, *a.shape))  # noqa: E731
        if q.nested and nb % NESTED_BLOCKSIZE == 0:
            stack = Weight4bit(packed=packed, absmax=q.absmax.reshape(e, nb), code=tile(q.code),
                               nested_absmax=q.nested_absmax.reshape(e, nb // NESTED_BLOCKSIZE),
                               nested_code=tile(q.nested_code), offset=tile(q.offset), **common)
        else:
            stack = Weight4bit(packed=packed, absmax=absmax_f32(q).reshape(e, nb), code=tile(q.code), **common)
        return cls(stack=stack, num_experts=e).validate(name)


def _static_meta(w) -> tuple:
    if isinstance(w, Weight4bit):
        return ("4bit", tuple(w.shape), w.quant_type, w.blocksize, w.nested, w.stored_dtype)
    return ("int8", tuple(w.shape), w.threshold, w.stored_dtype)


def quantize_experts(w, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = True,
                     threshold: float = 0.0, name: str = "experts") -> ExpertWeights:
    """Quantize a float (E, N, K) stack expert by expert: each expert exactly as
    `quantize_4bit` (its own nested offset) or `quantize_int8` (quant_type "int8") quantizes it."""
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"{name}: expert stack must be (E, N, K), got shape {tuple(w.shape)}")
    if quant_type == "int8":
        stack = jax.vmap(lambda a: quantize_int8(a, threshold))(w)
    elif quant_type in QUANT_TYPES:
        if blocksize not in BLOCKSIZES_4BIT:
            raise ValueError(f"{name}: blocksize {blocksize} not allowed; expected one of {BLOCKSIZES_4BIT}")
        stack = _quantize_stack_jit(w, quant_type, blocksize, bool(double_quant))
    else:
        raise ValueError(f"{name}: unknown quant_type {quant_type!r}; expected one of {QUANT_TYPES + ('int8',)}")
    return ExpertWeights(stack=stack, num_experts=int(w.shape[0])).validate(name)


def _quantize_stack(w, quant_type, blocksize, double_quant):
    return jax.vmap(lambda a: _quantize_4bit_impl(a, quant_type, blocksize, double_quant))(w)


_quantize_stack_jit = jax.jit(_quantize_stack, static_argnums=(1, 2, 3))


def dequantize_experts(experts: ExpertWeights, dtype=jnp.bfloat16) -> jax.Array:
    """The dense (E, N, K) stack in `dtype`: each expert as the dense dequantization gives it
    (fp32 math, one rounding; bitsandbytes' dequantize_4bit / int8 dequant bit for bit)."""
    if not isinstance(experts, ExpertWeights):
        raise TypeError(f"dequantize_experts takes an ExpertWeights, got {type(experts).__name__}")
    s = experts.stack
    if isinstance(s, Weight4bit):
        return jax.vmap(lambda q: dequantize_4bit(q, dtype))(s)
    if isinstance(s, Int8Weight):
        return jax.vmap(lambda q: dequantize_int8(q, dtype))(s)
    return jnp.asarray(s).astype(dtype)
