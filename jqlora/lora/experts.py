"""`QLoRAExperts`: a frozen stack of E expert weights (E, N, K) with an optional LoRA per expert.

    y[rows of e] = x[rows of e] @ W_e.T + scale * (x[rows of e] @ A_e.T) @ B_e.T

for tokens already sorted by expert (`group_sizes` rows per expert, in order). The base is a
`jqlora.quant.ExpertWeights` (NF4/FP4, int8 or a float stack) multiplied by `jqlora.ops.qgmm`,
whose backward dequantizes again (no dense stack kept). The LoRA factors are stacked per expert:
A (E, r, K) and B (E, N, r), `nnx.LoRAParam`s in float32, one scale for all experts (PEFT's
`target_parameters` LoRA, `ParamWrapper`); their products run per tile of one expert's rows
(`grouped_lora`), differentiated with respect to both factors by autodiff (gathers and matmuls:
no scatter-add in the backward).

`Router` is the mixture's gate: a dense `QLoRALinear` that never holds a quantized weight, and that
`apply_lora` targets only when it is named (PEFT's "all-linear" does not reach it either).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jqlora import quant
from jqlora.lora.linear import QLoRALinear, QuantizedBase, lora_scale
from jqlora.ops.qgmm import qgmm
from jqlora.ops.rows import take_rows


class Router(QLoRALinear):
    """The router (gate) of a mixture-of-experts block: logits = x @ W.T, W (E, hidden) dense."""


def peft_expert_lora_a_init(key, num_experts: int, rank: int, in_features: int, dtype=jnp.float32) -> jax.Array:
    """PEFT's init of a `target_parameters` lora_A (r * E, in): kaiming-uniform with fan_in = in,
    U(-1/sqrt(in), 1/sqrt(in)); returned as jqlora's stack (E, r, in)."""
    gain = math.sqrt(2.0 / (1.0 + 5.0))
    bound = gain * math.sqrt(3.0 / in_features)
    return jax.random.uniform(key, (num_experts, rank, in_features), dtype, -bound, bound)


