"""Several devices and hosts on `jax.sharding`: the mesh, and where each array of a training run lives.

One mesh with two axes, ``data`` and ``fsdp`` (either may be 1):

- **Batch rows** are split over both axes together (``P(("data", "fsdp"))`` on the row axis): under
  FSDP every device still takes its own rows (ZeRO-3), otherwise the ``fsdp`` devices would compute
  the same rows twice. The global batch must be a multiple of ``data * fsdp``.
- **Frozen weights** (packed 4-bit codes, absmax, nested absmax, int8 codes and row scales, dense
  bases, the embedding table) are cut into ``fsdp`` contiguous pieces along their output dimension,
  replicated over ``data``. A `Weight4bit` stores ``packed`` flat (``(n + 1) // 2,``, row-major) and
  ``absmax`` flat (``nblocks,``); when N (rows) and nblocks are multiples of ``fsdp``, piece i of
  ``packed`` is exactly rows ``i*N/fsdp .. (i+1)*N/fsdp`` and piece i of ``absmax`` their blocks: a
  whole number of rows and of quantization blocks per shard (checked by :func:`weight_layout`).
  ``nested_absmax`` (one float per 256 blocks) is cut the same way only when each piece holds whole
  groups of 256 blocks, else replicated (it is ``nblocks / 256`` floats). The code tables and the
  offset are replicated. Leading axes (a stacked layer axis) are never cut.
- **Mixture-of-experts stacks** (`ExpertWeights`: every array with an expert axis, after any
  stacked layer axis) are cut into ``fsdp`` pieces of whole experts along that axis when the
  expert count splits, as are the experts' stacked LoRA factors (A (..., E, r, in), B (..., E,
  out, r)) and their optimizer state: at a Qwen3-30B-A3B shape they are most of a run's memory
  (16 GB of NF4 experts, 13 GB of float32 LoRA state under AdamW). Across processes the expert
  LoRA stays replicated, as all LoRA does (below).
- **Other LoRA params, optimizer state, RNG state** are replicated: they are a few MB for a rank-16
  adapter, so sharding them saves little and would add a gather per layer to the update.
  Checkpoints and PEFT exports then read them like single-device arrays, giving the same files
  (within one process, cut arrays read whole as well).

Inside the step, each product ``qmatmul`` runs under ``jax.shard_map`` when a mesh is active
(:mod:`jqlora.ops.sharding`): rows of x split like the batch, the weight and LoRA matrices gathered whole
at its boundary. So a Pallas kernel sees whole local tiles (a kernel is an opaque custom call that
XLA's SPMD partitioner cannot split), each layer's weights are gathered just before its product,
and the LoRA gradients are summed over devices by the shard_map transpose. Everything else (norms,
attention, the loss) is partitioned by XLA from the sharded inputs.

Several hosts: call ``jax.distributed.initialize(...)`` first (one process per GPU or per host);
the mesh then spans ``jax.devices()`` and every array here is built with
``jax.make_array_from_callback``, each process supplying only its own devices' pieces.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jqlora.errors import SettingError
from jqlora.ops.sharding import AXES, ROWS

log = logging.getLogger(__name__)

__all__ = ["AXES", "parse_mesh_spec", "make_mesh", "resolve_mesh", "row_count", "check_batch_size",
           "shard_batch", "placement", "place_model", "place_state", "weight_layout", "expert_axis"]
# Arrays of at most this many elements are replicated by the loader's shape rule (code tables,
# the 256-entry dynamic map, scalars): cutting them saves nothing.
_SMALL = 256
_NESTED = 256  # blocks per nested-absmax group (bitsandbytes)


# ----------------------------------------------------------------------------------------------
# the mesh
# ----------------------------------------------------------------------------------------------

def parse_mesh_spec(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=2"`` -> ``{"data": 2, "fsdp": 2}`` (missing axes are 1).

    Args:
      spec: comma-separated ``axis=size`` pairs; axes ``data`` and ``fsdp``, sizes >= 1.

    Raises:
      SettingError: an unknown axis, a repeated axis, a size that is not a positive integer.
    """
    sizes = {a: 1 for a in AXES}
    seen = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z_]+)\s*=\s*(\d+)", part)
        if m is None:
            raise SettingError(f"mesh spec {spec!r}: {part!r} is not axis=size (e.g. 'data=2,fsdp=2')")
        axis, size = m.group(1), int(m.group(2))
        if axis not in AXES:
            raise SettingError(f"mesh spec {spec!r}: unknown axis {axis!r}; axes are {', '.join(AXES)}")
        if axis in seen:
            raise SettingError(f"mesh spec {spec!r}: axis {axis!r} given twice")
        if size < 1:
            raise SettingError(f"mesh spec {spec!r}: axis {axis!r} has size {size}; sizes are >= 1")
        seen.add(axis)
        sizes[axis] = size
    if not seen:
        raise SettingError(f"mesh spec {spec!r} names no axis (e.g. 'data=2,fsdp=2')")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A ``(data, fsdp)`` mesh over the first ``data * fsdp`` of ``devices``.

    Args:
      spec: ``"data=2,fsdp=2"``, a dict of axis sizes, or None for every device on ``data``.
      devices: the devices to use (default ``jax.devices()``: every process's, under
        ``jax.distributed``).

    Raises:
      SettingError: a malformed spec, or one that needs more devices than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    if spec is None:
        sizes = {"data": len(devices), "fsdp": 1}
    elif isinstance(spec, str):
        sizes = parse_mesh_spec(spec)
    else:
        sizes = parse_mesh_spec(",".join(f"{k}={v}" for k, v in dict(spec).items()))
    n = sizes["data"] * sizes["fsdp"]
    if n > len(devices):
        raise SettingError(f"mesh data={sizes['data']},fsdp={sizes['fsdp']} needs {n} devices; "
                         f"there are {len(devices)}")
    grid = np.array(devices[:n], dtype=object).reshape(sizes["data"], sizes["fsdp"])
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def resolve_mesh(mesh, batch_size: int | None = None) -> Mesh | None:
    """The mesh a run uses, or None for the plain one-device path.

    ``mesh``: None (the default: every device on ``data``), a spec string or dict, or a
    ``jax.sharding.Mesh`` with axes ``data`` and ``fsdp``. With the default and a ``batch_size``
    that does not split over every device, ``data`` takes the most devices the batch splits over
    (gcd of the two: batch 1 runs on one device), and says so. A mesh of one device gives None:
    exactly the code path of a run without a mesh.
    """
    if mesh is None and batch_size is not None:
        n = len(jax.devices())
        data = math.gcd(n, int(batch_size))
        if data < n:
            log.warning("mesh: data=%d of %d devices (batch_size %d splits over %d; pass --mesh "
                        "or a batch size that is a multiple of %d to use them all)",
                        data, n, batch_size, data, n)
        mesh = {"data": data, "fsdp": 1}
    if isinstance(mesh, Mesh):
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"a training mesh has axes {AXES}, got {tuple(mesh.axis_names)} "
                             "(build one with jqlora.parallel.make_mesh)")
        m = mesh
    else:
        m = make_mesh(mesh)
    return None if m.size == 1 else m


