"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) in every expert layout jqlora
reads, made with transformers + bitsandbytes on CPU; nothing is downloaded.

Not a test module: tests import it by name (tests/conftest.py puts tests/support on sys.path).

Layouts (`save_layout`):
  "plain"      transformers 5's `save_pretrained`: per-expert float tensors (Mixtral: w1/w3/w2 under
               block_sparse_moe).
  "fused"      the in-memory fused tensors `mlp.experts.gate_up_proj` (E, 2I, H) and `down_proj`.
  "nf4"        transformers + bitsandbytes NF4: attention 4-bit, experts left dense (per expert).
  "expert_nf4" unsloth's v4-era layout: every expert a double-quantized `Linear4bit`, router 4-bit.
  "expert_int8" every expert (and attention) an LLM.int8 `Linear8bitLt`.
  "fused_nf4"  attention NF4 and each layer's experts quantized whole by bitsandbytes'
               `replace_parameter_4bit` (unsloth-zoo under transformers 5).
Sizes keep in_features a multiple of 64 (bitsandbytes 0.50.2 dequantizes blocks spanning rows
wrongly on CPU).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, tie_word_embeddings=False)
QWEN3_MOE = dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1], **_BASE)
MIXTRAL = dict(model_type="mixtral", intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
               num_hidden_layers=2, **_BASE)
CONFIGS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
LAYOUTS = ("plain", "fused", "nf4", "expert_nf4", "expert_int8", "fused_nf4")

_CACHE: dict = {}


def _quiet():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def randomize(model, seed: int = 0):
    """Norms N(0, 0.1) around one, routers N(0, 0.5) (decisive routing), the rest N(0, 0.05)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                std = 0.5 if name.endswith("gate.weight") else 0.05
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def tiny_moe(kind: str, seed: int = 0, experts: str = "eager", **overrides):
    """A random transformers MoE causal LM ("qwen3_moe" or "mixtral"), eager attention, float32;
    `experts` picks transformers' experts implementation ("eager" or "grouped_mm")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet()
    cfg = AutoConfig.for_model(**{**CONFIGS[kind], **overrides})
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation=experts)
    return randomize(model, seed).eval()


