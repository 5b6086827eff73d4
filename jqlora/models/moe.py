"""The sparse mixture-of-experts block of Qwen3-MoE and Mixtral, computed as transformers 5 does.

Routing (`route`): router logits = x @ W_gate.T in the compute dtype (float32 accumulation, like
`F.linear`), softmax over all experts in float32, top-k of the probabilities (`lax.top_k`: ties go
to the lower expert index), renormalised to sum to one where the model says so (Mixtral always,
Qwen3-MoE with `norm_topk_prob`); the routing weights stay float32 for Mixtral and are cast to the
compute dtype for Qwen3-MoE. Every token goes to exactly k experts (no capacity, no dropping).

Experts (`MoEBlock.__call__`): the (token, slot) pairs are sorted by expert (a stable sort, as
transformers' `grouped_mm` path does), each expert's rows run gate_up -> SwiGLU -> down through the
grouped 4-bit product (`QLoRAExperts`, `jqlora.ops.qgmm`), each row is scaled by its routing
weight, the rows are put back in token order and the k of a token summed in float32, then rounded
once to the compute dtype. The moves between token and expert order are `jqlora.ops.rows.take_rows`,
whose backward is a gather (a GPU runs the scatter-add of `x[index]`'s backward with atomics).

The gate_up stack holds the gate rows first, then the up rows (transformers' fused layout).
`load_balancing_loss` is transformers' `load_balancing_loss_func` (Switch Transformer, eq. 4-6).
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jqlora.lora.experts import QLoRAExperts, Router
from jqlora.models.config import ModelConfig
from jqlora.ops.rows import inverse_permutation, take_rows


def route(logits: jax.Array, top_k: int, *, normalize: bool, weights_f32: bool):
    """(T, E) router logits -> (weights (T, k), expert ids (T, k) int32), as transformers routes."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    if not weights_f32:
        top = top.astype(logits.dtype)
    return top, idx.astype(jnp.int32)


def load_balancing_loss(router_logits: Sequence[jax.Array], num_experts: int, top_k: int,
                        mask: Optional[jax.Array] = None) -> jax.Array:
    """transformers' `load_balancing_loss_func`: over every layer's (N, E) logits,
    E * sum_e f_e * P_e with f_e the share of tokens whose top k hold expert e (the f_e sum to k)
    and P_e the mean router probability of e, both over all layers' tokens; `mask` (N,) or
    (B, T) with N = B * T, transformers' attention_mask, leaves the tokens where it is 0 out."""
    counts = jnp.zeros((num_experts,), jnp.float32)
    prob_sum = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.float32(0.0)
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, idx = jax.lax.top_k(probs, top_k)
        w = jnp.ones(idx.shape[0], jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
        counts = counts + jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(jnp.repeat(w, top_k))
        prob_sum = prob_sum + jnp.sum(probs * w[:, None], axis=0)
        rows = rows + jnp.sum(w)
    return jnp.sum((counts / rows) * (prob_sum / rows)) * num_experts


class Experts(nnx.Module):
    """The HF `mlp.experts` module: gate_up_proj (E, 2I, H) and down_proj (E, H, I) stacks."""

    def __init__(self, gate_up_proj: QLoRAExperts, down_proj: QLoRAExperts, act: str = "silu"):
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act = act

    def __call__(self, xs, group_sizes, ids=None):
        """Rows sorted by expert with `group_sizes` rows each, or (ids) each row's own expert."""
        h = self.gate_up_proj(xs, group_sizes, ids)
        g, u = jnp.split(h, 2, axis=-1)
        if self.act in ("silu", "swish"):
            g = jax.nn.silu(g)
        else:  # gelu / gelu_pytorch_tanh / gelu_new, as the dense MLP reads hidden_act
            g = jax.nn.gelu(g, approximate=self.act != "gelu")
        return self.down_proj(g * u, group_sizes, ids)


class MoEBlock(nnx.Module):
    """The sparse MoE block (HF `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`): `gate` (the
    router, dense) and `experts`. Called like the dense `MLP`: (B, T, H) -> (B, T, H)."""

    def __init__(self, config: ModelConfig, gate: Router, experts: Experts):
        self.gate = gate
        self.experts = experts
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.normalize = config.norm_topk_prob
        self.weights_f32 = config.router_weights_f32

    def router_logits(self, x: jax.Array) -> jax.Array:
        """(..., H) -> (N, E): the router's logits of every token, in the compute dtype."""
        return self.gate(x.reshape(-1, x.shape[-1]))

    def __call__(self, x: jax.Array, chunk: int = 0, *, return_router_logits: bool = False):
        """x (B, T, H) -> (B, T, H) [, router logits (B*T, E)]. `chunk` is the dense MLP's
        long-sequence option and is not used here."""
        b, t, hdim = x.shape
        flat = x.reshape(b * t, hdim)
        logits = self.gate(flat)
        weights, idx = route(logits, self.top_k, normalize=self.normalize, weights_f32=self.weights_f32)
        out = self.combine(flat, weights, idx).reshape(b, t, hdim)
        return (out, logits) if return_router_logits else out

    def combine(self, flat: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """The experts' weighted sum for tokens `flat` (N, H) routed to `idx` (N, k) with `weights`."""
        n, k = idx.shape
        ids = idx.reshape(-1)
        if n * k < self.num_experts:  # decoding a few tokens: read only the chosen experts
            y = self.experts(jnp.repeat(flat, k, axis=0), None, ids)
            y = y * weights.reshape(-1)[:, None]
            return jnp.sum(y.reshape(n, k, -1).astype(jnp.float32), axis=1).astype(y.dtype).astype(flat.dtype)
        order = jnp.argsort(ids, stable=True)          # (token, slot) pairs grouped by expert
        where = inverse_permutation(order)              # each pair's row in expert order
        order, where = jax.lax.optimization_barrier((order, where))  # indices made once, not per element
        group_sizes = jnp.bincount(ids, length=self.num_experts).astype(jnp.int32)
        # one-to-one moves (take_rows: their gradients are gathers, not scatter-adds)
        y = self.experts(take_rows(jnp.repeat(flat, k, axis=0), order, where), group_sizes)  # (N*k, H), sorted
        y = y * take_rows(weights.reshape(-1), order, where)[:, None]  # Mixtral: float32 weights promote
        y = take_rows(y, where, order)                  # back to (token, slot) order
        return jnp.sum(y.reshape(n, k, -1).astype(jnp.float32), axis=1).astype(y.dtype).astype(flat.dtype)


def build_block(config: ModelConfig, src, prefix: str) -> MoEBlock:
    """The MoE block of one layer from a tensor source (`jqlora.models.build._Source`): router
    `<prefix>.gate`, experts `<prefix>.experts.gate_up_proj` (E, 2I, H) and `.down_proj` (E, H, I)."""
    c = config
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    gate = src.router(f"{prefix}.gate", e, h)
    experts = Experts(src.experts(f"{prefix}.experts.gate_up_proj", e, 2 * i, h),
                      src.experts(f"{prefix}.experts.down_proj", e, h, i), c.hidden_act)
    return MoEBlock(c, gate, experts)
