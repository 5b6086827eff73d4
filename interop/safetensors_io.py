"""safetensors reading and writing without torch, one tensor at a time.

File layout (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N
bytes of UTF-8 JSON header, then the data section. The header maps each tensor name to
``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`` (offsets relative to the data
section) and may hold ``"__metadata__": {str: str}``. The data section must be covered exactly:
no overlaps, no holes, nothing after the last tensor. All values are little-endian.

Reading parses and validates the header only; a tensor's bytes are read when asked for, as a
view of an ``np.memmap`` of the file (``copy=True`` gives an owned array). bfloat16 and float8
come back as ml_dtypes arrays. Every problem raises :class:`CheckpointError` naming the file and
the tensor.

Writing produces byte-for-byte what ``safetensors.numpy.save_file`` writes (tensors laid out by
dtype, widest first, then by name; compact JSON header padded with spaces to a multiple of 8),
to a temporary name in the same directory, then ``os.replace`` (interop.atomic_io).
:func:`serialize` / :func:`deserialize` do the same in memory.

This is the project's one safetensors reader and writer: bitsandbytes checkpoints, PEFT adapters
(:mod:`interop.peft_adapter`) and training checkpoints (:mod:`jqlora.train.checkpoint`) all go
through it. The ``safetensors`` package is used only by the tests, as the oracle these files
must match.
"""
from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from interop.atomic_io import atomic_path, write_bytes_atomic  # noqa: F401  (write_bytes_atomic re-exported)

from interop.errors import CheckpointError
from interop.json_io import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit

# safetensors dtype name -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
# Order of the Rust `Dtype` enum; the writer lays tensors out by descending rank, then by name.
_DTYPE_RANK = {
    name: i
    for i, name in enumerate(
        ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
         "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
    )
}


