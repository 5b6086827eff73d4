"""Decoder-only causal LMs in Flax NNX: Llama 2/3 (incl. llama3 RoPE scaling), Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 (text) and Phi-3 (fused qkv_proj / gate_up_proj, LongRoPE, partial rotary). The
differences between the families are `ModelConfig` fields.

Module tree names equal the HF module names (`model.layers.0.self_attn.q_proj`,
`model.layers.0.mlp.gate_proj`, `model.norm`, `lm_head`), so `jqlora.lora.named_linears`,
`lora_params_by_module` and the loader map 1:1 onto checkpoint and PEFT keys.

Numerics follow transformers: RMSNorm in float32 (Llama: weight applied after casting back; Gemma:
(1 + weight) applied in float32, then cast), gated MLP (SwiGLU, or GeGLU for Gemma); RoPE, masks
and the attention itself are `jqlora.models.attention`'s. Every tensor read from the
checkpoint is frozen (`FrozenParam` / `QuantizedBase`); only LoRA matrices are `nnx.Param`s.
The modules take their tensors from a source (`jqlora.models.build`: `from_params` builds a model
from a dict of arrays); this file knows no files.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jqlora import ops as _ops
from jqlora.errors import SettingError
from jqlora.ops import cached_attention, decode_norm, sharding
from jqlora.lora.fuse import fuse_linears, fusion_problem
from jqlora.lora.linear import FrozenParam, QLoRALinear, host_or_device
from jqlora.lora.stacked import LayerStack, StackedLayers
import jqlora.models.packed_attention as packed_attention
import jqlora.models.moe as moe
from jqlora.models.attention import (ATTENTION_IMPLS, apply_rope, attend, ring_attend, rope_cos_sin,
                                     segment_positions, softcap)
from jqlora.models.cache import KVCache
from jqlora.models.config import ModelConfig
from jqlora.models.remat import (LAYER_INPUT, REMAT_POLICIES, mlp_chunk_for, remat_plan, resolve_remat,
                                 state_bytes)


def _activation(name: str) -> Callable:
    if name in ("silu", "swish"):
        return jax.nn.silu
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    return lambda x: jax.nn.gelu(x, approximate=True)  # gelu_pytorch_tanh / gelu_new


# ---------------------------------------------------------------------------------------- layers
class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) in float32. kind "llama" (HF LlamaRMSNorm): back to x.dtype, then
    times weight. kind "gemma" (HF Gemma2/3RMSNorm): times (1 + weight) in float32, then back to
    x.dtype (Gemma stores the offset from one)."""

    def __init__(self, weight, eps: float, kind: str = "llama"):
        if kind not in ("llama", "gemma"):
            raise ValueError(f"unknown norm kind {kind!r}")
        self.weight = FrozenParam(host_or_device(weight))
        self.eps = float(eps)
        self.kind = kind

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.kind == "gemma":
            return (h * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * h.astype(x.dtype)

    def add_and_norm(self, x: jax.Array, delta: Optional[jax.Array], decoding: Optional[str] = None):
        """(r, norm(r)) with r = x + delta (x when delta is None). decoding: the kernel backend of a
        decoding step (one new token a row), which runs both as one `rms_norm` kernel where
        `jqlora.ops.decode_norm` takes the step; None: XLA."""
        if decoding is not None and decode_norm.norm_problem(decoding, x.shape) is None:
            return decode_norm.add_rms_norm(x, delta, self.weight[...], eps=self.eps, kind=self.kind,
                                            backend=decoding)
        r = x if delta is None else x + delta
        return r, self(r)


class Embedding(nnx.Module):
    """The token table; `scale` (Gemma: sqrt(hidden)) multiplies the rows after rounding it to the
    compute dtype, as transformers rounds it to the model's dtype (sqrt(640) is 25.25 in bf16). The
    tied output projection uses the unscaled table."""

    def __init__(self, weight, scale: Optional[float] = None):
        weight = host_or_device(weight)
        if weight.ndim != 2:
            raise ValueError(f"embedding weight must be 2-D (vocab, hidden), got shape {weight.shape}")
        self.weight = FrozenParam(weight)
        self.scale = scale

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        x = jnp.take(self.weight[...], ids, axis=0).astype(dtype)
        return x if self.scale is None else x * jnp.asarray(self.scale, dtype)

    def attend(self, x: jax.Array, dtype) -> jax.Array:
        """Tied output projection: x @ E.T."""
        return _ops.qmatmul(x, self.weight[...], compute_dtype=dtype, backend="auto")


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, linears: Mapping[str, QLoRALinear], norms: Mapping[str, Any],
                 window: Optional[int]):
        self.config = config
        self.window = window
        if config.fused_projections:  # Phi-3: q, k and v rows stacked in one linear (PEFT's and bnb's unit)
            self.qkv_proj = linears["qkv_proj"]
        else:
            self.q_proj = linears["q_proj"]
            self.k_proj = linears["k_proj"]
            self.v_proj = linears["v_proj"]
        self.o_proj = linears["o_proj"]
        if config.qk_norm:
            self.q_norm = RMSNorm(norms["q_norm"], config.rms_norm_eps, config.norm_kind)
            self.k_norm = RMSNorm(norms["k_norm"], config.rms_norm_eps, config.norm_kind)

    def __call__(self, x, cos, sin, q_slots, k_slots, q_seg, k_seg, runs=None, kv_cache=None, index=None,
                 impl: str = "einsum", plain_causal: bool = False):
        """-> (output (B, T, hidden), the updated cache arrays or None). impl: an attention of
        ATTENTION_IMPLS without a cache; with one, the kernel backend of cached decoding, which
        runs one new token a row through `jqlora.ops.cached_attention` where its kernel takes the
        step, and the einsum path otherwise (prefill, ring buffers, other head sizes)."""
        cfg = self.config
        b, t, _ = x.shape
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):  # Phi-3's checkpoint, or q, k and v fused for decoding
            q, k, v = jnp.split(self.qkv_proj(x), [h * d, (h + kvh) * d], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kvh, d), v.reshape(b, t, kvh, d)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        new_kv = None
        if kv_cache is not None and len(kv_cache) > 3 and kv_cache[3]:  # a sliding layer's ring buffer
            k, v, k_slots, k_seg, new_kv = ring_attend(k, v, *kv_cache[:3], index, k_seg)
            k, v = k.astype(x.dtype), v.astype(x.dtype)
        elif kv_cache is not None:
            # (L, B, S, kvh, d) arrays of every layer and this layer's index: only the new tokens are
            # written, in place (a while_loop carry), never a copy of the layer's whole slab.
            ck, cv, layer = kv_cache[:3]
            zero = jnp.zeros((), jnp.int32)
            at = (layer, zero, jnp.asarray(index, jnp.int32), zero, zero)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], at)
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], at)
            new_kv = (ck, cv)
            if cached_attention.kernel_problem(impl, q.shape, ck.shape) is None:
                out = cached_attention.decode_attention(q, ck, cv, layer, index, q_seg, k_seg, scale=cfg.attn_scale,
                                                        cap=cfg.attn_softcap, window=self.window, backend=impl)
                return self.o_proj(out), new_kv
            k = jax.lax.dynamic_index_in_dim(ck, layer, 0, keepdims=False).astype(x.dtype)
            v = jax.lax.dynamic_index_in_dim(cv, layer, 0, keepdims=False).astype(x.dtype)
        out = attend(q, k, v, q_slots, k_slots, q_seg, k_seg, scale=cfg.attn_scale, cap=cfg.attn_softcap,
                     window=self.window, dtype=x.dtype, impl="einsum" if kv_cache is not None else impl,
                     plain_causal=plain_causal, runs=runs)
        return self.o_proj(out), new_kv

    def fuse_projections(self) -> Optional[str]:
        """Replace q_proj, k_proj and v_proj by one qkv_proj computing the same (`jqlora.lora.fuse`),
        in place; -> why not, or None when fused (or already one linear)."""
        if hasattr(self, "qkv_proj"):
            return None
        parts = [self.q_proj, self.k_proj, self.v_proj]
        problem = fusion_problem(parts)
        if problem is None:
            self.qkv_proj = fuse_linears(parts)
            del self.q_proj, self.k_proj, self.v_proj
        return problem


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, linears: Mapping[str, QLoRALinear]):
        if "gate_up_proj" in linears:  # Phi-3: gate rows, then up rows, in one linear
            self.gate_up_proj = linears["gate_up_proj"]
        else:
            self.gate_proj = linears["gate_proj"]
            self.up_proj = linears["up_proj"]
        self.down_proj = linears["down_proj"]
        self.act = config.hidden_act

    def __call__(self, x, chunk: int = 0):
        """chunk > 0: the rows' tokens in chunks of `chunk` (a divisor of T), each chunk
        checkpointed, so a backward pass holds one chunk's intermediates (long sequences under full
        remat, `remat.mlp_chunk_for`). Needs no active LoRA dropout (its RNG cannot advance inside
        the loop over chunks); with dropout the rows run whole."""
        b, t, h = x.shape
        if chunk and t > chunk and t % chunk == 0 and not self._has_dropout():
            xs = jnp.moveaxis(x.reshape(b, t // chunk, chunk, h), 1, 0)
            ys = jax.lax.map(jax.checkpoint(self._dense, prevent_cse=False), xs)
            return jnp.moveaxis(ys, 0, 1).reshape(b, t, ys.shape[-1])
        return self._dense(x)

    def _dense(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
            return self.down_proj(_activation(self.act)(gate) * up)
        return self.down_proj(_activation(self.act)(self.gate_proj(x)) * self.up_proj(x))

    def _has_dropout(self) -> bool:
        return any(isinstance(n, nnx.Dropout) for _, n in nnx.iter_graph(self))

    def fuse_projections(self) -> Optional[str]:
        """Replace gate_proj and up_proj by one gate_up_proj (gate rows, then up rows) computing the
        same (`jqlora.lora.fuse`), in place; -> why not, or None when fused (or already one)."""
        if hasattr(self, "gate_up_proj"):
            return None
        parts = [self.gate_proj, self.up_proj]
        problem = fusion_problem(parts)
        if problem is None:
            self.gate_up_proj = fuse_linears(parts)
            del self.gate_proj, self.up_proj
        return problem


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, src: "_Source", prefix: str, window: Optional[int]):
        c = config
        lin = lambda n, o, i, bias: src.linear(f"{prefix}.{n}", o, i, bias)  # noqa: E731
        if c.fused_projections:
            attn_lin = {"qkv_proj": lin("self_attn.qkv_proj", c.q_features + 2 * c.kv_features, c.hidden_size,
                                        c.qkv_bias)}
        else:
            attn_lin = {
                "q_proj": lin("self_attn.q_proj", c.q_features, c.hidden_size, c.qkv_bias),
                "k_proj": lin("self_attn.k_proj", c.kv_features, c.hidden_size, c.qkv_bias),
                "v_proj": lin("self_attn.v_proj", c.kv_features, c.hidden_size, c.qkv_bias),
            }
        attn_lin["o_proj"] = lin("self_attn.o_proj", c.hidden_size, c.q_features, c.o_bias)
        norms = {}
        if c.qk_norm:
            norms = {n: src.tensor(f"{prefix}.self_attn.{n}.weight", (c.head_dim,)) for n in ("q_norm", "k_norm")}
        self.self_attn = Attention(c, attn_lin, norms, window)
        self.window = window
        if c.sparse_layers and c.sparse_layers[int(prefix.rsplit(".", 1)[-1])]:  # a mixture-of-experts layer
            self.mlp = moe.build_block(c, src, f"{prefix}.mlp")
        else:
            if c.fused_projections:
                mlp_lin = {"gate_up_proj": lin("mlp.gate_up_proj", 2 * c.intermediate_size, c.hidden_size,
                                               c.mlp_bias)}
            else:
                mlp_lin = {"gate_proj": lin("mlp.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
                           "up_proj": lin("mlp.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias)}
            mlp_lin["down_proj"] = lin("mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias)
            self.mlp = MLP(c, mlp_lin)
        norm = lambda n: RMSNorm(src.tensor(f"{prefix}.{n}.weight", (c.hidden_size,)), c.rms_norm_eps,  # noqa: E731
                                 c.norm_kind)
        self.input_layernorm = norm("input_layernorm")
        # Llama: the norm before the MLP. Gemma (sandwich norms): the norm of the attention output,
        # and two more around the MLP.
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.sandwich = c.sandwich_norms
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")

    def __call__(self, x, cos, sin, q_slots, k_slots, q_seg, k_seg, runs=None, kv_cache=None, index=None,
                 impl: str = "einsum", plain_causal: bool = False, mlp_chunk: int = 0, router_logits: bool = False):
        """-> (x, new_kv), or (x, new_kv, router logits (B*T, E) or None for a dense MLP) with
        `router_logits` (the load-balancing loss reads them)."""
        if isinstance(cos, tuple):  # (global, local) RoPE tables: Gemma 3's sliding layers take the local one
            j = 0 if self.window is None else 1
            cos, sin = cos[j], sin[j]
        # a decoding step's norms (and the residual add before one) as one kernel each: decode_norm
        decoding = impl if kv_cache is not None and x.shape[1] == 1 else None
        _, h = self.input_layernorm.add_and_norm(x, None, decoding)
        a, new_kv = self.self_attn(h, cos, sin, q_slots, k_slots, q_seg, k_seg, runs, kv_cache, index, impl,
                                   plain_causal)
        if self.sandwich:
            _, a = self.post_attention_layernorm.add_and_norm(a, None, decoding)
            x, h = self.pre_feedforward_layernorm.add_and_norm(x, a, decoding)
            m, logits = self._mlp(h, mlp_chunk, router_logits)
            x = x + self.post_feedforward_layernorm.add_and_norm(m, None, decoding)[1]
        else:
            x, h = self.post_attention_layernorm.add_and_norm(x, a, decoding)
            m, logits = self._mlp(h, mlp_chunk, router_logits)
            x = x + m
        return (x, new_kv, logits) if router_logits else (x, new_kv)

    def fuse_projections(self) -> dict:
        """Fuse the projections that read one input (q|k|v, and gate|up of a dense MLP) in place,
        for decoding; -> {module: why not} for those left apart."""
        left = {}
        for name, part in (("self_attn", self.self_attn), ("mlp", self.mlp)):
            problem = part.fuse_projections() if isinstance(part, (Attention, MLP)) else "a mixture-of-experts block"
            if problem:
                left[name] = problem
        return left

    def _mlp(self, x, chunk: int, router_logits: bool):
        """The MLP's output, and a mixture-of-experts block's router logits when asked (else None)."""
        if router_logits and isinstance(self.mlp, moe.MoEBlock):
            return self.mlp(x, chunk, return_router_logits=True)
        return self.mlp(x, chunk), None


class LlamaModel(nnx.Module):
    """The HF `model.` submodule: embed_tokens, layers (a `DecoderLayers`), norm."""

    def __init__(self, config: ModelConfig, src: "_Source"):
        c = config
        self.embed_tokens = Embedding(src.tensor("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),
                                      c.embed_scale)
        layers = [DecoderLayer(c, src, f"model.layers.{i}", c.sliding_windows[i]) for i in range(c.num_hidden_layers)]
        self.layers = DecoderLayers(layers, donate=src.donation(layers))
        self.norm = RMSNorm(src.tensor("model.norm.weight", (c.hidden_size,)), c.rms_norm_eps, c.norm_kind)


@dataclasses.dataclass(frozen=True)
class HoistedLayers:
    """A stack's layers sliced once, before a decode loop (`DecoderStack.layer_states`): the
    module graph they run as (the stack's, or with fused projections), each layer's (RNG state,
    other state), and {module: why its projections stay apart} (the same for every layer)."""
    graphdef: Any
    states: list
    left_apart: dict


class DecoderStack(LayerStack):
    """Consecutive decoder layers of one structure, stored stacked (`jqlora.lora.stacked`); the
    forward is one `lax.scan` over them, so the compiled program holds one layer's code whatever
    the depth."""

    def layer_states(self, fuse: bool = False, lora_dtype=None) -> "HoistedLayers":
        """Each layer's (RNG state, other state), sliced out of the stacks: what `__call__(layers=...)`
        runs. Sliced once outside a decode loop, the slices are that loop's invariants; sliced by
        the scan inside it, every token would copy every layer's weights again (a kernel takes a
        whole array, not a slice of one). fuse: each layer's projections that read one input run
        as one product (`DecoderLayer.fuse_projections`; the layers must be in eval mode).
        lora_dtype: the LoRA matrices cast to it once, here (the compute dtype: every product
        rounds them to it, and inside the loop that would be a cast per layer and token)."""
        graphdef, rng_state, lora, rest = nnx.split(self.layer, nnx.RngState, nnx.LoRAParam, ...)
        if lora_dtype is not None:
            lora = jax.tree.map(lambda a: a.astype(lora_dtype), lora)
        out, left, out_def = [], {}, None
        for j in range(self.size):
            layer = nnx.merge(graphdef, *jax.tree.map(lambda a: a[j], (rng_state, lora, rest)))
            if fuse:
                left = layer.fuse_projections()
            layer_def, *layer_state = nnx.split(layer, nnx.RngState, ...)
            if out_def is not None and layer_def != out_def:
                raise AssertionError("layers of one stack hoisted into different structures")
            out_def = layer_def
            out.append(tuple(layer_state))
        return HoistedLayers(out_def, out, left)

    def __call__(self, x, aux, cache, *, index, impl, plain_causal, policy, collect: bool, layers=None,
                 cache_row: Optional[int] = None, ring: bool = False, router_logits: bool = False):
        """-> (x, cache, each layer's output stacked (size, B, T, H) or None without `collect`,
        each layer's router logits stacked (size, B*T, E) with `router_logits` on mixture-of-experts
        layers, else None).
        cache: None or (k, v) of shape (rows, B, S, kvh, d); layer start + j uses row cache_row + j
        (default: start + j). ring: those arrays are the sliding layers' ring buffers (`KVCache`).
        layers: `layer_states()` taken earlier: the layers then run one after another in Python
        (no scan, no slicing here)."""
        graphdef, rng_state, rest = nnx.split(self.layer, nnx.RngState, ...)
        if layers is not None:
            graphdef = layers.graphdef

        mlp_chunk = mlp_chunk_for(policy, x.shape[1])

        row0 = self.start if cache_row is None else cache_row

        def one_layer(x, rng_j, rest_j, kv):
            layer = nnx.merge(graphdef, rng_j, rest_j)
            x = checkpoint_name(x, LAYER_INPUT)  # what the offloading remat policy keeps on the host
            kv = None if kv is None else (*kv, ring)  # ring: static, never a traced argument
            x, new_kv, *logits = layer(x, *aux, kv_cache=kv, index=index, impl=impl, plain_causal=plain_causal,
                                       mlp_chunk=mlp_chunk, router_logits=router_logits)
            return x, new_kv, nnx.state(layer, nnx.RngState), (logits[0] if logits else None)

        if policy is not None:  # remat per layer: the scan body is the checkpointed function
            one_layer = jax.checkpoint(one_layer, policy=policy, prevent_cse=False)

        if layers is not None:
            if collect or router_logits or len(layers.states) != self.size:
                raise ValueError(f"layers: expected {self.size} layer states and no collected outputs")
            # One traced and lowered function called once per layer: lowering its kernels once,
            # not once per layer (each Mosaic GPU kernel takes a while to lower).
            call = jax.jit(one_layer)
            for j, (rng_j, rest_j) in enumerate(layers.states):
                kv = None if cache is None else (*cache, jnp.int32(row0 + j))
                x, cache, _, _ = call(x, rng_j, rest_j, kv)
            return x, cache, None, None

        def body(carry, xs):
            x, kv_all = carry
            rng_j, rest_j, layer_id = xs
            kv = None if kv_all is None else (*kv_all, layer_id)
            x, new_kv, rng_j, logits = one_layer(x, rng_j, rest_j, kv)
            return (x, new_kv), (rng_j, x if collect else None, logits)

        ids = row0 + jnp.arange(self.size, dtype=jnp.int32)
        (x, cache), (new_rng, ys, logits) = jax.lax.scan(body, (x, cache), (rng_state, rest, ids))
        if any(isinstance(n, nnx.Dropout) and n.rate > 0 and not n.deterministic
               for _, n in nnx.iter_graph(self.layer)):
            nnx.update(self.layer, new_rng)  # active dropout advanced its RNG counts, per layer
        return x, cache, ys, logits


class DecoderLayers(StackedLayers):
    """The decoder layers as `DecoderStack`s: for Llama-family checkpoints one stack of all
    layers; layers that differ (Qwen2's sliding window on some layers, a weight format or LoRA on
    some layers only) start a new stack, and the forward loops over the stacks in Python.
    `layers[i]` is layer i as a write-through `DecoderLayer` view."""

    stack_type = DecoderStack


class CausalLM(nnx.Module):
    """A Llama-family causal LM. Build with `from_params` (or `models.load_causal_lm`).

    Call: `model(input_ids, *, positions=None, segment_ids=None, cache=None)`.
      input_ids (B, T) int; positions (B, T) int (default: positions inside each segment when
      segment_ids is given, else cache.index + arange(T)); segment_ids (B, T) int for packed
      sequences: a token attends causally only to tokens of its own segment, 0 = padding. A segment
      is a contiguous run of one id (positions restart at each run).
      Returns logits (B, T, vocab) in the compute dtype (as HF; upcast in the loss), or
      (logits, new_cache) when a `KVCache` is given, or (logits, states) with
      `return_states=True` (no cache): states = {"embed": x0, "layers": (h_1..h_L), "norm": ...},
      each decoder layer's output, for layer-by-layer comparisons with another implementation.
    compute_dtype: the dtype of every matmul and of the activations (norms and softmax run in
      float32). It is the caller's choice, never the checkpoint's stored dtype.
    remat: False, True (= nothing_saveable), "auto", a policy name in REMAT_POLICIES, or a
      jax.checkpoint policy; applied per decoder layer (the checkpointed function is the body of
      the scan over layers). "auto" picks, when the forward is traced, the fastest policy whose
      predicted peak fits the device (`remat_plan`).

    The decoder layers are stored stacked (`DecoderLayers`: one `LayerStack` per run of layers of
    one structure) and run under `lax.scan`, so compile time does not grow with depth;
    `model.model.layers[i]` is layer i as a write-through view.
    attention: "einsum" (default; scores materialized in float32), "cudnn" (cuDNN flash attention
      through jax.nn.dot_product_attention, GPU, bf16/fp16) or "xla" (the same call's XLA
      version). Cached decoding runs the einsum path, or with one new token a row the
      `decode_attention` kernel where `backend` picks it (`jqlora.ops.cached_attention`: on a GPU
      under "auto").
    """

    def __init__(self, config: ModelConfig, src: "_Source", *, compute_dtype=jnp.bfloat16, remat=False,
                 backend: str = "auto", attention: str = "einsum"):
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_IMPLS}")
        if attention != "einsum" and config.attn_softcap is not None:
            raise SettingError(f"attention {attention!r} cannot apply {config.model_type}'s attention soft-capping "
                             f"(attn_logit_softcapping={config.attn_softcap:g}); use attention='einsum'")
        if config.norm_kind == "gemma" and jnp.dtype(compute_dtype) == jnp.float16:
            raise SettingError(f"float16 compute is refused for {config.model_type}: Gemma's residual stream "
                               f"outgrows float16 (max {float(jnp.finfo(jnp.float16).max):g}; the real Gemma 3 270M "
                               "reaches about 1e5, and transformers' float16 forward turns to inf/NaN too); "
                               "use bfloat16 or float32")
        self.attention = attention
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.remat = remat
        if remat:
            resolve_remat(remat)  # validate early
        self.backend = backend
        self.model = LlamaModel(config, src)
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = src.linear("lm_head", config.vocab_size, config.hidden_size, False, quantizable=False)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.init(self.config, batch, max_len, self.compute_dtype)

    def lm_logits(self, h: jax.Array) -> jax.Array:
        """Logits of final (normed) hidden states h (..., hidden): lm_head, or the tied embedding;
        soft-capped where the model says so (Gemma 2), so the chunked loss sees the same logits."""
        if self.lm_head is None:
            return softcap(self.model.embed_tokens.attend(h, self.compute_dtype), self.config.final_softcap)
        return softcap(self.lm_head(h), self.config.final_softcap)

    def __call__(self, input_ids, *, positions=None, segment_ids=None, cache: Optional[KVCache] = None,
                 return_states: bool = False, return_hidden: bool = False, segment_runs=None, layer_states=None,
                 rope_per_row: bool = False, return_router_logits: bool = False):
        """See the class docstring. return_hidden=True returns the final normed hidden states
        (B, T, hidden) instead of logits, so a loss can apply `lm_logits` chunk by chunk and never
        hold the (B, T, vocab) logits at once. segment_runs = `packed_attention.segment_runs(
        segment_ids, M)`: with attention="cudnn", packed rows then run cuDNN's packed layout
        instead of a (T, T) mask (other attention paths ignore it). layer_states: one
        `DecoderStack.layer_states()` (`HoistedLayers`) per stack, sliced beforehand (generation slices them
        once, outside its decode loop). rope_per_row: LongRoPE picks its table per row, by the row's
        own largest position, not by the call's (batched rollouts: each row as if alone).
        return_router_logits: return (what the call returns otherwise, router logits), the logits a
        tuple with one (B*T, E) array per mixture-of-experts layer, in layer order (what the
        load-balancing loss reads, `moe.load_balancing_loss`)."""
        cfg, dtype = self.config, self.compute_dtype
        if (return_states or return_hidden or return_router_logits) and cache is not None:
            raise ValueError("return_states / return_hidden / return_router_logits are for full-sequence "
                             "forwards, not cached decoding")
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        b, t = input_ids.shape
        q_seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
        if cache is None:
            index = None
            q_slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            k_slots, k_seg = q_slots, q_seg
            if positions is None:
                positions = q_slots if segment_ids is None else segment_positions(q_seg)
        else:
            if cache.batch != b:
                raise ValueError(f"cache batch {cache.batch} != input batch {b}")
            index = cache.index
            q_slots = jnp.broadcast_to(index + jnp.arange(t, dtype=jnp.int32), (b, t))
            k_seg = jax.lax.dynamic_update_slice(cache.segment_ids, q_seg, (0, index))
            k_slots = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
            if positions is None:
                positions = q_slots
        cos, sin = rope_cos_sin(cfg, jnp.asarray(positions), dtype, per_row=rope_per_row)
        if cfg.local_rope_theta is not None:  # Gemma 3: the sliding layers' own table (DecoderLayer picks)
            lcos, lsin = rope_cos_sin(cfg.local(), jnp.asarray(positions), dtype, per_row=rope_per_row)
            cos, sin = (cos, lcos), (sin, lsin)
        x = self.model.embed_tokens(input_ids, dtype)
        states = {"embed": x}

        impl = self.attention if cache is None else self.backend  # cached: the decode attention's backend
        plain_causal = segment_ids is None and cache is None  # static: no mask array needed
        runs = None  # packed rows under cuDNN: per-segment lengths/offsets instead of a (T, T) mask
        if (impl == "cudnn" and segment_runs is not None and segment_ids is not None and cache is None
                and packed_attention.available()):
            runs = tuple(jnp.asarray(a, jnp.int32) for a in segment_runs)
        aux = (cos, sin, q_slots, k_slots, q_seg, k_seg, runs)

        policy = self._remat_policy(b, t) if cache is None else None
        # the cache's arrays by kind: False = whole-sequence rows, True = sliding layers' ring buffers
        arrays = None if cache is None else {False: (cache.k, cache.v), True: (cache.ring_k, cache.ring_v)}
        collected, routed = [], []
        for i, stack in enumerate(self.model.layers.stacks):
            ring, row = (False, None) if cache is None else _stack_slot(cache, stack)
            x, kv, ys, router = stack(x, aux, None if cache is None else arrays[ring], index=index, impl=impl,
                                      plain_causal=plain_causal, policy=policy, collect=return_states,
                                      layers=None if layer_states is None else layer_states[i], cache_row=row,
                                      ring=ring, router_logits=return_router_logits)
            if cache is not None:
                arrays[ring] = kv
            if return_states:
                collected.extend(ys[j] for j in range(stack.size))
            if router is not None:
                routed.extend(router[j] for j in range(stack.size))
        _, x = self.model.norm.add_and_norm(x, None, self.backend if cache is not None and t == 1 else None)
        if cache is None:
            if return_hidden:
                out = x
            else:
                logits = self.lm_logits(x)
                out = (logits, {"embed": states["embed"], "layers": tuple(collected), "norm": x}) \
                    if return_states else logits
            return (out, tuple(routed)) if return_router_logits else out
        logits = self.lm_logits(x)
        return logits, dataclasses.replace(cache, k=arrays[False][0], v=arrays[False][1], ring_k=arrays[True][0],
                                           ring_v=arrays[True][1], segment_ids=k_seg, index=index + t)

    def _remat_policy(self, batch: int, seq_len: int):
        """The jax.checkpoint policy of this forward (None: no remat); "auto" asks `remat_plan`."""
        if not self.remat:
            return None
        if isinstance(self.remat, str) and self.remat == "auto":
            # Under a mesh the traced shapes are global: plan for one device's rows and weight shards.
            row_shards, fsdp = sharding.device_share()
            batch = -(-batch // row_shards)
            plan = remat_plan(self.config, batch, seq_len, param_bytes=state_bytes(self) // fsdp,
                              compute_dtype=self.compute_dtype, attention=self.attention,
                              lora_rank=_lora_rank(self))
            plan.log()
            return None if plan.policy is None else REMAT_POLICIES[plan.policy]
        return resolve_remat(self.remat)


def _stack_slot(cache: KVCache, stack) -> tuple[bool, int]:
    """(ring, first row) of a decoder stack's layers in `cache`; its layers share a window, so
    they are all ring rows or all whole-sequence rows, in order."""
    ring, row = cache.slot(stack.start)
    if any(cache.slot(stack.start + j) != (ring, row + j) for j in range(stack.size)):
        last = stack.start + stack.size - 1
        raise ValueError(f"cache layout {cache.layout} does not keep layers {stack.start}..{last} "
                         "in consecutive rows of one kind")
    return ring, row


def _lora_rank(model) -> int:
    """The largest LoRA rank of the decoder layers (0 without LoRA)."""
    from jqlora.lora.linear import QLoRALinear  # noqa: PLC0415

    return max((n.rank for _, n in nnx.iter_graph(model.model.layers) if isinstance(n, QLoRALinear)), default=0)