def _bnb_config(quant: str):
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def _transformers_quantized(model, directory: Path, quant: str) -> dict:
    """Save `model` as transformers + bitsandbytes do (`quant` "nf4" / "int8"); returns its tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as plain:
        model.save_pretrained(plain)
        q = AutoModelForCausalLM.from_pretrained(plain, quantization_config=_bnb_config(quant), device_map="cpu",
                                                 dtype=torch.float32)
    q.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def _write(directory: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    for f in directory.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})


def _expert_modules(tensors: dict):
    """The per-expert (and router) dense weights of a transformers save: {module: key}."""
    return {k[: -len(".weight")]: k for k in tensors
            if (".experts." in k or k.endswith("mlp.gate.weight") or k.endswith("block_sparse_moe.gate.weight"))
            and k.endswith(".weight")}


def save_layout(model, directory, layout: str) -> Path:
    """Write `model` to `directory` in `layout` (module docstring)."""
    import bitsandbytes.functional as F

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "plain":
        model.save_pretrained(directory)
        return directory
    if layout == "fused":
        model.save_pretrained(directory)
        _write(directory, dict(model.state_dict()))
        return directory
    if layout in ("nf4", "expert_nf4", "fused_nf4"):
        tensors = _transformers_quantized(model, directory, "nf4")
    elif layout == "expert_int8":
        tensors = _transformers_quantized(model, directory, "int8")
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if layout == "expert_nf4":
        for m, key in _expert_modules(tensors).items():
            w = tensors.pop(key)
            packed, qs = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
            tensors[key] = packed
            tensors.update({f"{key}.{k}": v for k, v in qs.as_dict(packed=True).items()})
    elif layout == "expert_int8":
        for m, key in _expert_modules(tensors).items():
            if m.endswith(".gate"):
                continue
            cb, scb, _ = F.int8_vectorwise_quant(tensors.pop(key).half())
            tensors[key], tensors[m + ".SCB"] = cb, scb
    elif layout == "fused_nf4":
        from bitsandbytes.nn.parametrize import replace_parameter_4bit

        for k in list(tensors):
            if ".experts." in k:
                del tensors[k]
        for name, mod in model.named_modules():
            if name.endswith("mlp.experts"):
                holder = torch.nn.Module()
                for p in ("gate_up_proj", "down_proj"):
                    setattr(holder, p, torch.nn.Parameter(getattr(mod, p).detach().clone()))
                    replace_parameter_4bit(holder, p, compress_statistics=True, quant_type="nf4")
                tensors.update({f"{name}.{k}": v for k, v in holder.state_dict().items()})
    _write(directory, tensors)
    return directory


def cached(tmp_path_factory, kind: str, layout: str) -> Path:
    """The tiny checkpoint of `kind` in `layout`, built once per session (read-only)."""
    key = (kind, layout)
    path = _CACHE.get(key)
    if path is None or not path.exists():
        path = save_layout(tiny_moe(kind), tmp_path_factory.mktemp(f"{kind}-{layout}"), layout)
        _CACHE[key] = path
    return path


def bnb_expert_stacks(directory) -> dict[str, torch.Tensor]:
    """{"model.layers.N.mlp.experts.gate_up_proj" | "...down_proj": (E, out, in) float32}: every
    layer's experts as bitsandbytes dequantizes them from the checkpoint's raw tensors (per-expert
    Linear4bit / Linear8bitLt, or a parametrized 3-D parameter), in transformers 5's fused layout;
    a quantized router too, under "model.layers.N.mlp.gate.weight"."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file

    tensors = load_file(Path(directory) / "model.safetensors")
    kind = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    out: dict[str, torch.Tensor] = {}
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in tensors:
        if ".quant_state.bitsandbytes__" in key:
            owner = key.split(".quant_state.")[0]
            stats = {k[len(owner) + 1:]: v for k, v in tensors.items() if k.startswith(owner + ".")}
            qs = F.QuantState.from_dict(stats, device=torch.device("cpu"))
            w = F.dequantize_4bit(tensors[owner], qs).float()
        elif key.endswith(".SCB"):
            owner = key[: -len(".SCB")] + ".weight"
            w = F.int8_vectorwise_dequant(tensors[owner], tensors[key]).float()
        else:
            continue
        if owner.endswith(("gate_up_proj", "down_proj")) and ".experts." in owner and owner.split(".")[-2] == "experts":
            out[owner] = w
            continue
        parts = owner.split(".")
        if parts[-2:] == ["gate", "weight"]:  # a quantized router (unsloth's v4-era files)
            out[".".join(parts[:-3]) + ".mlp.gate.weight"] = w
            continue
        if "experts" not in parts:
            continue
        i = parts.index("experts")
        layer = ".".join(parts[:i - 1])
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(parts[i + 2], parts[i + 2])
        per.setdefault(layer, {}).setdefault(int(parts[i + 1]), {})[proj] = w
    for layer, experts in per.items():
        order = sorted(experts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    assert kind in CONFIGS
    return out


def upcycled_smollm2(bf16_folder, directory, *, experts: int = 3, top_k: int = 2, layers: int | None = None,
                     seed: int = 0) -> Path:
    """A Mixtral folder made of SmolLM2's real weights: every expert of layer N is SmolLM2's MLP of
    layer N (w1 = gate, w3 = up, w2 = down), the router random, the first `layers` layers (all by
    default). Its routing weights sum to one, so it computes SmolLM2's function whatever the router
    picks. Writes the SmolLM2 folder truncated the same way beside it ("dense")."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = Path(bf16_folder)
    directory = Path(directory)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"] if layers is None else layers
    tensors = load_file(src / "model.safetensors")  # bf16 as ml_dtypes.bfloat16
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    dense_dir = directory / "dense"
    dense_dir.mkdir(parents=True, exist_ok=True)
    save_file(keep, dense_dir / "model.safetensors", metadata={"format": "pt"})
    (dense_dir / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))
    rng = np.random.default_rng(seed)
    moe = {}
    for k, v in keep.items():
        parts = k.split(".")
        if len(parts) > 4 and parts[3] == "mlp":
            w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[parts[4]]
            for e in range(experts):
                moe[f"model.layers.{parts[2]}.block_sparse_moe.experts.{e}.{w}.weight"] = v
        else:
            moe[k] = v
    for i in range(n):
        moe[f"model.layers.{i}.block_sparse_moe.gate.weight"] = rng.normal(
            0, 0.5, (experts, cfg["hidden_size"])).astype(keep["model.norm.weight"].dtype)
    moe_dir = directory / "mixtral"
    moe_dir.mkdir(parents=True, exist_ok=True)
    save_file(moe, moe_dir / "model.safetensors", metadata={"format": "pt"})
    mix = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "mlp_bias", "pretraining_tp")}
    mix.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_hidden_layers=n,
               num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    (moe_dir / "config.json").write_text(json.dumps(mix))
    return directory
