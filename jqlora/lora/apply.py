"""Wrap a model's linear layers with LoRA and move LoRA weights in and out by HF module name.

Layers stored stacked (`jqlora.lora.stacked.StackedLayers`: one array per weight kind, leading
axis = layer) keep their per-layer names here: `model.layers.3.mlp.up_proj` is entry 3 of the
stacked `up_proj`, and PEFT adapters, `lora_params_by_module` and `set_lora_params` see the same
names and shapes as for layers stored one by one.
"""
from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple, Optional

import jax.numpy as jnp
from flax import nnx

from jqlora.errors import SettingError
from jqlora.lora.config import ALL_LINEAR, LoraConfig
from jqlora.lora.experts import QLoRAExperts, Router, peft_expert_lora_a_init
from jqlora.lora.linear import QLoRALinear, peft_lora_a_init
from jqlora.lora.stacked import StackedLayers, stack_modules, stacked_view


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


class _Slot(NamedTuple):
    """A linear layer by name: `module` itself (index None) or entry `index` of a stacked one,
    which lives in `stack` of `container`."""
    name: str
    module: "QLoRALinear | QLoRAExperts"
    index: Optional[int]
    stack: object = None
    container: Optional[StackedLayers] = None


def _slots(model) -> Iterator[_Slot]:
    """Every linear layer by HF module name, in the order of a model whose layers are stored one
    by one (graph order, layer by layer)."""
    nodes = list(nnx.iter_graph(model))
    containers = [tuple(p) for p, n in nodes if isinstance(n, StackedLayers)]
    for path, node in nodes:
        path = tuple(path)
        if isinstance(node, StackedLayers):
            for stack in node.stacks:
                inner = [(tuple(p), n) for p, n in nnx.iter_graph(stack.layer) if isinstance(n, _ADAPTABLE)]
                for j in range(stack.size):
                    for rel, lin in inner:
                        yield _Slot(_dotted(path + (stack.start + j,) + rel), lin, j, stack, node)
        elif isinstance(node, _ADAPTABLE) and not any(path[:len(c)] == c for c in containers):
            yield _Slot(_dotted(path), node, None)


_ADAPTABLE = (QLoRALinear, QLoRAExperts)  # the modules LoRA attaches to


def linear_names(model) -> list[str]:
    """The HF module names of the model's linear layers (`named_linears` without building views)."""
    return [s.name for s in _slots(model)]


def named_linears(model) -> Iterator[tuple[str, QLoRALinear]]:
    """(dotted name, layer) for every `QLoRALinear` in `model`, in graph order. The dotted names
    of jqlora models are the HF module names ("model.layers.0.self_attn.q_proj"). A layer stored
    stacked comes as a view (`jqlora.lora.stacked.stacked_view`): a copy of its values whose
    `set_value` / `set_lora` write through into the model."""
    for s in _slots(model):
        yield s.name, (s.module if s.index is None else stacked_view(s.module, s.index))


_DENSE_MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


# fused projections (Phi-3) and the projections they hold: a target list naming one of these takes
# the fused layer (it has one LoRA, as PEFT puts it there)
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _targeted(config: LoraConfig, slot: _Slot, moe: bool = False) -> bool:
    """Whether `config` puts LoRA on `slot`: its name matches target_modules, except that in a
    mixture-of-experts model (`moe`) "all-linear" means attention and experts (a router is taken
    only when named, and the dense MLP layers some MoE models keep are left out: PEFT 0.21 moves
    their names onto the experts, so it could not load them back), and that the fused expert stack
    ``experts.gate_up_proj`` is also taken by "gate_proj" or "up_proj" (the projections it holds), as
    are Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` by the names of theirs (the default targets
    reach them)."""
    if moe and config.target_modules == ALL_LINEAR and (
            isinstance(slot.module, Router)
            or (isinstance(slot.module, QLoRALinear) and slot.name.rsplit(".", 1)[-1] in _DENSE_MLP)):
        return False
    if config.matches(slot.name):
        return True
    parts = _FUSED_PARTS.get(slot.name.rsplit(".", 1)[-1])
    if parts and isinstance(slot.module, QLoRALinear) and not isinstance(config.target_modules, str):
        return any(t in parts for t in config.target_modules)  # Phi-3's fused projections
    if isinstance(slot.module, QLoRAExperts) and slot.name.endswith(".gate_up_proj") \
            and not isinstance(config.target_modules, str):
        return any(t in ("gate_proj", "up_proj") for t in config.target_modules)
    return False


