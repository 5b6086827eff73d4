"""Wrap a model's linear layers with LoRA and move LoRA weights in and out by HF module name."""
from __future__ import annotations

from typing import Iterator, Mapping

import jax.numpy as jnp
from flax import nnx

from jqlora.lora.config import LoraConfig
from jqlora.lora.linear import QLoRALinear


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def named_linears(model) -> Iterator[tuple[str, QLoRALinear]]:
    """(dotted name, layer) for every `QLoRALinear` in `model`, in graph order. The dotted names
    of jqlora models are the HF module names ("model.layers.0.self_attn.q_proj")."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QLoRALinear):
            yield _dotted(path), node


def apply_lora(model, config: LoraConfig, rngs: nnx.Rngs):
    """Add a LoRA branch (in place) to every linear layer whose dotted name matches
    `config.target_modules`; returns `model`. Raises ValueError when nothing matches or when a
    matching layer already has LoRA."""
    if rngs is None:
        raise ValueError("apply_lora needs rngs (nnx.Rngs) to initialise the LoRA A matrices")
    layers = list(named_linears(model))
    matched = [(n, m) for n, m in layers if config.matches(n)]
    if not matched:
        names = [n for n, _ in layers]
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ValueError(
            f"LoRA target_modules {config.target_modules!r} matched no linear layer; "
            f"the model's linear layers are: {shown or '(none)'}")
    for name, layer in matched:
        if layer.has_lora:
            raise ValueError(f"{name} already has a LoRA branch")
        layer.enable_lora(config.rank, config.alpha, dropout=config.dropout,
                          use_rslora=config.use_rslora, rngs=rngs)
    return model


def lora_params_by_module(model) -> dict[str, dict[str, jnp.ndarray]]:
    """{HF module name: {"lora_A": (r, in), "lora_B": (out, r)}} for every layer with LoRA."""
    return {name: {"lora_A": layer.lora_A[...], "lora_B": layer.lora_B[...]}
            for name, layer in named_linears(model) if layer.has_lora}


def set_lora_params(model, params_by_module: Mapping[str, Mapping[str, jnp.ndarray]], *, strict: bool = True):
    """Inverse of `lora_params_by_module` (e.g. after importing a PEFT adapter); returns `model`.

    strict=True: every module named must exist and have LoRA, and every LoRA layer of the model
    must be given. Shapes are checked against each layer's rank and features."""
    layers = {name: layer for name, layer in named_linears(model)}
    for name, p in params_by_module.items():
        if name not in layers:
            raise KeyError(f"set_lora_params: the model has no linear layer named {name!r}")
        layer = layers[name]
        if not layer.has_lora:
            raise ValueError(f"set_lora_params: {name} has no LoRA branch (apply_lora first)")
        missing = {"lora_A", "lora_B"} - set(p)
        if missing:
            raise KeyError(f"set_lora_params: {name} is missing {sorted(missing)}")
        try:
            layer.set_lora(p["lora_A"], p["lora_B"])
        except ValueError as e:
            raise ValueError(f"set_lora_params: {name}: {e}") from None
    if strict:
        absent = [n for n, l in layers.items() if l.has_lora and n not in params_by_module]
        if absent:
            raise KeyError(f"set_lora_params: no weights given for LoRA layers {absent[:8]}"
                           + (" ..." if len(absent) > 8 else ""))
    return model
