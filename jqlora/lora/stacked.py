"""Layers stored stacked: one module whose every Variable has a leading layer axis.

A transformer's layers share one structure, so their weights can live in one array per weight
kind (leading axis = layer) and the forward can be one `lax.scan` over that axis: the compiled
program holds one layer's code, whatever the depth. `StackedLayers` holds runs of layers of one
structure as `LayerStack`s (a model whose layers differ gets one stack per run) and keeps per-layer
access: `layers[i]` is a write-through view, and `jqlora.lora.named_linears` names each layer's
linear modules as before (`model.layers.3.mlp.up_proj`).

The stacked arrays are the storage, built once; nothing is stacked inside a step.
"""
from __future__ import annotations

import collections
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["LayerStack", "StackedLayers", "stacked_view", "stack_modules"]


def _is_key(a) -> bool:
    return isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def _stack(parts):
    if _is_key(parts[0]):
        return jax.random.wrap_key_data(jnp.stack([jax.random.key_data(p) for p in parts]),
                                        impl=jax.random.key_impl(parts[0]))
    if all(isinstance(p, np.ndarray) for p in parts):  # staged on the host: stacked there, moved later
        return np.stack(parts)
    return jnp.stack(parts)


def signature(module: nnx.Module):
    """What two modules must share to be stacked: module structure and static attributes (for a
    decoder layer: window, numerics, LoRA rank), pytree structure (weight formats) and every
    array's shape and dtype."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def _last_uses_on_default_device(parts, donate: collections.Counter) -> bool:
    """Whether every part is an array of JAX's default device (one device, not a key) whose last
    remaining uses are these."""
    here = collections.Counter(id(p) for p in parts)
    default = jax.devices()[0]
    return all(isinstance(p, jax.Array) and not _is_key(p) and not p.is_deleted()
               and p.sharding.device_set == {default} and donate[id(p)] == here[id(p)] for p in parts)


def _stack_through_host(parts) -> np.ndarray:
    """The parts stacked on the host, each copied out and deleted from the device in turn: the
    device never holds the stack and its parts at once (`jnp.stack` would, twice the weight
    kind); `jqlora.models.build.to_device` moves the stack back with the staged host arrays."""
    out = np.empty((len(parts), *parts[0].shape), parts[0].dtype)
    copied = {}
    for j, p in enumerate(parts):
        out[j] = copied[id(p)] if id(p) in copied else np.asarray(jax.device_get(p))
        if not p.is_deleted():
            copied[id(p)] = out[j]
            p.delete()
    return out


def stack_modules(modules: Sequence[nnx.Module], donate: Optional[collections.Counter] = None) -> nnx.Module:
    """One module of the shared structure whose arrays are the modules' arrays stacked on a new
    leading axis, built leaf by leaf. With `donate` (id(array) -> remaining uses) a source array
    is deleted after its last use is stacked; a weight kind whose device arrays all reach their
    last use is stacked on the host (`_stack_through_host`), so building needs no extra device
    memory for it, where `jnp.stack` would need the kind twice (9 GiB for a 30B MoE's experts)."""
    graphdef, _ = nnx.split(modules[0])
    flat = [jax.tree.flatten(nnx.state(m)) for m in modules]
    out = []
    for i in range(len(flat[0][0])):
        parts = [f[0][i] for f in flat]
        through_host = donate is not None and _last_uses_on_default_device(parts, donate)
        out.append(_stack_through_host(parts) if through_host else _stack(parts))
        if donate is not None:
            for p in parts:
                donate[id(p)] -= 1
                if donate[id(p)] == 0 and isinstance(p, jax.Array) and not p.is_deleted():
                    p.delete()
    return nnx.merge(graphdef, jax.tree.unflatten(flat[0][1], out))


def _write_through(live: nnx.Variable, j: int, path):
    def hook(_var, value):
        full = live.get_value()
        want = jax.tree.structure(full), [tuple(a.shape[1:]) for a in jax.tree.leaves(full)]
        got = jax.tree.structure(value), [tuple(jnp.shape(a)) for a in jax.tree.leaves(value)]
        if want != got:
            raise ValueError(f"{'.'.join(map(str, path))}: a layer view takes whole values of the layer's "
                             f"structure and shapes {want[1]}, got {got[1]}")
        live.set_value(jax.tree.map(lambda a, v: a.at[j].set(jnp.asarray(v, a.dtype)), full, value))
        return value
    return hook


def stacked_view(module: nnx.Module, j: int) -> nnx.Module:
    """Entry j of a stacked module as a module of its own. Its values are copies of the slices
    (a snapshot), and `set_value` on any of its Variables (e.g. `view.base.set_value(w)`,
    `QLoRALinear.set_lora`) writes through into the stacked arrays."""
    graphdef, state = nnx.split(module)
    sliced = jax.tree.map(lambda a: a[j], state)
    live = dict(nnx.to_flat_state(state))
    for path, var in nnx.to_flat_state(sliced):
        var.set_metadata("on_set_value", _write_through(live[path], j, path))
    return nnx.merge(graphdef, sliced)


class LayerStack(nnx.Module):
    """Layers start .. start + size - 1 of one structure, stored stacked in `self.layer` (every
    Variable with a leading axis of length `size`). Subclasses add the forward (a scan)."""

    def __init__(self, layer: nnx.Module, start: int, size: int):
        self.layer = layer
        self.start = int(start)
        self.size = int(size)

    def unstack(self) -> list:
        graphdef, state = nnx.split(self.layer)
        return [nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state)) for j in range(self.size)]

    def view(self, j: int) -> nnx.Module:
        return stacked_view(self.layer, j)


class StackedLayers(nnx.Module):
    """Layers stored as `LayerStack`s of consecutive layers that share a structure (one stack for
    a model whose layers are alike). Layers that differ (a sliding window on some layers only, a
    weight format or LoRA on some layers only) start a new stack.

    Per-layer access keeps the numbering: `len(layers)`, `layers[i]` (a write-through view:
    `stacked_view`), iteration."""

    stack_type = LayerStack

    def __init__(self, layers: Sequence[nnx.Module], donate: Optional[collections.Counter] = None):
        self.num_layers = len(layers)
        self.stacks = nnx.List(self._group(list(layers), donate))

    def _group(self, layers, donate=None) -> list:
        groups, start = [], 0
        while start < len(layers):
            sig = signature(layers[start])
            end = start + 1
            while end < len(layers) and signature(layers[end]) == sig:
                end += 1
            stacked = stack_modules(layers[start:end], donate)
            groups.append(self.stack_type(stacked, start, end - start))
            start = end
        return groups

    def unstack(self) -> list:
        """Every layer as a module of its own (copies of the stacked slices)."""
        return [layer for s in self.stacks for layer in s.unstack()]

    def restack(self, layers: Sequence[nnx.Module]) -> None:
        """Replace the layers (e.g. after changing some of them) and regroup them."""
        if len(layers) != self.num_layers:
            raise ValueError(f"restack: expected {self.num_layers} layers, got {len(layers)}")
        self.stacks = nnx.List(self._group(list(layers)))

    def locate(self, i: int) -> tuple[Any, int]:
        """(stack, index inside it) of layer i."""
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range for {self.num_layers} layers")
        i %= self.num_layers
        for s in self.stacks:
            if s.start <= i < s.start + s.size:
                return s, i - s.start
        raise AssertionError("unreachable: the stacks cover every layer")

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int) -> nnx.Module:
        stack, j = self.locate(i)
        return stack.view(j)

    def __iter__(self):
        return (self[i] for i in range(self.num_layers))
