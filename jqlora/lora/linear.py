"""`QLoRALinear`: a frozen (quantized or dense) linear layer with an optional trainable LoRA branch.

    y = x @ W.T + scale * (dropout(x) @ A.T) @ B.T + bias,   W frozen, A (r, in), B (out, r)

How the frozen weight is held in NNX: `QuantizedBase` is an `nnx.Variable` subclass that is *not*
an `nnx.Param`, whose value is a whole pytree (`Weight4bit`, `Int8Weight`, or a plain (out, in)
array). NNX flattens it like any pytree under `nnx.split` / `nnx.jit` / `nnx.grad`, so the packed
codes and scales stay packed on device. Optimizers built with `wrt=nnx.LoRAParam` (or even
`wrt=nnx.Param`) never see it, and `nnx.grad` over `nnx.DiffState(0, nnx.LoRAParam)` never
differentiates it. LoRA matrices are `nnx.LoRAParam` (a `Param` subclass) in float32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jqlora import ops as _ops
from jqlora import quant


class FrozenParam(nnx.Variable):
    """A tensor read from a checkpoint that is never trained (norm weights, embeddings, biases).

    Deliberately not an `nnx.Param`: `nnx.state(model, nnx.Param)` is exactly the LoRA params."""


class QuantizedBase(FrozenParam):
    """The frozen base weight of a linear layer: a `Weight4bit`, an `Int8Weight` or a plain
    (out, in) array. Its value is a pytree; never trained, never given a gradient."""


def base_shape(base) -> tuple[int, int]:
    """(out_features, in_features) of a Weight4bit / Int8Weight / (out, in) array."""
    shape = tuple(int(d) for d in getattr(base, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"a linear base weight must be 2-D (out, in), got shape {shape}")
    return shape


def host_or_device(a):
    """`a` as an array of a frozen parameter: a numpy array stays on the host (a staged checkpoint's
    tensor, which the model builder stacks and moves in bulk: `jqlora.models.build.to_device`);
    anything else becomes a jax array."""
    return a if isinstance(a, np.ndarray) else jnp.asarray(a)


def _check_base(base):
    if isinstance(base, (quant.Weight4bit, quant.Int8Weight)):
        return base
    if hasattr(base, "shape") and hasattr(base, "dtype"):
        return host_or_device(base)
    raise TypeError(f"QLoRALinear base must be a Weight4bit, an Int8Weight or an (out, in) array, got {type(base).__name__}")


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """alpha / r (LoRA) or alpha / sqrt(r) (rsLoRA), as PEFT computes it."""
    if rank <= 0:
        return 0.0
    return float(alpha) / (math.sqrt(rank) if use_rslora else rank)


def peft_lora_a_init(key, rank: int, in_features: int, dtype=jnp.float32) -> jax.Array:
    """PEFT's default: `kaiming_uniform_(A, a=sqrt(5))` on A (r, in), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    gain = math.sqrt(2.0 / (1.0 + 5.0))
    bound = gain * math.sqrt(3.0 / in_features)
    return jax.random.uniform(key, (rank, in_features), dtype, -bound, bound)


