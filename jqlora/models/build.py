"""Building a `CausalLM` from an HF-keyed params dict: `from_params` (what `load_causal_lm` runs
after reading a checkpoint), its tensor source `_Source` (names and shapes checked, optional
quantization or casting at build time, per-layer arrays deleted once stacked), and `init_params`
(random params for tests and demos without a checkpoint)."""
from __future__ import annotations

import collections
from typing import Any, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from interop.bnb_common import NON_TEXT_PREFIXES  # the parts a text model leaves out (said once)
from interop.experts import canonical_moe_params  # Mixtral's expert keys under transformers 5's names
from jqlora import quant
from jqlora._util import BASE_MATMULS, QUANTIZE_FORMATS
from jqlora.errors import SettingError
from jqlora.lora.apply import apply_lora
from jqlora.lora.config import LoraConfig
from jqlora.lora.linear import FrozenParam, QLoRALinear, base_shape, host_or_device
from jqlora.models.config import ModelConfig
from jqlora.models.llama import CausalLM


class _Source:
    """Hands tensors from an HF-keyed params dict to the layers, checking names and shapes.

    params: quantized linear layers by MODULE name ("model.layers.0.self_attn.q_proj") as
    Weight4bit / Int8Weight; everything else by full key ("model.norm.weight", "<module>.weight"
    for a dense linear, "<module>.bias").

    `quantize` applies only to params with no quantized weight at all: in a quantized checkpoint
    a dense linear is dense on purpose (bitsandbytes' llm_int8_skip_modules, e.g. unsloth's
    dynamic 4-bit), and transformers keeps it dense too."""

    def __init__(self, params: Mapping[str, Any], *, quantize=None, compute_dtype=None, backend="auto",
                 param_dtype=None, blocksize: int = 64, double_quant: bool = True, int8_numerics="weight_only",
                 donate: bool = False, quantize_experts: Optional[str] = "auto", base_matmul: str = "compute"):
        if quantize not in (None, *QUANTIZE_FORMATS):
            raise SettingError(f"quantize must be None, 'nf4', 'fp4' or 'int8', got {quantize!r}")
        if quantize_experts not in ("auto", "none", None, *QUANTIZE_FORMATS):
            raise SettingError(f"quantize_experts must be 'auto', 'none', 'nf4', 'fp4' or 'int8', "
                               f"got {quantize_experts!r}")
        self.params = params
        quantized = any(isinstance(v, (quant.Weight4bit, quant.Int8Weight)) for v in params.values())
        self.quantize = None if quantized else quantize
        # Dense expert stacks: a quantized checkpoint's are quantized too ("auto": NF4; transformers +
        # bitsandbytes leave experts in bf16, where a MoE's memory goes), a plain one's follow `quantize`.
        if quantize_experts == "auto":
            quantize_experts = "nf4" if quantized else quantize
        self.quantize_experts = None if quantize_experts == "none" else quantize_experts
        self.compute_dtype = compute_dtype
        self.backend = backend
        self.param_dtype = None if param_dtype is None else jnp.dtype(param_dtype)
        self.blocksize = blocksize
        self.double_quant = double_quant
        self.int8_numerics = int8_numerics
        if base_matmul not in BASE_MATMULS:
            raise SettingError(f"base_matmul must be one of {', '.join(BASE_MATMULS)}, got {base_matmul!r}")
        self.base_matmul = base_matmul
        self.donate = donate
        self.used: set[str] = set()

    def donation(self, layers) -> Optional[collections.Counter]:
        """With donate=True: id(array) -> number of uses by the decoder layers, for the arrays that
        stacking may delete after their last use; arrays the rest of the model also holds are
        left out (never deleted)."""
        if not self.donate:
            return None
        keep = {id(a) for k, v in self.params.items() if not k.startswith("model.layers.")
                for a in jax.tree.leaves(v)}
        uses = collections.Counter(id(a) for layer in layers for a in jax.tree.leaves(nnx.state(layer)))
        for i in keep & set(uses):
            uses[i] += 1 << 30
        return uses

    def _cast(self, a):
        """The tensor in `param_dtype` (floating ones); a host (numpy) array stays on the host:
        `from_params` moves every host array to the device at the end, in one transfer."""
        a = host_or_device(a)
        if self.param_dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != self.param_dtype:
            a = a.astype(self.param_dtype)
        return a

    def tensor(self, key: str, shape: tuple):
        if key not in self.params:
            raise KeyError(f"checkpoint is missing tensor {key!r}")
        a = self.params[key]
        if isinstance(a, (quant.Weight4bit, quant.Int8Weight)):
            raise ValueError(f"{key}: expected a dense tensor, found a quantized {type(a).__name__}")
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{key}: shape {tuple(a.shape)} does not match the config's {tuple(shape)}")
        self.used.add(key)
        return self._cast(a)

    def linear(self, name: str, out_f: int, in_f: int, bias: bool, *, quantizable: bool = True) -> QLoRALinear:
        if name in self.params:
            w, key = self.params[name], name
        elif name + ".weight" in self.params:
            w, key = self.params[name + ".weight"], name + ".weight"
        else:
            raise KeyError(f"checkpoint is missing tensor {name + '.weight'!r} (linear layer {name})")
        if isinstance(w, (quant.Weight4bit, quant.Int8Weight)):
            w.validate(name)
        elif not (hasattr(w, "shape") and hasattr(w, "dtype")):
            raise TypeError(f"{key}: expected an array or a quantized weight, got {type(w).__name__}")
        shape = base_shape(w) if len(getattr(w, "shape", ())) == 2 else tuple(w.shape)
        if shape != (out_f, in_f):
            hint = " (it looks transposed: weights must be (out_features, in_features))" if shape == (in_f, out_f) else ""
            raise ValueError(f"{key}: shape {shape} does not match the config's (out, in) = {(out_f, in_f)}{hint}")
        self.used.add(key)
        if not isinstance(w, (quant.Weight4bit, quant.Int8Weight)):
            if self.quantize is not None and quantizable:
                w = jnp.asarray(w)
                w = quant.quantize_int8(w) if self.quantize == "int8" else quant.quantize_4bit(
                    w, quant_type=self.quantize, blocksize=self.blocksize, double_quant=self.double_quant)
            else:
                w = self._cast(w)
        b = None
        if bias:
            b = self.tensor(name + ".bias", (out_f,))
        elif name + ".bias" in self.params:
            raise ValueError(f"{name}.bias is in the checkpoint but the config says this layer has no bias")
        dense = not isinstance(w, (quant.Weight4bit, quant.Int8Weight))
        # A dense weight has no kernel: it always takes qmatmul's "auto" (jnp) path.
        numerics = self.int8_numerics if isinstance(w, quant.Int8Weight) else "weight_only"
        if self.base_matmul == "fp8" and isinstance(w, quant.Weight4bit):
            numerics = "fp8"  # FP8 base products for 4-bit weights; dense and 8-bit ones as they are
        return QLoRALinear(w, bias=b, compute_dtype=self.compute_dtype, backend="auto" if dense else self.backend,
                           numerics=numerics)


    def router(self, name: str, num_experts: int, hidden: int):
        """A mixture-of-experts router (`Router`): always dense, full precision; a quantized one
        (unsloth's v4-era 4-bit gate) is dequantized exactly, in its stored dtype."""
        from jqlora.lora.experts import Router  # noqa: PLC0415

        w = self.params.get(name)
        key = name
        if w is None:
            key = name + ".weight"
            w = self.tensor(key, (num_experts, hidden))
        else:
            self.used.add(key)
            w.validate(name)
            if tuple(w.shape) != (num_experts, hidden):
                raise ValueError(f"{name}: shape {tuple(w.shape)} does not match the config's (experts, hidden) = "
                                 f"{(num_experts, hidden)}")
            w = quant.dequantize(w, jnp.dtype(w.stored_dtype))
        return Router(w, compute_dtype=self.compute_dtype, backend="auto")

    def experts(self, name: str, num_experts: int, out_f: int, in_f: int):
        """One expert projection (`QLoRAExperts`) named as transformers 5 names it
        (``...mlp.experts.gate_up_proj`` / ``down_proj``), from the fused (E, out, in) tensor (plain or
        bitsandbytes-quantized whole) or from per-expert ``...experts.{e}.gate_proj|up_proj|down_proj``
        weights (gate and up joined by rows); dense stacks are quantized per `quantize_experts`."""
        from interop.experts import concat_rows  # noqa: PLC0415
        from jqlora.lora.experts import QLoRAExperts  # noqa: PLC0415

        shape = (num_experts, out_f, in_f)
        w = self.params.get(name)
        sources = [w]
        if w is not None:
            self.used.add(name)
            if isinstance(w, quant.Weight4bit):
                if tuple(w.shape) != shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} does not match the config's (experts, out, in) "
                                     f"= {shape}")
                base = quant.ExpertWeights.from_fused(w, name)
            else:
                if tuple(w.shape) != shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} does not match the config's (experts, out, in) "
                                     f"= {shape}")
                base = self._dense_experts(w, name)
        else:
            root, proj = name.rsplit(".", 1)
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
            rows = out_f // len(parts)
            weights = []
            for e in range(num_experts):
                got = []
                for part in parts:
                    module = f"{root}.{e}.{part}"
                    if module in self.params:
                        q = self.params[module]
                        q.validate(module)
                        self.used.add(module)
                        got.append(q)
                    else:
                        got.append(self.tensor(module + ".weight", (rows, in_f)))
                    if tuple(base_shape(got[-1])) != (rows, in_f):
                        raise ValueError(f"{module}: shape {tuple(base_shape(got[-1]))} does not match the config's "
                                         f"(out, in) = {(rows, in_f)}")
                weights.append(concat_rows(got, f"{root}.{e}.{'+'.join(parts)}"))
                sources.extend(got)
            if isinstance(weights[0], (quant.Weight4bit, quant.Int8Weight)):
                base = quant.ExpertWeights.from_experts(weights, name)
            else:
                base = self._dense_experts(np.stack([np.asarray(w) for w in weights])
                                           if all(isinstance(w, np.ndarray) for w in weights)
                                           else jnp.stack([jnp.asarray(w) for w in weights]), name)
        if self.donate:  # the source tensors are ours and now stacked: free them (58 GB of bf16 on a 30B MoE)
            for a in jax.tree.leaves(sources):
                if isinstance(a, jax.Array) and not a.is_deleted() and not any(
                        a is b for b in jax.tree.leaves(base)):
                    a.delete()
        return QLoRAExperts(base, compute_dtype=self.compute_dtype, backend=self.backend)

    def _dense_experts(self, w, name: str):
        if self.quantize_experts is None:
            return quant.ExpertWeights.from_dense(self._cast(w), name)
        return quant.quantize_experts(jnp.asarray(w), self.quantize_experts, blocksize=self.blocksize,
                                      double_quant=self.double_quant, name=name)


