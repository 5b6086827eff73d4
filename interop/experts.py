"""Mixture-of-experts layouts at the border: checkpoint keys, fused bitsandbytes parameters and
PEFT's expert LoRA (`target_parameters`), for Qwen3-MoE and Mixtral.

Checkpoint layouts jqlora reads (one layer's experts; ``P`` = ``model.layers.N.mlp``):

* per expert, as transformers 5 saves them and as the hub holds them: Qwen3-MoE
  ``P.experts.{e}.{gate,up,down}_proj.weight``, Mixtral ``model.layers.N.block_sparse_moe.experts.{e}.
  {w1,w3,w2}.weight`` (w1 = gate, w3 = up, w2 = down; router ``block_sparse_moe.gate``), each
  plain or a bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (unsloth's v4-era ``*-bnb-4bit``);
* fused, as transformers 5 holds them in memory: ``P.experts.gate_up_proj`` (E, 2I, H), gate rows
  first, then up rows, and ``P.experts.down_proj`` (E, H, I); plain, or quantized whole by
  ``bitsandbytes.nn.parametrize.replace_parameter_4bit`` (the parameter's own name holds the
  packed codes, ``<param>.absmax``, ``.quant_map``, ``[.nested_absmax, .nested_quant_map]`` and
  ``.quant_state.bitsandbytes__nf4|fp4`` beside it, no ``.weight``).

`canonical_moe_params` renames Mixtral's keys to the Qwen3-MoE / transformers-5 module names
(``mlp.gate``, ``mlp.experts.{e}.gate_proj`` ...), which are jqlora's module names too; the model
build stacks the per-expert tensors (`concat_rows` joins a quantized gate and up without
re-quantizing).

PEFT 0.21 (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``,
``ParamWrapper``): per parameter (E, out, in) one ``lora_A`` (r*E, in), expert-major rows, and one
``lora_B`` (out, r*E), expert-minor columns: A_e = lora_A.reshape(E, r, in)[e],
B_e = lora_B.reshape(out, r, E)[:, :, e]. Two targeted parameters of one module nest two wrappers:
the first-defined (gate_up_proj) is the inner one, saved under ``<module>.base_layer.lora_*``, the
other under ``<module>.lora_*``; one alone has no ``base_layer.`` infix.
"""
from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from jqlora.quant import Int8Weight, Weight4bit, absmax_f32

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers 5's fused expert parameters, in definition order
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_RE = re.compile(r"^(?P<pre>(?:.*\.)?layers\.\d+\.)block_sparse_moe\.(?P<rest>.+)$")
_MIXTRAL_EXPERT_RE = re.compile(r"^experts\.(?P<e>\d+)\.(?P<w>w[123])(?P<tail>(?:\..+)?)$")
# a fused bitsandbytes 4-bit parameter's siblings: <...>.experts.<param>.<part>
FUSED_4BIT_RE = re.compile(r"^(?P<param>.+\.experts\.[A-Za-z_]+)\.(?P<part>absmax|quant_map|nested_absmax|"
                           r"nested_quant_map|quant_state\..+)$")


def canonical_moe_params(params: Mapping, model_type: str) -> dict:
    """`params` with Mixtral's ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.{e}.w1|w3|w2``
    keys renamed to ``mlp.gate`` / ``mlp.experts.{e}.gate_proj|up_proj|down_proj``; other model
    types and keys unchanged."""
    if model_type != "mixtral":
        return dict(params)
    out = {}
    for k, v in params.items():
        m = _MIXTRAL_RE.match(k)
        if m is not None:
            rest = m.group("rest")
            e = _MIXTRAL_EXPERT_RE.match(rest)
            if e is not None:
                rest = f"experts.{e.group('e')}.{_MIXTRAL_PROJ[e.group('w')]}{e.group('tail')}"
            k = f"{m.group('pre')}mlp.{rest}"
        out[k] = v
    return out