def row_count(mesh: Mesh | None) -> int:
    """How many pieces batch rows are cut into: ``data * fsdp`` (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape["data"] * mesh.shape["fsdp"])


def check_batch_size(batch_size: int, mesh: Mesh | None, what: str = "batch_size") -> None:
    """Raise SettingError (a ValueError) unless ``batch_size`` rows split evenly over the mesh."""
    n = row_count(mesh)
    if batch_size % n:
        raise SettingError(
            f"{what} {batch_size} does not split over the mesh (data={mesh.shape['data']}, "
            f"fsdp={mesh.shape['fsdp']}): every device takes its own rows, so the global batch must "
            f"be a multiple of data * fsdp = {n}")


# ----------------------------------------------------------------------------------------------
# putting arrays onto the mesh
# ----------------------------------------------------------------------------------------------

def _spec(ndim: int, axis: int | None, name) -> P:
    if axis is None:
        return P()
    parts = [None] * ndim
    parts[axis] = name
    return P(*parts)


def _put(x, sharding: NamedSharding):
    """``x`` (numpy or jax) onto ``sharding``. Within one process a device-to-device copy; across
    processes each one builds only its own pieces from its (host-local, equal) value."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding), impl=impl)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, row_axis: int = 1) -> dict:
    """Global arrays of a host batch, rows split over ``data`` x ``fsdp``.

    Every process holds the same global batch (the same data and seed); each one places only the
    rows of its own devices.

    Args:
      batch: dict of numpy arrays; ``row_axis`` is their row axis (1 for the train step's
        ``(grad_accum, batch, seq)``, 0 for an eval batch).
      mesh: the run's mesh.
      row_axis: the axis split over the devices.

    Raises:
      ValueError: the row count is not a multiple of ``data * fsdp``.
    """
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        check_batch_size(v.shape[row_axis], mesh, what="batch size")
        out[k] = _put(v, NamedSharding(mesh, _spec(v.ndim, row_axis, ROWS)))
    return out