# Keys a checkpoint may carry that the model does not need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint's text model (Gemma 3: `Gemma3ForConditionalGeneration`), saved by
# transformers 5 under the first prefix and by earlier versions under the second.
TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")


def text_model_params(params: Mapping[str, Any], log=None) -> dict:
    """The text model's params of a multimodal checkpoint under the keys of a text-only one
    (`model.layers...`, `lm_head`), the vision tower and projector left out with a one-line note to
    `log` (default: the `jqlora` logger); a text-only checkpoint's params unchanged."""
    if not any(k.startswith(TEXT_MODEL_PREFIXES) for k in params):
        return dict(params)
    out, skipped = {}, []
    for k, v in params.items():
        pre = next((p for p in TEXT_MODEL_PREFIXES if k.startswith(p)), None)
        if pre is not None:
            out["model." + k[len(pre):]] = v
        elif k.startswith(NON_TEXT_PREFIXES):
            skipped.append(k)
        elif k.startswith("language_model.lm_head") or k.startswith("lm_head"):
            out["lm_head" + k.split("lm_head", 1)[1]] = v
        else:
            out[k] = v
    if skipped:
        import logging  # noqa: PLC0415

        (log or logging.getLogger("jqlora").info)(
            f"multimodal checkpoint: the text model is loaded; {len(skipped)} vision tower / projector "
            "tensors are skipped")
    return out