def split_fused_4bit(keys) -> dict[str, dict[str, str]]:
    """The fused 4-bit expert parameters among checkpoint `keys`: {param: {part: key}}, the
    param's own key (its packed codes) under part "" (absent when the file lacks it)."""
    keys = set(keys)
    found: dict[str, dict[str, str]] = {}
    for key in keys:
        m = FUSED_4BIT_RE.match(key)
        if m is not None and not m.group("param").endswith(".weight"):
            found.setdefault(m.group("param"), {})[m.group("part")] = key
    fused = {p: parts for p, parts in found.items() if any(s.startswith("quant_state.") for s in parts)}
    for p, parts in fused.items():
        if p in keys:
            parts[""] = p
    return fused


def concat_rows(parts, name: str = "weight"):
    """Weights of one input size joined by rows, as one weight of (sum of out, in): dense arrays,
    `Int8Weight`s (codes and row scales joined) or `Weight4bit`s (codes and block scales joined,
    which needs every part to hold whole blocks; nested scales are de-nested to the float32 values
    bitsandbytes decodes, so the joined weight dequantizes bit for bit as the parts do)."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, Weight4bit):
        if not all(isinstance(p, Weight4bit) and (p.quant_type, p.blocksize, p.stored_dtype, p.shape[1:])
                   == (first.quant_type, first.blocksize, first.stored_dtype, first.shape[1:]) for p in parts):
            raise ValueError(f"{name}: the parts to join differ in 4-bit format or input size")
        if any(p.numel % p.blocksize for p in parts):
            raise ValueError(f"{name}: a part's {first.blocksize}-blocks span the join (rows x in not a multiple)")
        xp = np if all(isinstance(p.packed, np.ndarray) and not p.nested for p in parts) else _jnp()
        absmax = [p.absmax if not p.nested else absmax_f32(p) for p in parts]
        return Weight4bit(packed=xp.concatenate([p.packed for p in parts]),
                          absmax=xp.concatenate([xp.asarray(a) for a in absmax]), code=first.code,
                          shape=(sum(p.shape[0] for p in parts), *first.shape[1:]), quant_type=first.quant_type,
                          blocksize=first.blocksize, stored_dtype=first.stored_dtype).validate(name)
    if isinstance(first, Int8Weight):
        if not all(isinstance(p, Int8Weight) and p.shape[1:] == first.shape[1:] for p in parts):
            raise ValueError(f"{name}: the parts to join differ in format or input size")
        xp = np if all(isinstance(p.cb, np.ndarray) for p in parts) else _jnp()
        return Int8Weight(cb=xp.concatenate([p.cb for p in parts]), scb=xp.concatenate([p.scb for p in parts]),
                          threshold=first.threshold, stored_dtype=first.stored_dtype).validate(name)
    if any(isinstance(p, (Weight4bit, Int8Weight)) for p in parts):
        raise ValueError(f"{name}: the parts to join mix quantized and dense weights")
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else _jnp()
    return xp.concatenate([xp.asarray(p) for p in parts], axis=0)


def _jnp():
    import jax.numpy as jnp  # noqa: PLC0415

    return jnp


# ------------------------------------------------------------------------------------ PEFT layout
def to_peft_factors(a, b) -> tuple[np.ndarray, np.ndarray]:
    """jqlora's stacks A (E, r, in), B (E, out, r) -> PEFT's lora_A (r*E, in), lora_B (out, r*E)."""
    a, b = np.asarray(a), np.asarray(b)
    e, r, k = a.shape
    return a.reshape(e * r, k), np.ascontiguousarray(b.transpose(1, 2, 0)).reshape(b.shape[1], r * e)


def from_peft_factors(lora_a, lora_b, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's lora_A (r*E, in), lora_B (out, r*E) -> A (E, r, in), B (E, out, r)."""
    lora_a, lora_b = np.asarray(lora_a), np.asarray(lora_b)
    e = int(num_experts)
    if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] % e or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(f"expert LoRA factors lora_A {lora_a.shape} and lora_B {lora_b.shape} are not "
                         f"(r*E, in) and (out, r*E) for E={e}")
    r = lora_a.shape[0] // e
    return lora_a.reshape(e, r, -1), np.ascontiguousarray(lora_b.reshape(lora_b.shape[0], r, e).transpose(2, 0, 1))