def dtype_name(dtype) -> str:
    """safetensors dtype name of a numpy dtype (ValueError if it has none)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    for name, candidate in DTYPES.items():
        if candidate == dt:
            return name
    raise ValueError(f"dtype {dt} has no safetensors equivalent")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range [start, end) in `path`."""

    name: str
    dtype: str
    shape: tuple
    start: int
    end: int
    path: Path

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _err(path, msg, tensor=None) -> CheckpointError:
    where = f"{path}" + (f", tensor {tensor!r}" if tensor is not None else "")
    return CheckpointError(f"{where}: {msg}")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _header_length(path, first8: bytes, size: int) -> int:
    """The header length N from the file's first 8 bytes, checked against the file size."""
    if size < 8:
        raise _err(path, f"file is {size} bytes, too short for the 8-byte header length (truncated?)")
    n = int.from_bytes(first8, "little")
    if n > size - 8:
        raise _err(path, f"header length {n} runs past the end of the file ({size} bytes; truncated or corrupt)")
    if n > MAX_HEADER_BYTES:
        raise _err(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    return n


def read_header(path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header; returns ({name: TensorInfo}, metadata)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = _header_length(path, f.read(8), size)
            raw = f.read(n)
    except OSError as e:
        raise _err(path, f"cannot read: {e}") from e
    return _parse_header(path, raw, 8 + n, size - 8 - n)


def _parse_header(path, raw: bytes, data_start: int, data_len: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate header bytes `raw` whose data section is [data_start, data_start + data_len)."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise _err(path, f"header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise _err(path, f"header is a JSON {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _err(path, "__metadata__ must map strings to strings")

    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _err(path, f"header entry is a {type(entry).__name__}, expected an object", name)
        extra = set(entry) - {"dtype", "shape", "data_offsets"}
        if extra:
            raise _err(path, f"unexpected header fields {sorted(extra)}", name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise _err(path, f"unknown or unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}", name)
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _err(path, f"shape {shape!r} is not a list of non-negative integers", name)
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _err(path, f"data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end", name)
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != want:
            raise _err(path, f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but dtype {dtype} "
                             f"x shape {shape} needs {want}", name)
        if offsets[1] > data_len:
            raise _err(path, f"data_offsets {offsets} run past the end of the data section ({data_len} bytes): "
                             "file truncated or offsets out of range", name)
        infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1], path)

    pos, prev = 0, None
    for info in sorted(infos.values(), key=lambda t: (t.start, t.end)):
        begin = info.start - data_start
        if begin < pos:
            raise _err(path, f"data_offsets [{begin}, {info.end - data_start}] overlap tensor {prev!r} "
                             f"(which ends at {pos})", info.name)
        if begin > pos:
            raise _err(path, f"hole in the data section: bytes [{pos}, {begin}) before this tensor belong to no tensor",
                       info.name)
        pos, prev = info.end - data_start, info.name
    if pos != data_len:
        raise _err(path, f"data section is {data_len} bytes but the tensors cover only {pos}: trailing bytes")
    return infos, dict(metadata)


class SafetensorsFile:
    """One validated safetensors file; tensors are read lazily through a memory map."""

    def __init__(self, path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._map = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key) -> bool:
        return key in self.tensors

    def info(self, key) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise _err(self.path, "no such tensor", key) from None

    def get(self, key, copy: bool = False) -> np.ndarray:
        """The tensor as a numpy array: a read-only view of the file, or an owned copy."""
        info = self.info(key)
        dt = info.np_dtype
        if info.nbytes == 0:
            return np.zeros(info.shape, dt)
        if self._map is None:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise _err(self.path, f"cannot map the file: {e}", key) from e
            if self._map.shape[0] < info.end:
                raise _err(self.path, "file shrank after its header was read (truncated)", key)
        if self._map.shape[0] < info.end:
            raise _err(self.path, "file truncated", key)
        arr = np.asarray(self._map[info.start: info.end]).view(dt).reshape(info.shape)
        return np.array(arr) if copy else arr

    def close(self):
        self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Checkpoint:
    """A single-file or sharded safetensors checkpoint, keyed by tensor name."""

    def __init__(self, files: list[SafetensorsFile], where: dict[str, SafetensorsFile], root: Path,
                 index: dict | None = None):
        self.files = files
        self._where = where
        self.root = root
        self.index = index

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def info(self, key) -> TensorInfo:
        f = self._where.get(key)
        if f is None:
            raise CheckpointError(f"{self.root}: no tensor {key!r} in the checkpoint")
        return f.info(key)

    def get(self, key, copy: bool = False) -> np.ndarray:
        f = self._where.get(key)
        if f is None:
            raise CheckpointError(f"{self.root}: no tensor {key!r} in the checkpoint")
        return f.get(key, copy=copy)

    def file_of(self, key) -> Path:
        return self.info(key).path

    def close(self):
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(path) -> Checkpoint:
    """Open `path`: a .safetensors file, or a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` plus the shards it names.

    Validates every header up front (no tensor data is read). Errors: neither file present, both
    present (ambiguous: one is stale), an index that is not JSON or lacks ``weight_map``, a shard
    the index names that does not exist, a key the index maps to a shard that lacks it, a key in
    a shard that the index does not list, a key in two shards.
    """
    path = Path(path)
    if path.is_file():
        f = SafetensorsFile(path)
        return Checkpoint([f], {k: f for k in f.keys()}, path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    single, index_path = path / SINGLE_FILE, path / INDEX_FILE
    if single.exists() and index_path.exists():
        raise CheckpointError(f"{path}: both {SINGLE_FILE} and {INDEX_FILE} exist; one of them is stale, remove it")
    if single.exists():
        f = SafetensorsFile(single)
        return Checkpoint([f], {k: f for k in f.keys()}, path)
    if not index_path.exists():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}")
    index = read_json_object(
        index_path, CheckpointError, unreadable="{path}: cannot parse the shard index ({error})",
        not_object="{path}: 'weight_map' must be an object mapping tensor names to shard files")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index_path}: 'weight_map' must be an object mapping tensor names to shard files")
    shards: dict[str, SafetensorsFile] = {}
    for key, shard in weight_map.items():
        if shard in shards:
            continue
        if Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(f"{index_path}: tensor {key!r} is mapped to {shard!r}, which is not a plain file name")
        if not (path / shard).is_file():
            raise CheckpointError(f"{index_path}: shard {shard!r} (holding tensor {key!r}) is missing from {path}")
        shards[shard] = SafetensorsFile(path / shard)
    where: dict[str, SafetensorsFile] = {}
    for key, shard in weight_map.items():
        if key not in shards[shard]:
            raise CheckpointError(f"{index_path}: tensor {key!r} is in no shard (the index maps it to {shard!r}, "
                                  "which does not contain it)")
        where[key] = shards[shard]
    for shard, f in shards.items():
        for key in f.keys():
            if weight_map.get(key) != shard:
                other = weight_map.get(key)
                raise CheckpointError(
                    f"{f.path}: tensor {key!r} is not listed in {INDEX_FILE}" if other is None else
                    f"{f.path}: tensor {key!r} also appears in shard {other!r}")
    return Checkpoint(list(shards.values()), where, path, index)


def deserialize(blob: bytes, path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse and validate a whole safetensors file held in memory, with the same checks as
    :func:`read_header`; `path` only names the file in errors.

    For callers that must check the exact bytes first (a checksum) and then read those same
    bytes. Returns ({name: owned numpy array}, metadata)."""
    path = Path(path)
    n = _header_length(path, bytes(blob[:8]), len(blob))
    infos, metadata = _parse_header(path, bytes(blob[8: 8 + n]), 8 + n, len(blob) - 8 - n)
    arrays = {}
    for name, info in infos.items():
        dt = info.np_dtype
        count = math.prod(info.shape)
        arrays[name] = (np.frombuffer(blob, dtype=dt, count=count, offset=info.start).reshape(info.shape).copy()
                        if count else np.zeros(info.shape, dt))
    return arrays, metadata


# --------------------------------------------------------------------------------------------
# writing

class LazyArray:
    """An array computed only when written: `shape`, `dtype` now, `fn()` (numpy) at write time.

    Lets a writer plan the file layout without holding every tensor in host memory at once.
    """

    def __init__(self, fn, shape, dtype):
        self.fn, self.shape, self.dtype = fn, tuple(shape), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self.fn())
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"LazyArray produced {arr.dtype}{arr.shape}, promised {self.dtype}{self.shape}")
        return arr if dtype is None else arr.astype(dtype)


def _as_numpy(x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def _spec(x) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of a numpy / jax / LazyArray without materializing it on the host."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(d) for d in x.shape), np.dtype(x.dtype)
    arr = np.asarray(x)
    return arr.shape, arr.dtype


def _layout(tensors: Mapping[str, object]):
    """[(name, array-like, dtype name, shape, nbytes)] in safetensors' on-disk order."""
    items = []
    for name, x in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        shape, dt = _spec(x)
        try:
            dname = dtype_name(dt)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        items.append((name, x, dname, shape, math.prod(shape) * dt.itemsize))
    items.sort(key=lambda t: (-_DTYPE_RANK[t[2]], t[0]))
    return items


def _header_bytes(items, metadata) -> bytes:
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, _, dname, shape, nbytes in items:
        header[name] = {"dtype": dname, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _write_items(f, items, header: bytes) -> None:
    f.write(len(header).to_bytes(8, "little"))
    f.write(header)
    for name, x, _, shape, nbytes in items:
        if not nbytes:
            continue
        arr = _as_numpy(x)  # one tensor on the host at a time
        if arr.shape != shape or arr.nbytes != nbytes:
            raise ValueError(f"tensor {name!r} changed shape while being written")
        f.write(arr.reshape(-1).view(np.uint8).data)
        del arr


def write_safetensors(path, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None) -> Path:
    """Write `tensors` (numpy arrays, jax arrays or LazyArray) to `path` atomically; each is
    brought to the host only while it is written. Returns the path."""
    path = Path(path)
    items = _layout(tensors)
    header = _header_bytes(items, metadata)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        _write_items(f, items, header)
    return path


def serialize(tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes :func:`write_safetensors` would write, in memory (for callers that checksum
    them before writing)."""
    items = _layout(tensors)
    buf = io.BytesIO()
    _write_items(buf, items, _header_bytes(items, metadata))
    return buf.getvalue()


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int,
                groups: Iterable[Iterable[str]] | None = None) -> list[list[str]]:
    """Greedy split of tensor names into shards of at most `max_shard_bytes` (a group larger
    than the limit gets a shard of its own). Names in one group always share a shard."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    grouped, seen = [], set()
    for g in groups or ():
        g = [k for k in g if k in sizes and k not in seen]
        seen.update(g)
        if g:
            grouped.append(g)
    grouped += [[k] for k in sizes if k not in seen]
    shards, cur, cur_size = [], [], 0
    for g in grouped:
        gsize = sum(sizes[k] for k in g)
        if cur and cur_size + gsize > max_shard_bytes:
            shards.append(cur)
            cur, cur_size = [], 0
        cur += g
        cur_size += gsize
    if cur or not shards:
        shards.append(cur)
    return shards


def write_sharded_safetensors(directory, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None,
                              *, max_shard_bytes: int | None = None,
                              groups: Iterable[Iterable[str]] | None = None) -> list[Path]:
    """Write `tensors` into `directory` (which must exist) as ``model.safetensors``, or, when they
    exceed `max_shard_bytes`, as ``model-0000i-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ..}, "weight_map": {..}}``,
    the layout transformers writes). Each file is written atomically. Returns the files written."""
    directory = Path(directory)
    arrays = dict(tensors)
    sizes = {k: math.prod(_spec(a)[0]) * _spec(a)[1].itemsize for k, a in arrays.items()}
    total = sum(sizes.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        return [write_safetensors(directory / SINGLE_FILE, arrays, metadata)]
    plan = plan_shards(sizes, max_shard_bytes, groups)
    n = len(plan)
    written, weight_map = [], {}
    for i, names in enumerate(plan, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        written.append(write_safetensors(directory / fname, {k: arrays[k] for k in names}, metadata))
        weight_map.update({k: fname for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_bytes_atomic(directory / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    written.append(directory / INDEX_FILE)
    return written