def from_params(params: Mapping[str, Any], config: Union[Mapping, ModelConfig], *, lora: Optional[LoraConfig] = None,
                compute_dtype=jnp.bfloat16, quantize: Optional[str] = None, rngs: Optional[nnx.Rngs] = None,
                remat=False, backend: str = "auto", param_dtype=None, strict: bool = True,
                int8_numerics: str = "weight_only", attention: str = "einsum",
                donate_params: bool = False, quantize_experts: Optional[str] = "auto",
                base_matmul: str = "compute") -> CausalLM:
    """Build a `CausalLM` from an HF-keyed params dict (as `interop.load_bnb_checkpoint` returns).

    quantize: quantize dense linear weights at build time ("nf4", "fp4" with blocksize 64 and
      double quantization, or "int8"); lm_head and embeddings stay dense (as bitsandbytes does).
    param_dtype: cast dense (non-quantized) tensors to this dtype; None keeps the stored dtype.
    lora: add LoRA to the matching linear layers (needs rngs; default nnx.Rngs(0)).
    strict: raise if params holds tensors the model does not use (other than rotary buffers).
    int8_numerics: for Int8Weight layers, "weight_only" (dequantize + matmul: what bitsandbytes'
      training path computes) or "llm_int8" (bitsandbytes' inference numerics: int8 activations
      with fp16 outliers above the checkpoint's llm_int8_threshold).
    remat: False, True, "auto" or a policy name (see `CausalLM`).
    base_matmul: "compute" (the compute dtype) or "fp8": the frozen 4-bit linear weights' products
      on float8_e4m3fn operands scaled per row (`qmatmul(numerics="fp8")`, docs/numerics.md);
      LoRA branches, dense and 8-bit weights, expert stacks and the LM head keep the compute dtype.
    quantize_experts: the format of mixture-of-experts weights stored dense: "auto" (NF4 in a
      quantized checkpoint, where transformers + bitsandbytes leave experts in bf16; else as
      `quantize`), "nf4", "fp4", "int8", or "none" (kept dense). Routers stay dense always.
    donate_params: the decoder layers' weights are stacked into new arrays (one per weight kind,
      leading axis = layer); with True the arrays of `params` that only the layers use are deleted
      once stacked, so building needs about one weight kind of extra device memory rather than a
      second copy of the layers. Only for a dict nobody reads afterwards (`load_causal_lm`'s).
    """
    cfg = ModelConfig.from_hf(config)
    multimodal = any(k.startswith(TEXT_MODEL_PREFIXES) for k in params)
    params = canonical_moe_params(text_model_params(params), cfg.model_type)
    src = _Source(params, quantize=quantize, compute_dtype=compute_dtype, backend=backend, param_dtype=param_dtype,
                  int8_numerics=int8_numerics, donate=donate_params, quantize_experts=quantize_experts,
                  base_matmul=base_matmul)
    model = CausalLM(cfg, src, compute_dtype=compute_dtype, remat=remat, backend=backend, attention=attention)
    model.text_of_multimodal = multimodal  # PEFT names its modules under the multimodal model's prefix
    if strict:
        unused = [k for k in params if k not in src.used and not k.endswith(_IGNORABLE_SUFFIXES)
                  and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if unused:
            raise ValueError(f"checkpoint tensors not used by the {cfg.model_type} model: {unused[:8]}"
                             + (" ..." if len(unused) > 8 else ""))
    to_device(model)
    if lora is not None:
        apply_lora(model, lora, rngs if rngs is not None else nnx.Rngs(0))
    return model


def to_device(model: nnx.Module) -> None:
    """Move every host (numpy) array of `model` to JAX's default device in one `device_put`.

    A staged checkpoint (`interop.load_bnb_checkpoint(device="stage")`) leaves the quantized
    weights' parts and small tensors on the host; stacked per layer kind they are a few dozen
    arrays, where transferring each tensor as read was hundreds of calls of milliseconds each."""
    state = nnx.state(model)
    leaves, treedef = jax.tree.flatten(state)
    host = [i for i, a in enumerate(leaves) if isinstance(a, np.ndarray)]
    if not host:
        return
    for i, a in zip(host, jax.device_put([leaves[i] for i in host])):
        leaves[i] = a
    nnx.update(model, jax.tree.unflatten(treedef, leaves))


def init_params(config: Union[Mapping, ModelConfig], seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random HF-keyed params (dense) for a config: for tests and demos without a checkpoint.
    Linear/embedding weights ~ N(0, std); norm weights ~ 1 + N(0, 0.1) (Gemma, whose norms apply
    1 + w: N(0, 0.1)); biases ~ N(0, std)."""
    c = ModelConfig.from_hf(config)
    rng = np.random.default_rng(seed)
    normal = lambda shape: jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32), dtype)  # noqa: E731
    offset = 0.0 if c.norm_kind == "gemma" else 1.0
    ones = lambda shape: jnp.asarray((offset + 0.1 * rng.standard_normal(shape)).astype(np.float32), dtype)  # noqa: E731
    p = {"model.embed_tokens.weight": normal((c.vocab_size, c.hidden_size)),
         "model.norm.weight": ones((c.hidden_size,))}
    if not c.tie_word_embeddings:
        p["lm_head.weight"] = normal((c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        lin = {"self_attn.q_proj": (c.q_features, c.hidden_size, c.qkv_bias),
               "self_attn.k_proj": (c.kv_features, c.hidden_size, c.qkv_bias),
               "self_attn.v_proj": (c.kv_features, c.hidden_size, c.qkv_bias),
               "self_attn.o_proj": (c.hidden_size, c.q_features, c.o_bias),
               "mlp.gate_proj": (c.intermediate_size, c.hidden_size, c.mlp_bias),
               "mlp.up_proj": (c.intermediate_size, c.hidden_size, c.mlp_bias),
               "mlp.down_proj": (c.hidden_size, c.intermediate_size, c.mlp_bias)}
        if c.fused_projections:  # Phi-3: q/k/v and gate/up stacked by rows
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del lin[n]
            lin["self_attn.qkv_proj"] = (c.q_features + 2 * c.kv_features, c.hidden_size, c.qkv_bias)
            lin["mlp.gate_up_proj"] = (2 * c.intermediate_size, c.hidden_size, c.mlp_bias)
        for n, (o, i_, has_bias) in lin.items():
            p[f"{pre}.{n}.weight"] = normal((o, i_))
            if has_bias:
                p[f"{pre}.{n}.bias"] = normal((o,))
        p[f"{pre}.input_layernorm.weight"] = ones((c.hidden_size,))
        p[f"{pre}.post_attention_layernorm.weight"] = ones((c.hidden_size,))
        if c.sandwich_norms:
            p[f"{pre}.pre_feedforward_layernorm.weight"] = ones((c.hidden_size,))
            p[f"{pre}.post_feedforward_layernorm.weight"] = ones((c.hidden_size,))
        if c.qk_norm:
            p[f"{pre}.self_attn.q_norm.weight"] = ones((c.head_dim,))
            p[f"{pre}.self_attn.k_norm.weight"] = ones((c.head_dim,))
    return p