def peft_param_modules(params_targeted) -> dict[str, str]:
    """{fused parameter name: the module path PEFT saves its LoRA under, relative to the experts
    module}, for the parameters of one experts module that have LoRA: the inner wrapper
    (gate_up_proj when both are targeted) gets ``base_layer``."""
    targeted = [p for p in EXPERT_PARAMS if p in set(params_targeted)]
    if len(targeted) == 1:
        return {targeted[0]: ""}
    return {"gate_up_proj": "base_layer", "down_proj": ""}


def per_expert_keys(model_type: str, layer_prefix: str, e: int) -> dict[str, str]:
    """The on-disk keys transformers loads for expert e of a layer (``model.layers.N``):
    {"gate_proj"|"up_proj"|"down_proj": key}."""
    if model_type == "mixtral":
        return {p: f"{layer_prefix}.block_sparse_moe.experts.{e}.{w}.weight" for w, p in _MIXTRAL_PROJ.items()}
    return {p: f"{layer_prefix}.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}


_DENSE_MOE_MODULE_RE = re.compile(r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\."
                                  r"(?:gate|experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3))$")


def kept_dense_by_transformers(module: str, model_type: str) -> bool:
    """Whether `module` (an on-disk module name) is an expert or the router of a Qwen3-MoE / Mixtral
    layer: weights transformers 5 holds as 3-D and bare parameters, which bitsandbytes does not
    quantize (it writes them dense in its 4-bit folders) and which it cannot load 4-bit (its
    converter joins per-expert packed bytes as if they were weights)."""
    return model_type in ("qwen3_moe", "mixtral") and _DENSE_MOE_MODULE_RE.search(module) is not None


def router_key(model_type: str, layer_prefix: str) -> str:
    """The router's on-disk key of a layer."""
    return f"{layer_prefix}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}.gate.weight"


# ------------------------------------------------------------------------- merged folders (per expert)
_STACK_RE = re.compile(r"^(?P<layer>.*layers\.\d+)\.mlp\.experts\.(?P<param>gate_up_proj|down_proj)$")


def per_expert_params(params: Mapping, model_type: str) -> dict:
    """`params` (as `load_bnb_checkpoint` returns them) with every fused expert stack
    (``...mlp.experts.gate_up_proj`` / ``down_proj``, dense or bitsandbytes-quantized whole) split
    into the per-expert float32 ``.weight`` tensors transformers loads (`per_expert_keys`); the
    rest unchanged."""
    from jqlora.quant import ExpertWeights, dequantize_experts  # noqa: PLC0415

    out = {}
    for k, v in params.items():
        m = _STACK_RE.match(k)
        if m is None:
            out[k] = v
            continue
        w = dequantize_experts(ExpertWeights.from_fused(v, k) if isinstance(v, Weight4bit) else
                               ExpertWeights.from_dense(v, k), np.float32)
        w = np.asarray(w)
        for e in range(w.shape[0]):
            keys = per_expert_keys(model_type, m.group("layer"), e)
            if m.group("param") == "down_proj":
                out[keys["down_proj"]] = w[e]
            else:
                half = w.shape[1] // 2
                out[keys["gate_proj"]], out[keys["up_proj"]] = w[e, :half], w[e, half:]
    return out


def per_expert_adapter(lora_params: Mapping, model_type: str) -> dict:
    """An adapter's expert stacks ({``...mlp.experts.gate_up_proj``: A (E, r, H), B (E, 2I, r)})
    as per-expert 2-D LoRA pairs under the per-expert module names transformers loads (gate: A_e
    and the first I rows of B_e; up: the last I rows; down: A_e, B_e); other modules unchanged."""
    out = {}
    for name, pair in lora_params.items():
        m = _STACK_RE.match(name)
        a, b = np.asarray(pair["lora_A"]), np.asarray(pair["lora_B"])
        if m is None or a.ndim != 3:
            out[name] = pair
            continue
        for e in range(a.shape[0]):
            keys = {p: k[: -len(".weight")] for p, k in per_expert_keys(model_type, m.group("layer"), e).items()}
            if m.group("param") == "down_proj":
                out[keys["down_proj"]] = {"lora_A": a[e], "lora_B": b[e]}
            else:
                half = b.shape[1] // 2
                out[keys["gate_proj"]] = {"lora_A": a[e], "lora_B": b[e, :half]}
                out[keys["up_proj"]] = {"lora_A": a[e], "lora_B": b[e, half:]}
    return out
