"""What runs inside a traced step when a device mesh is active: each quantized product per device.

A product ``qmatmul`` runs under ``jax.shard_map`` when a mesh is active (:func:`activate`): rows
of x split over the mesh's row axes, the weight and LoRA matrices gathered whole at its boundary.
So a Pallas kernel sees whole local tiles (a kernel is an opaque custom call that XLA's SPMD
partitioner cannot split), and the LoRA gradients are summed over devices by the shard_map
transpose. Where arrays live (the mesh, placing a model) is :mod:`jqlora.parallel`, which stands
above the LoRA modules; this module stands below them, beside the op that uses it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

__all__ = ["AXES", "ROWS", "activate", "with_mesh", "product_mesh", "per_device", "device_share", "local_rows"]

AXES = ("data", "fsdp")  # the training mesh's axes (jqlora.parallel builds it)
ROWS = AXES  # the mesh axes batch rows are split over


def activate(mesh: Mesh | None):
    """A context in which traced products run per device over ``mesh`` (nothing when None)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def with_mesh(mesh: Mesh | None, fn: Callable) -> Callable:
    """``fn`` called inside :func:`activate` ``(mesh)``; ``fn`` itself when ``mesh`` is None."""
    if mesh is None:
        return fn

    def call(*args, **kwargs):
        with activate(mesh):
            return fn(*args, **kwargs)

    return call


def product_mesh(rows: int):
    """The active mesh's row axes when a product of ``rows`` rows should run per device, else None.

    None outside :func:`activate`, on a one-device mesh, inside a shard_map already, or when
    ``rows`` does not split over ``data * fsdp`` (the product then runs as XLA partitions it).
    """
    am = jax.sharding.get_abstract_mesh()
    if am.empty or am.size == 1 or am.manual_axes or not set(ROWS) <= set(am.axis_names):
        return None
    n = int(np.prod([am.shape[a] for a in ROWS]))
    return am if n > 1 and rows % n == 0 else None


def per_device(fn: Callable, x, *whole):
    """``fn(x, *whole)`` with x's rows split over the active mesh and ``whole`` gathered.

    Runs ``fn`` under ``jax.shard_map``: x (rows, K) arrives as this device's rows, every array of
    ``whole`` (the weight pytree, LoRA matrices) whole; the transpose sums the per-device
    cotangents of ``whole`` over the mesh. Without an active mesh (see :func:`product_mesh`) it is
    ``fn(x, *whole)``.
    """
    am = product_mesh(x.shape[0])
    if am is None:
        return fn(x, *whole)

    rows = P(ROWS, *([None] * (x.ndim - 1)))
    # check_vma=False: Pallas kernels declare their outputs without a varying-axes type, which
    # check_vma=True rejects; the transpose still sums the cotangents of the replicated inputs
    # over the mesh (tests/models/test_mesh.py compares LoRA weights with a one-device run).
    return jax.shard_map(fn, mesh=am, in_specs=(rows,) + (P(),) * len(whole), out_specs=rows,
                         check_vma=False)(x, *whole)


def device_share() -> tuple[int, int]:
    """(row shards, fsdp) of the active mesh: the batch is split into that many row shards and the
    frozen weights into fsdp shards; (1, 1) without an active mesh. What one device holds, for
    memory plans made while tracing (`remat="auto"`)."""
    am = jax.sharding.get_abstract_mesh()
    if am.empty or am.manual_axes:
        return 1, 1
    rows = int(np.prod([am.shape[a] for a in ROWS if a in am.axis_names]))
    fsdp = int(am.shape["fsdp"]) if "fsdp" in am.axis_names else 1
    return rows, fsdp


def local_rows(rows: int) -> int:
    """Rows per device for a product of ``rows`` rows (what a kernel sees): ``rows`` without a mesh."""
    am = product_mesh(rows)
    return rows if am is None else rows // int(np.prod([am.shape[a] for a in ROWS]))