def lora_shapes(module) -> dict:
    """{"lora_A": shape, "lora_B": shape} of a layer's LoRA factors (per layer)."""
    if isinstance(module, QLoRAExperts):
        return module.lora_shapes()
    return {"lora_A": (module.rank, module.in_features), "lora_B": (module.out_features, module.rank)}


def _draw(config: LoraConfig, module, rngs: nnx.Rngs):
    """One layer's A and dropout, drawn from `rngs` exactly as `QLoRALinear.enable_lora` draws them
    (an expert stack: A (E, r, in) as PEFT draws its (r*E, in) lora_A, and no dropout)."""
    if isinstance(module, QLoRAExperts):
        if config.dropout > 0:
            raise SettingError(f"LoRA dropout {config.dropout} on expert weights is not supported (PEFT's "
                               "target_parameters LoRA has none); use dropout 0 or leave the experts out of "
                               "target_modules")
        return peft_expert_lora_a_init(rngs.params(), module.num_experts, config.rank, module.in_features,
                                       module.param_dtype), None
    a = peft_lora_a_init(rngs.params(), config.rank, module.in_features, module.param_dtype)
    drop = nnx.Dropout(config.dropout, rngs=rngs) if config.dropout > 0 else None
    return a, drop


def apply_lora(model, config: LoraConfig, rngs: nnx.Rngs):
    """Add a LoRA branch (in place) to every linear layer whose dotted name matches
    `config.target_modules`; returns `model`. Raises ValueError when nothing matches or when a
    matching layer already has LoRA. The random A matrices are drawn layer by layer in name
    order, whether the layers are stored stacked or not."""
    if rngs is None:
        raise ValueError("apply_lora needs rngs (nnx.Rngs) to initialise the LoRA A matrices")
    slots = list(_slots(model))
    moe = any(isinstance(s.module, QLoRAExperts) for s in slots)
    matched = [s for s in slots if _targeted(config, s, moe)]
    if not matched:
        names = [s.name for s in slots]
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise SettingError(
            f"LoRA target_modules {config.target_modules!r} matched no linear layer; "
            f"the model's linear layers are: {shown or '(none)'}")
    for s in matched:
        if s.module.has_lora:
            raise ValueError(f"{s.name} already has a LoRA branch")
    if not 0.0 <= config.dropout < 1.0:
        raise SettingError(f"LoRA dropout must be in [0, 1), got {config.dropout}")
    # A stacked linear gets LoRA on all of its layers or on none: where the targets pick some
    # layers of a stack only, its layers are regrouped first (one stack per run of alike layers).
    if _split_partial_stacks(matched):
        apply_lora(model, config, rngs)  # every stack is now matched whole or not at all
        for _, node in list(nnx.iter_graph(model)):
            if isinstance(node, StackedLayers):
                node.restack(node.unstack())  # merge alike neighbours again
        return model
    draws: dict[int, list] = {}
    for s in matched:
        draws.setdefault(id(s.module), []).append(_draw(config, s.module, rngs))
    done = set()
    for s in matched:
        if id(s.module) in done:
            continue
        done.add(id(s.module))
        parts = draws[id(s.module)]
        if s.index is None:
            (a, drop), = parts
        else:
            a = jnp.stack([p[0] for p in parts])
            drop = stack_modules([p[1] for p in parts]) if parts[0][1] is not None else None
        s.module.attach_lora(config.rank, config.alpha, use_rslora=config.use_rslora, lora_A=a, dropout=drop)
    return model