def _cut(mesh: Mesh, ndim: int, axis: int | None) -> NamedSharding:
    return NamedSharding(mesh, _spec(ndim, axis, "fsdp"))


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Where a 4-bit weight's flat arrays are cut: the axis of each (None: replicated)."""

    packed: int | None
    absmax: int | None
    nested_absmax: int | None


def weight_layout(w, fsdp: int) -> WeightLayout:
    """The cut axes of a `Weight4bit`'s arrays over ``fsdp`` pieces, by shape.

    ``packed`` is flat ``(..., (n + 1) // 2)`` or ``(..., N, K // 2)``; ``absmax`` flat
    ``(..., nblocks)`` or ``(..., N, K // blocksize)``; leading axes (stacked layers) stay whole.
    Both are cut only when every piece holds whole rows and whole blocks: N, n / blocksize and
    (n / fsdp) / blocksize integral. ``nested_absmax`` is cut only when each piece also holds whole
    groups of 256 blocks.
    """
    nrows, ncols = int(w.shape[-2]), int(w.shape[-1])
    n, bs = nrows * ncols, int(w.blocksize)
    whole = fsdp > 1 and nrows % fsdp == 0 and n % bs == 0 and (n // fsdp) % bs == 0 and bs % 2 == 0
    nb = n // bs if whole else 0

    def axis(leaf, flat_len, rows_shape):
        if leaf is None or not whole:
            return None
        shape = tuple(leaf.shape)
        if shape and shape[-1] == flat_len:
            return len(shape) - 1
        if len(shape) >= 2 and shape[-2:] == rows_shape:
            return len(shape) - 2
        return None

    packed = axis(w.packed, n // 2, (nrows, ncols // 2))
    absmax = axis(w.absmax, nb, (nrows, ncols // bs))
    nested = None
    if w.nested_absmax is not None and whole and (nb // fsdp) % _NESTED == 0:
        nested = axis(w.nested_absmax, nb // _NESTED, ())
    return WeightLayout(packed, absmax, nested)


def expert_axis(experts) -> int:
    """The expert axis of every array of an `ExpertWeights`' stack: 0, or 1 under a stacked layer
    axis (read from a leaf whose per-expert rank is fixed: a 4-bit code table, int8 codes, a dense
    (N, K) weight)."""
    from jqlora.quant import Int8Weight, Weight4bit  # noqa: PLC0415

    s = experts.stack
    if isinstance(s, Weight4bit):
        return s.code.ndim - 2
    if isinstance(s, Int8Weight):
        return s.cb.ndim - 3
    return s.ndim - 3


def _place_experts(value, mesh: Mesh):
    """An `ExpertWeights` onto the mesh: whole experts per ``fsdp`` piece, when E splits."""
    f = int(mesh.shape["fsdp"])
    ax = expert_axis(value) if f > 1 and value.num_experts % f == 0 else None
    return dataclasses.replace(value, stack=jax.tree.map(lambda x: _put(x, _cut(mesh, x.ndim, ax)), value.stack))


def _expert_lora_paths(model) -> set:
    """The state paths of the stacked expert LoRA factors (`QLoRAExperts.lora_A` / `lora_B`)."""
    from flax import nnx  # noqa: PLC0415

    from jqlora.lora.experts import QLoRAExperts  # noqa: PLC0415

    return {tuple(path) + (name,) for path, node in nnx.iter_graph(model)
            if isinstance(node, QLoRAExperts) and node.has_lora for name in ("lora_A", "lora_B")}


def _expert_lora_sharding(value, mesh: Mesh) -> NamedSharding:
    """A stacked expert LoRA factor (..., E, a, b) (or its optimizer state): cut over ``fsdp``
    along E when E splits and every device is this process's, else replicated."""
    f = int(mesh.shape["fsdp"])
    ax = value.ndim - 3
    cut = f > 1 and value.shape[ax] % f == 0 and NamedSharding(mesh, P()).is_fully_addressable
    return _cut(mesh, value.ndim, ax if cut else None)


def _place_base(value, mesh: Mesh):
    """A linear layer's frozen base (Weight4bit, Int8Weight, dense (..., N, K) or a mixture's
    ExpertWeights) onto the mesh."""
    from jqlora.quant import ExpertWeights, Int8Weight, Weight4bit  # noqa: PLC0415 (parallel stays import-light)

    f = int(mesh.shape["fsdp"])
    rep = NamedSharding(mesh, P())
    if isinstance(value, ExpertWeights):
        return _place_experts(value, mesh)
    if isinstance(value, Weight4bit):
        lay = weight_layout(value, f)
        put = lambda leaf, ax: None if leaf is None else _put(leaf, _cut(mesh, leaf.ndim, ax))  # noqa: E731
        return dataclasses.replace(
            value, packed=put(value.packed, lay.packed), absmax=put(value.absmax, lay.absmax),
            code=put(value.code, None), nested_absmax=put(value.nested_absmax, lay.nested_absmax),
            nested_code=put(value.nested_code, None), offset=put(value.offset, None))
    if isinstance(value, Int8Weight):
        rows = value.cb.shape[-2]
        ok = f > 1 and rows % f == 0
        return dataclasses.replace(
            value, cb=_put(value.cb, _cut(mesh, value.cb.ndim, value.cb.ndim - 2 if ok else None)),
            scb=_put(value.scb, _cut(mesh, value.scb.ndim, value.scb.ndim - 1 if ok else None)))
    if hasattr(value, "ndim") and value.ndim >= 2 and f > 1 and value.shape[-2] % f == 0:
        return _put(value, _cut(mesh, value.ndim, value.ndim - 2))
    return jax.tree.map(lambda x: _put(x, rep), value)


def place_model(model, mesh: Mesh | None):
    """Move every array of an NNX model onto ``mesh`` (in place; returns the model).

    Linear bases (`QuantizedBase`) and the token embedding (`embed_tokens`) are cut over ``fsdp``
    along their output (vocabulary) axis, expert stacks and their LoRA factors along the expert
    axis (module docstring); everything else (norms, biases, other LoRA params, RNG state) is
    replicated. ``mesh=None`` leaves the model as it is.
    """
    if mesh is None:
        return model
    from flax import nnx  # noqa: PLC0415

    from jqlora.lora.linear import QuantizedBase  # noqa: PLC0415

    f = int(mesh.shape["fsdp"])
    rep = NamedSharding(mesh, P())
    expert_lora = _expert_lora_paths(model)
    updates = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if not isinstance(var, nnx.Variable):
            continue
        value = var.get_value()
        if isinstance(var, QuantizedBase):
            new = _place_base(value, mesh)
        elif tuple(path) in expert_lora:
            new = _put(value, _expert_lora_sharding(value, mesh))
        elif ("embed_tokens" in [str(p) for p in path] and getattr(value, "ndim", 0) == 2
              and f > 1 and value.shape[0] % f == 0):
            new = _put(value, _cut(mesh, 2, 0))
        else:
            new = jax.tree.map(lambda x: _put(x, rep) if isinstance(x, (jax.Array, np.ndarray)) else x,
                               value)
        updates.append((path, var.replace(new)))
    nnx.update(model, nnx.from_flat_state(updates))
    return model


def place_state(model, optimizer, mesh: Mesh | None) -> None:
    """:func:`place_model` for the model, and the optimizer's state on ``mesh``: the moments of
    the expert LoRA factors placed as those factors are, the rest replicated."""
    if mesh is None:
        return
    from flax import nnx  # noqa: PLC0415

    place_model(model, mesh)
    rep = NamedSharding(mesh, P())
    expert_lora = _expert_lora_paths(model)

    def sharding(path, x):  # an optimizer state path ends with the path of its parameter
        path = tuple(path)
        of_expert = any(path[i:] in expert_lora for i in range(len(path)))
        return _expert_lora_sharding(x, mesh) if of_expert and getattr(x, "ndim", 0) >= 3 else rep

    updates = [(path, var.replace(jax.tree.map(lambda x, p=path: _put(x, sharding(p, x)), var.get_value())))
               for path, var in nnx.to_flat_state(nnx.state(optimizer)) if isinstance(var, nnx.Variable)]
    nnx.update(optimizer, nnx.from_flat_state(updates))


def placement(mesh: Mesh) -> Callable:
    """A loader's ``put(array) -> jax.Array`` for checkpoint tensors read one at a time.

    Each tensor goes straight onto its shards: arrays larger than 256 elements whose first axis
    splits into ``fsdp`` pieces are cut along it (flat packed codes and absmax, int8 codes and row
    scales, dense weights and the embedding: all output-major), the rest replicated. Each device
    (each process, across hosts) receives only its piece, sliced from the one host copy of that
    tensor. :func:`place_model` afterwards applies the exact per-role rule, moving only what this
    shape rule placed otherwise (small tensors such as norm weights).
    """
    f = int(mesh.shape["fsdp"])

    def put(arr):
        arr = np.asarray(arr)
        cut = f > 1 and arr.ndim >= 1 and arr.size > _SMALL and arr.shape[0] % f == 0
        sharding = _cut(mesh, arr.ndim, 0 if cut else None)
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])

    return put