def _tile_rows(group_sizes: jax.Array, m: int):
    """The rows of tokens sorted by expert laid out as tiles of one expert each: (rows (n * t,) the
    source row of each tile slot, M where a tile runs past its group; slots (M,) the tile slot of
    each row, n * t for rows past the groups' sum; experts (n,) of each tile; t). n and t are
    static: t = a power of two near M / E (8 to 128), n = M // t + E (each group adds at most one
    partial tile), so a padded layout costs at most E * t extra rows."""
    e = group_sizes.shape[0]
    t = int(min(128, max(8, 1 << max(0, math.ceil(math.log2(max(1, -(-m // e))))))))
    n = m // t + e
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = -(-sizes // t)
    tile_starts = jnp.cumsum(tiles) - tiles
    tile = jnp.arange(n, dtype=jnp.int32)
    expert = jnp.clip(jnp.searchsorted(jnp.cumsum(tiles), tile, side="right", method="compare_all"), 0, e - 1).astype(jnp.int32)
    offset = (tile - tile_starts[expert]) * t
    within = offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = (within < sizes[expert][:, None]) & (tile < jnp.sum(tiles))[:, None]
    rows = jnp.where(valid, starts[expert][:, None] + within, m).reshape(-1)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.clip(jnp.searchsorted(ends, row, side="right", method="compare_all"), 0, e - 1).astype(jnp.int32)
    at = row - starts[group]
    slots = jnp.where(row < ends[-1], (tile_starts[group] + at // t) * t + at % t, n * t).astype(jnp.int32)
    # searchsorted compares against all E boundaries at once ("compare_all": one fused kernel; the
    # default binary search is a while loop of small kernels and copies, about log2(E) launches each).
    # materialized: fused into the gathers that use them, these few integer ops per row would run
    # once per element (a GPU spent about 0.7 ms a layer so in a Qwen3-30B-A3B-shaped step)
    rows, slots, expert = jax.lax.optimization_barrier((rows, slots, expert))
    return rows, slots, expert, t


def _per_tile(stack: jax.Array, expert: jax.Array) -> jax.Array:
    """stack[expert] (one expert's factor per tile), computed as a one-hot product: its transpose,
    the factors' gradient summed over each expert's tiles, is then a matmul too, not a scatter-add.
    Exact: one nonzero term per output, accumulated in float32."""
    onehot = jax.nn.one_hot(expert, stack.shape[0], dtype=stack.dtype)
    return jnp.einsum("ne,e...->n...", onehot, stack, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(stack.dtype)


def grouped_lora(xs: jax.Array, group_sizes: jax.Array, lora_a: jax.Array, lora_b: jax.Array) -> jax.Array:
    """Per expert e: (xs[rows of e] @ A_e.T) @ B_e.T for xs (M, K) sorted by expert, A (E, r, K), B
    (E, N, r); float32 accumulation, xs' dtype out, rows past sum(group_sizes) zero.

    The rows are moved into tiles of one expert each and multiplied by that expert's factors as a
    batched matmul (a dense product of the rank-r factors per tile), not through
    `jax.lax.ragged_dot`, which a GPU runs as a dense expansion over all E experts. Gradients by
    autodiff; the row moves are `take_rows` and the per-tile factors one-hot products, so the
    backward has gathers and matmuls but no scatter-adds."""
    m = xs.shape[0]
    rows, slots, expert, t = _tile_rows(group_sizes, m)
    padded = take_rows(xs, rows, slots).reshape(-1, t, xs.shape[1])  # (n, t, K)
    u = jnp.einsum("ntk,nrk->ntr", padded, _per_tile(lora_a, expert), preferred_element_type=jnp.float32)
    v = jnp.einsum("ntr,nmr->ntm", u.astype(xs.dtype), _per_tile(lora_b, expert), preferred_element_type=jnp.float32)
    return take_rows(v.reshape(-1, v.shape[-1]).astype(xs.dtype), slots, rows)


class QLoRAExperts(nnx.Module):
    """E frozen expert weights of shape (out_features, in_features) plus an optional LoRA branch
    per expert (A (E, r, in), B (E, out, r), B zero at start).

    Args:
      base: a `jqlora.quant.ExpertWeights`.
      compute_dtype: the dtype of the products and of the output; None = the input's dtype.
      backend: `jqlora.ops.qgmm`'s backend.
      param_dtype: the dtype of A and B.
    """

    def __init__(self, base, *, compute_dtype=None, backend: str = "auto", param_dtype=jnp.float32):
        if not isinstance(base, quant.ExpertWeights):
            raise TypeError(f"QLoRAExperts base must be an ExpertWeights, got {type(base).__name__}")
        self.num_experts, self.out_features, self.in_features = (int(d) for d in base.shape)
        self.base = QuantizedBase(base)
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.backend = backend
        self.param_dtype = jnp.dtype(param_dtype)
        self.rank = 0
        self.alpha = 0.0
        self.use_rslora = False
        self.scale = 0.0
        self.lora_A = nnx.data(None)
        self.lora_B = nnx.data(None)
        self.dropout = nnx.data(None)

    # ------------------------------------------------------------------ LoRA state
    @property
    def has_lora(self) -> bool:
        return self.rank > 0

    def lora_shapes(self) -> dict:
        return {"lora_A": (self.num_experts, self.rank, self.in_features),
                "lora_B": (self.num_experts, self.out_features, self.rank)}

    def enable_lora(self, rank: int, alpha: Optional[float] = None, *, rngs: nnx.Rngs,
                    use_rslora: bool = False) -> "QLoRAExperts":
        a = peft_expert_lora_a_init(rngs.params(), self.num_experts, int(rank), self.in_features, self.param_dtype)
        return self.attach_lora(rank, alpha, use_rslora=use_rslora, lora_A=a)

    def attach_lora(self, rank: int, alpha: Optional[float], *, use_rslora: bool, lora_A, dropout=None):
        """Add a LoRA branch with the given A (E, r, in), or (n, E, r, in) for a stacked layer;
        B zeros of the matching shape. No dropout: PEFT's expert LoRA has none."""
        if self.rank:
            raise ValueError("these experts already have a LoRA branch")
        if dropout is not None:
            raise ValueError("LoRA dropout on expert weights is not supported (PEFT's target_parameters "
                             "LoRA needs lora_dropout 0)")
        alpha = float(rank if alpha is None else alpha)
        lead = tuple(lora_A.shape[:-2])
        self.rank, self.alpha, self.use_rslora = int(rank), alpha, bool(use_rslora)
        self.scale = lora_scale(self.rank, alpha, use_rslora)
        self.lora_A = nnx.LoRAParam(jnp.asarray(lora_A, self.param_dtype))
        self.lora_B = nnx.LoRAParam(jnp.zeros((*lead[:-1], self.num_experts, self.out_features, self.rank),
                                              self.param_dtype))
        return self

    def set_lora(self, lora_A, lora_B) -> None:
        """Overwrite A (E, r, in) and B (E, out, r) (shapes checked; cast to param_dtype)."""
        if not self.rank:
            raise ValueError("these experts have no LoRA branch; enable it first (apply_lora)")
        want = self.lora_shapes()
        for name, arr in (("lora_A", lora_A), ("lora_B", lora_B)):
            if tuple(arr.shape) != want[name]:
                raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]}")
        self.lora_A.set_value(jnp.asarray(lora_A, self.param_dtype))
        self.lora_B.set_value(jnp.asarray(lora_B, self.param_dtype))

    # ------------------------------------------------------------------ forward
    def __call__(self, xs: jax.Array, group_sizes: jax.Array, ids: Optional[jax.Array] = None) -> jax.Array:
        """xs (M, in) sorted by expert, group_sizes (E,) -> (M, out) in the compute dtype.

        ids (M,): each row's expert instead (`group_sizes` unused): the M chosen experts' weights
        are gathered and each row multiplies its own, so only those experts are read (decoding a
        few tokens, M < E)."""
        dtype = self.compute_dtype or xs.dtype
        xs = xs.astype(dtype)
        if ids is not None:
            return self._gathered(xs, ids, dtype)
        y = qgmm(xs, group_sizes, self.base.get_value(), backend=self.backend, out_dtype=dtype)
        if self.rank:
            u = grouped_lora(xs, group_sizes, self.lora_A[...].astype(dtype), self.lora_B[...].astype(dtype))
            y = y + (u * jnp.asarray(self.scale, dtype)).astype(y.dtype)
        return y

    def _gathered(self, xs, ids, dtype):
        base = self.base.get_value()
        chosen = dataclasses.replace(base, stack=jax.tree.map(lambda a: a[ids], base.stack),
                                     num_experts=int(ids.shape[0]))
        y = qgmm(xs, jnp.ones(ids.shape, jnp.int32), chosen, backend=self.backend, out_dtype=dtype)
        if self.rank:
            u = jnp.einsum("mk,mrk->mr", xs, self.lora_A[...][ids].astype(dtype))
            u = jnp.einsum("mr,mnr->mn", u, self.lora_B[...][ids].astype(dtype))
            y = y + (u * jnp.asarray(self.scale, dtype)).astype(y.dtype)
        return y

    # ------------------------------------------------------------------ merge
    def delta(self) -> jax.Array:
        """scale * B_e @ A_e for every expert, float32 (E, out, in); zeros without LoRA."""
        if not self.rank:
            return jnp.zeros((self.num_experts, self.out_features, self.in_features), jnp.float32)
        a = self.lora_A[...].astype(jnp.float32)
        b = self.lora_B[...].astype(jnp.float32)
        return jnp.float32(self.scale) * jnp.einsum("enr,erk->enk", b, a)

    def merge(self) -> jax.Array:
        """The merged stack W_e + scale * B_e @ A_e, dense float32 (E, out, in)."""
        return quant.dequantize_experts(self.base.get_value(), jnp.float32) + self.delta()