class QLoRALinear(nnx.Module):
    """Frozen linear layer over a quantized or dense base, plus an optional LoRA branch.

    ``y = x @ W.T + scale * (dropout(x) @ lora_A.T) @ lora_B.T + bias``, with ``W`` frozen and
    only ``lora_A`` / ``lora_B`` (``nnx.LoRAParam``) trainable; ``scale`` is ``alpha / rank``
    (``alpha / sqrt(rank)`` with rsLoRA). ``lora_B`` starts at zero, so a fresh branch changes
    nothing.

    Example::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jqlora import quant
      >>> from jqlora.lora import QLoRALinear
      >>> w = jax.random.normal(jax.random.key(0), (32, 64))         # (out, in)
      >>> layer = QLoRALinear(quant.quantize_4bit(w, "nf4"), rank=4, alpha=8, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 64))).shape
      (2, 32)
      >>> layer.lora_A.shape, layer.lora_B.shape                     # PEFT's layout
      ((4, 64), (32, 4))
      >>> [v.shape for v in jax.tree.leaves(nnx.state(layer, nnx.LoRAParam))]
      [(4, 64), (32, 4)]

    Unlike ``flax.nnx.LoRA``, whose ``lora_a`` is ``(in, r)`` and ``lora_b`` ``(r, out)``, the
    matrices here are PEFT's ``lora_A (r, in)`` and ``lora_B (out, r)``, so they map 1:1 onto the
    keys and shapes of a PEFT adapter file (``...q_proj.lora_A.weight``).

    Args:
      base: `Weight4bit`, `Int8Weight` or a dense (out, in) array (y = x @ W.T).
      rank: LoRA rank r; 0 gives a plain frozen linear layer (no LoRA params).
      alpha: LoRA alpha; None means alpha = rank (scale 1).
      dropout: dropout rate on the LoRA branch input only (PEFT semantics). Active unless the
        module is in eval mode (`model.eval()` / `nnx.view(model, deterministic=True)`).
      use_rslora: scale = alpha / sqrt(r) instead of alpha / r.
      bias: optional (out,) array, frozen, added last.
      rngs: `nnx.Rngs`; `params` initialises A, `dropout` drives the dropout mask. Required
        when rank > 0.
      compute_dtype: dtype of the matmul and of the output; None = the input's dtype.
      backend: passed to `jqlora.ops.qmatmul` ("auto", "pallas", "interpret", "xla").
      param_dtype: dtype of A and B (float32 by default).
      numerics: "weight_only" (default), "llm_int8" (an Int8Weight only: bitsandbytes'
        LLM.int8 inference numerics, int8 activations + fp16 outliers) or "fp8" (a Weight4bit
        only: the base products on float8_e4m3fn operands scaled per row, the LoRA branch in the
        compute dtype; see jqlora.ops.qmatmul and jqlora.ops.fp8).
    """

    def __init__(
        self,
        base,
        rank: int = 0,
        alpha: Optional[float] = None,
        dropout: float = 0.0,
        use_rslora: bool = False,
        bias=None,
        *,
        rngs: Optional[nnx.Rngs] = None,
        compute_dtype=None,
        backend: str = "auto",
        param_dtype=jnp.float32,
        numerics: str = "weight_only",
    ):
        base = _check_base(base)
        if numerics == "fp8" and not isinstance(base, quant.Weight4bit):
            raise ValueError(f"numerics='fp8' applies to a 4-bit base (Weight4bit), got "
                             f"{type(base).__name__}")
        self.out_features, self.in_features = base_shape(base)
        self.base = QuantizedBase(base)
        if bias is not None:
            bias = host_or_device(bias)
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({self.out_features},)")
            self.bias = FrozenParam(bias)
        else:
            self.bias = nnx.data(None)
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.backend = backend
        self.numerics = numerics
        self.param_dtype = jnp.dtype(param_dtype)
        self.rank = 0
        self.alpha = 0.0
        self.use_rslora = False
        self.scale = 0.0
        self.lora_A = nnx.data(None)
        self.lora_B = nnx.data(None)
        self.dropout = nnx.data(None)
        if rank:
            self.enable_lora(rank, alpha, dropout=dropout, use_rslora=use_rslora, rngs=rngs)

    # ------------------------------------------------------------------ LoRA state
    def enable_lora(self, rank: int, alpha: Optional[float] = None, *, dropout: float = 0.0,
                    use_rslora: bool = False, rngs: Optional[nnx.Rngs] = None) -> "QLoRALinear":
        """Add a fresh LoRA branch (A PEFT-kaiming-uniform, B zeros) in place."""
        if self.rank:
            raise ValueError("this layer already has a LoRA branch")
        rank = int(rank)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        if rngs is None:
            raise ValueError("a LoRA branch needs rngs (nnx.Rngs) to initialise A")
        lora_A = peft_lora_a_init(rngs.params(), rank, self.in_features, self.param_dtype)
        drop = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
        return self.attach_lora(rank, alpha, use_rslora=use_rslora, lora_A=lora_A, dropout=drop)

    def attach_lora(self, rank: int, alpha: Optional[float], *, use_rslora: bool, lora_A, dropout=None) -> "QLoRALinear":
        """Add a LoRA branch with the given A (r, in), or (n, r, in) for a stacked layer (see
        `jqlora.lora.stacked`), B zeros of the matching shape, and an optional `nnx.Dropout`
        (stacked alike)."""
        if self.rank:
            raise ValueError("this layer already has a LoRA branch")
        alpha = float(rank if alpha is None else alpha)
        lead = tuple(lora_A.shape[:-2])
        self.rank, self.alpha, self.use_rslora = int(rank), alpha, bool(use_rslora)
        self.scale = lora_scale(self.rank, alpha, use_rslora)
        self.lora_A = nnx.LoRAParam(jnp.asarray(lora_A, self.param_dtype))
        self.lora_B = nnx.LoRAParam(jnp.zeros((*lead, self.out_features, self.rank), self.param_dtype))
        self.dropout = dropout if dropout is not None else nnx.data(None)
        return self

    @property
    def has_lora(self) -> bool:
        return self.rank > 0

    def set_lora(self, lora_A, lora_B) -> None:
        """Overwrite A (r, in) and B (out, r) (shapes checked; cast to param_dtype)."""
        if not self.rank:
            raise ValueError("this layer has no LoRA branch; enable it first (apply_lora)")
        want = {"lora_A": (self.rank, self.in_features), "lora_B": (self.out_features, self.rank)}
        for name, arr in (("lora_A", lora_A), ("lora_B", lora_B)):
            if tuple(arr.shape) != want[name]:
                raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]}")
        self.lora_A.set_value(jnp.asarray(lora_A, self.param_dtype))
        self.lora_B.set_value(jnp.asarray(lora_B, self.param_dtype))

    # ------------------------------------------------------------------ forward
    def _dropout_active(self) -> bool:
        d = self.dropout
        return d is not None and d.rate > 0 and not d.deterministic

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.compute_dtype or x.dtype
        base = self.base.get_value()
        kw = {} if self.numerics == "weight_only" else {"numerics": self.numerics}
        if self.rank and not self._dropout_active():
            lora = (self.lora_A[...], self.lora_B[...], self.scale)
            y = _ops.qmatmul(x, base, compute_dtype=dtype, lora=lora, backend=self.backend, **kw)
        else:
            y = _ops.qmatmul(x, base, compute_dtype=dtype, backend=self.backend, **kw)
            if self.rank:  # PEFT: y = base(x) + B(A(dropout(x))) * s
                xd = self.dropout(x).astype(dtype)
                a = self.lora_A[...].astype(dtype)
                b = self.lora_B[...].astype(dtype)
                y = y + ((xd @ a.T) @ b.T * jnp.asarray(self.scale, dtype)).astype(y.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    # ------------------------------------------------------------------ merge
    def delta(self) -> jax.Array:
        """scale * B @ A in float32, shape (out, in); zeros without LoRA."""
        if not self.rank:
            return jnp.zeros((self.out_features, self.in_features), jnp.float32)
        a = self.lora_A[...].astype(jnp.float32)
        b = self.lora_B[...].astype(jnp.float32)
        return jnp.float32(self.scale) * (b @ a)

    def merge(self, requantize: bool = False):
        """The merged weight W + scale * B @ A.

        requantize=False: a dense float32 (out, in) array (exact up to fp32 rounding).
        requantize=True: the same format as the base: a new `Weight4bit` (same quant_type,
          blocksize, nesting and recorded stored_dtype) or `Int8Weight` (same threshold), or the
          base's dtype for a dense base. Re-quantizing recomputes absmax/SCB and is lossy, like
          PEFT's merge into bitsandbytes layers.

        The module itself is never modified: the original base stays in place, so there is
        nothing to "unmerge" (PEFT's unmerge of a quantized layer subtracts the delta and
        re-quantizes again, which is lossy twice; here you keep the original module instead).
        Use `merged_layer()` for a LoRA-free layer built on the merged weight.
        """
        base = self.base.get_value()
        w = quant.dequantize(base, jnp.float32) + self.delta()
        if not requantize:
            return w
        if isinstance(base, quant.Weight4bit):
            q = quant.quantize_4bit(w, quant_type=base.quant_type, blocksize=base.blocksize,
                                    double_quant=base.nested)
            return dataclasses.replace(q, stored_dtype=base.stored_dtype)
        if isinstance(base, quant.Int8Weight):
            q = quant.quantize_int8(w, threshold=base.threshold)
            return dataclasses.replace(q, stored_dtype=base.stored_dtype)
        return w.astype(base.dtype)

    def merged_layer(self, requantize: bool = True) -> "QLoRALinear":
        """A new rank-0 `QLoRALinear` over `merge(requantize)` with the same bias/dtype/backend."""
        bias = None if self.bias is None else self.bias.get_value()
        merged = self.merge(requantize)
        fp8_lost = self.numerics == "fp8" and not isinstance(merged, quant.Weight4bit)
        return QLoRALinear(merged, bias=bias, compute_dtype=self.compute_dtype, backend=self.backend,
                           numerics="weight_only" if fp8_lost else self.numerics)