def _split_partial_stacks(matched) -> bool:
    """Split the stacks in which the targets match some layers only into stacks of one layer;
    True when any was split."""
    hit: dict[int, set] = {}
    for s in matched:
        if s.index is not None:
            hit.setdefault(id(s.module), set()).add(s.index)
    partial = {id(s.container): s.container for s in matched
               if s.index is not None and len(hit[id(s.module)]) != s.stack.size}
    for container in partial.values():
        layers = container.unstack()
        container.stacks = nnx.List([container.stack_type(stack_modules([layer]), i, 1)
                                     for i, layer in enumerate(layers)])
    return bool(partial)


def lora_params_by_module(model) -> dict[str, dict[str, jnp.ndarray]]:
    """{HF module name: {"lora_A": (r, in), "lora_B": (out, r)}} for every layer with LoRA."""
    out = {}
    for s in _slots(model):
        if s.module.has_lora:
            a, b = s.module.lora_A[...], s.module.lora_B[...]
            out[s.name] = {"lora_A": a if s.index is None else a[s.index],
                           "lora_B": b if s.index is None else b[s.index]}
    return out


def lora_state_by_module(model, state) -> dict[str, dict[str, jnp.ndarray]]:
    """A `nnx.LoRAParam`-shaped State of `model` (its gradients, say) by HF module name, like
    `lora_params_by_module`: entries of stacked layers split per layer."""
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    paths = {id(n): tuple(p) for p, n in nnx.iter_graph(model)}
    out = {}
    for s in _slots(model):
        if not s.module.has_lora:
            continue
        base = paths[id(s.module)]
        vals = {k: flat[base + (k,)] for k in ("lora_A", "lora_B")}
        vals = {k: (v.get_value() if isinstance(v, nnx.Variable) else v) for k, v in vals.items()}
        out[s.name] = {k: (v if s.index is None else v[s.index]) for k, v in vals.items()}
    return out


def set_lora_params(model, params_by_module: Mapping[str, Mapping[str, jnp.ndarray]], *, strict: bool = True):
    """Inverse of `lora_params_by_module` (e.g. after importing a PEFT adapter); returns `model`.

    strict=True: every module named must exist and have LoRA, and every LoRA layer of the model
    must be given. Shapes are checked against each layer's rank and features."""
    slots = {s.name: s for s in _slots(model)}
    updates: dict[int, tuple] = {}
    for name, p in params_by_module.items():
        if name not in slots:
            raise KeyError(f"set_lora_params: the model has no linear layer named {name!r}")
        s = slots[name]
        layer = s.module
        if not layer.has_lora:
            raise ValueError(f"set_lora_params: {name} has no LoRA branch (apply_lora first)")
        missing = {"lora_A", "lora_B"} - set(p)
        if missing:
            raise KeyError(f"set_lora_params: {name} is missing {sorted(missing)}")
        want = lora_shapes(layer)
        for key in ("lora_A", "lora_B"):
            if tuple(p[key].shape) != want[key]:
                raise ValueError(f"set_lora_params: {name}: {key} has shape {tuple(p[key].shape)}, "
                                 f"expected {want[key]}")
        if s.index is None:
            layer.set_lora(p["lora_A"], p["lora_B"])
        else:
            updates.setdefault(id(layer), (layer, []))[1].append((s.index, p["lora_A"], p["lora_B"]))
    for layer, items in updates.values():  # one write per stacked array, not one per layer
        a, b = layer.lora_A[...], layer.lora_B[...]
        idx = jnp.asarray([i for i, _, _ in items])
        a = a.at[idx].set(jnp.stack([jnp.asarray(x, a.dtype) for _, x, _ in items]))
        b = b.at[idx].set(jnp.stack([jnp.asarray(x, b.dtype) for _, _, x in items]))
        layer.lora_A.set_value(a)
        layer.lora_B.set_value(b)
    if strict:
        absent = [n for n, s in slots.items() if s.module.has_lora and n not in params_by_module]
        if absent:
            raise KeyError(f"set_lora_params: no weights given for LoRA layers {absent[:8]}"
                           + (" ..." if len(absent) > 8 else ""))
    return model
