"""Load and validate bitsandbytes-quantized (or plain) Hugging Face checkpoints into JAX.

The reading side of the bitsandbytes checkpoint code: every check a checkpoint on disk must pass
before it becomes ``params`` (key scheme: see :mod:`interop`).

On-disk format (docs/bnb_format.md §3, §5)
------------------------------------------
4-bit module ``m``: ``m.weight`` (packed codes, uint8 ((n+1)//2, 1), or the same bytes viewed as
the ``bnb_4bit_quant_storage`` dtype), ``m.weight.absmax`` (float32, or uint8 codes when nested),
``m.weight.quant_map`` (float32 (16,)), when nested ``m.weight.nested_absmax`` and
``m.weight.nested_quant_map``, and ``m.weight.quant_state.bitsandbytes__nf4|fp4`` (uint8 bytes of
``json.dumps({"quant_type", "blocksize", "dtype", "shape"[, "nested_blocksize", "nested_dtype",
"nested_offset"]})``). 8-bit module ``m``: ``m.weight`` int8 (out, in), ``m.SCB`` float32 (out,),
``m.weight_format`` uint8 0-d (0 = row; bitsandbytes treats a missing one as row, so do we).

Shape check and transposed weights (docs/design.md, invariant 4)
----------------------------------------------------------------
For Llama-family configs (model_type in :data:`LLAMA_FAMILY`) the recorded logical shape of every
quantized ``layers.N.self_attn.{q,k,v,o}_proj`` / ``layers.N.mlp.{gate,up,down}_proj`` and of
``lm_head`` is checked against (out, in) derived from hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads (default: heads), head_dim (default: hidden/heads) and
vocab_size. Other architectures are not checked.

A weight recorded as the transpose (in, out) of the expected shape was quantized transposed: its
4-bit blocks run over the other axis, so no relabelling of bytes can fix it, and re-quantizing
would be lossy. ``load_bnb_checkpoint(..., transposed="error")`` (the default) raises a
CheckpointError naming the tensor, the recorded shape and the expected shape.
``transposed="dequantize"`` instead dequantizes it exactly as bitsandbytes does (4-bit: in its
stored dtype; 8-bit: float32), transposes it to (out, in) and returns it as a *dense* array under
``m + ".weight"`` (the dense-linear key), with a warning. A square weight cannot be told apart
and is taken as (out, in), as bitsandbytes does. A recorded shape that is neither is always an
error.

Mixed checkpoints (unsloth's dynamic 4-bit): ``llm_int8_skip_modules`` in quantization_config
lists linear layers left unquantized (all of them, or e.g. one layer's ``mlp.down_proj``); they
are stored as plain ``m.weight`` and load as dense arrays. Each linear is loaded as it is
stored. For Llama-family configs, a linear stored dense that the list does not cover, or stored
quantized that it does cover, gets a warning naming the modules: transformers cannot load such a
folder (it builds the layer from the list, not from the tensors), so a cross-check against it
fails. The list must be a list of strings (CheckpointError otherwise).

Validation: every malformed, missing or inconsistent piece raises :class:`CheckpointError`
(a ValueError) naming the file and the tensor or key.

Values (docs/bnb_format.md §3.1): every float scale must be finite with its sign bit clear
(4-bit ``absmax``, or ``nested_absmax`` when nested; int8 ``SCB``: each is a max |w|), and every
unquantized floating tensor must be finite. One NaN scale makes a whole block (or row) of the
weight NaN, and one NaN weight makes every logit NaN downstream, so this is checked at load,
where the tensor can still be named: one fused reduction per tensor on the device it was put on,
queued asynchronously and fetched once at the end (a few bytes back to the host, never a host
copy of the model); a tensor staged on the host (``device="stage"``) is checked there. An
unquantized ``.weight`` / ``.bias`` must have a floating dtype.

Staging (``device="stage"``): a transfer to a GPU costs milliseconds of latency per call, and a
checkpoint holds hundreds of small tensors (a 4-bit weight alone is six), so placing each as it is
read takes seconds. Staged, the quantized weights' parts and every tensor under ``STAGE_MAX``
elements stay numpy arrays (read-only views of the files, checked on the host) for the caller to
stack and transfer in bulk; larger floating tensors (embeddings, dense weights) still go to the
default device as read, where they are checked and may be quantized.
"""
from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from interop.bnb_common import (CONFIG_FILE, _is_int, _is_num, expected_linear_shape, is_skipped, read_config,
                                skip_patterns)
from interop.errors import CheckpointError
from interop.experts import split_fused_4bit
from interop.safetensors_io import open_checkpoint
from jqlora.quant import Int8Weight, Weight4bit, dequantize
from jqlora.quant.tables import BLOCKSIZES_4BIT, NESTED_BLOCKSIZE, QUANT_TYPES, code_4bit, dynamic_map
from jqlora.quant.weights import STORED_DTYPES

WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
_FOURBIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_QS_PREFIX = "quant_state."
_QS_FIELDS = ("quant_type", "blocksize", "dtype", "shape")
_NESTED_FIELDS = ("nested_blocksize", "nested_dtype", "nested_offset")


# ------------------------------------------------------------------------------------------
# small helpers


class _Ctx:
    """Where we are: builds errors that name the file and the tensor."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def fail(self, key: str, msg: str) -> CheckpointError:
        try:
            where = self.ckpt.file_of(key)
        except CheckpointError:
            where = self.ckpt.root
        return CheckpointError(f"{where}: tensor {key!r}: {msg}")


def _flag(qc: dict, name: str):
    v = qc.get(name, qc.get("_" + name))
    return v if isinstance(v, bool) else None


def _quant_config(config: dict, path: Path, example_key: str, kinds: set[str]) -> dict:
    cfg_path = path / CONFIG_FILE
    qc = config.get("quantization_config")
    if qc is None:
        raise CheckpointError(f"{cfg_path}: no quantization_config, but the checkpoint holds bitsandbytes-quantized "
                              f"tensors (e.g. {example_key!r})")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: quantization_config is a {type(qc).__name__}, expected an object")
    method = qc.get("quant_method")
    if method != "bitsandbytes":
        raise CheckpointError(f"{cfg_path}: quantization_config.quant_method is {method!r}, expected 'bitsandbytes' "
                              f"(the checkpoint holds bitsandbytes tensors, e.g. {example_key!r})")
    if "4bit" in kinds and _flag(qc, "load_in_4bit") is False and _flag(qc, "load_in_8bit") is True:
        raise CheckpointError(f"{cfg_path}: quantization_config says load_in_8bit but the checkpoint holds 4-bit "
                              f"tensors (e.g. {example_key!r})")
    if "int8" in kinds and _flag(qc, "load_in_8bit") is False and _flag(qc, "load_in_4bit") is True:
        raise CheckpointError(f"{cfg_path}: quantization_config says load_in_4bit but the checkpoint holds 8-bit "
                              f"tensors (e.g. {example_key!r})")
    thr = qc.get("llm_int8_threshold", 6.0)
    if not _is_num(thr):
        raise CheckpointError(f"{cfg_path}: quantization_config.llm_int8_threshold is {thr!r}, expected a number")
    skip_patterns(cfg_path, qc)  # a malformed list fails here, before any tensor is read
    return qc


def _check_shape(ctx, config, module, key, recorded, transposed) -> bool:
    """True if the weight is stored transposed and should be dequantized (transposed='dequantize')."""
    expected = expected_linear_shape(config, module)
    recorded = tuple(recorded)
    if expected is None or recorded == expected:
        return False
    if recorded == expected[::-1]:
        if transposed == "dequantize":
            warnings.warn(f"{module}: quantized transposed (recorded shape {recorded}, expected {expected}); "
                          "loading it dequantized and transposed as a dense weight", stacklevel=3)
            return True
        raise ctx.fail(key, f"recorded shape {list(recorded)} is the transpose of the expected (out, in) shape "
                            f"{list(expected)} for {module!r}: the weight was quantized transposed (blocks run "
                            "along the wrong axis, so it cannot be relabelled). Re-quantize it from the (out, in) "
                            "weight, or load with transposed='dequantize' to get it as a dense weight.")
    raise ctx.fail(key, f"recorded shape {list(recorded)} does not match the expected (out, in) shape "
                        f"{list(expected)} for {module!r} (from config.json), nor its transpose")


def _check_skip_list(path: Path, config: dict, qc: dict, quantized, dense) -> None:
    """Warn where llm_int8_skip_modules disagrees with how the linear layers are stored (module
    docstring). `quantized`, `dense`: module names of the linears stored each way."""
    patterns = skip_patterns(path / CONFIG_FILE, qc)
    unlisted = sorted(m for m in dense if expected_linear_shape(config, m) and not is_skipped(m, patterns))
    listed = sorted(m for m in quantized if expected_linear_shape(config, m) and is_skipped(m, patterns))
    where = f"{path / CONFIG_FILE}: quantization_config.llm_int8_skip_modules {list(patterns)}"
    if unlisted:
        warnings.warn(f"{where} does not cover {len(unlisted)} linear layer(s) stored unquantized: "
                      f"{_some(unlisted)}. jqlora uses them dense, as stored; transformers would make them "
                      "bitsandbytes layers and cannot load this folder. List them in llm_int8_skip_modules.",
                      stacklevel=3)
    if listed:
        warnings.warn(f"{where} covers {len(listed)} linear layer(s) stored quantized: {_some(listed)}. jqlora "
                      "uses them quantized, as stored; transformers would make them plain linear layers and "
                      "cannot load this folder. Remove them from llm_int8_skip_modules.", stacklevel=3)


def _some(names, n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ------------------------------------------------------------------------------------------
# value checks (NaN / Inf / negative scales)


STAGE_MAX = 1 << 20  # elements: a floating tensor this large goes to the device even when staging


def _host_value_flags(x: np.ndarray, scale: bool) -> tuple[bool, bool]:
    """`_value_flags` of a host array (staged tensors are small or scales: cheap in numpy)."""
    x = np.asarray(x, np.float32)
    return bool(np.isfinite(x).all()), not (scale and bool(np.signbit(x).any()))


@functools.partial(jax.jit, static_argnames="scale")
def _value_flags(x, scale: bool):
    """[all finite, no sign bit set (scales only; True otherwise)] of `x`: one fused pass on its
    device. The sign bit, not `x >= 0`: XLA on CPU flushes subnormals to zero, so a negative
    subnormal would compare as >= 0 there."""
    finite = jnp.all(jnp.isfinite(x))
    return jnp.stack([finite, ~jnp.any(jnp.signbit(x)) if scale else jnp.array(True)])


class _ValueChecks:
    """Queues `_value_flags` per tensor as it is loaded; `raise_first` fetches every flag in one
    transfer and raises a CheckpointError naming the first bad tensor and element."""

    def __init__(self, ctx, enabled: bool):
        self.ctx = ctx
        self.enabled = enabled
        self.pending: list = []

    def add(self, key: str, arr, *, scale: bool, what: str):
        if self.enabled and jnp.issubdtype(arr.dtype, jnp.floating):
            flags = _host_value_flags(arr, scale) if isinstance(arr, np.ndarray) else _value_flags(arr, scale=scale)
            self.pending.append((key, arr, scale, what, flags))

    def raise_first(self):
        flags = jax.device_get([p[-1] for p in self.pending])
        for (key, arr, scale, what, _), (finite, nonneg) in zip(self.pending, flags):
            if finite and nonneg:
                continue
            host = np.asarray(jax.device_get(arr)).astype(np.float64).reshape(-1)  # the bad tensor only
            if not finite:
                i = int(np.flatnonzero(~np.isfinite(host))[0])
                raise self.ctx.fail(key, f"{what} holds NaN or Inf (element {i} of {host.size} is {host[i]}); "
                                         "the checkpoint is corrupt")
            i = int(np.flatnonzero(np.signbit(host))[0])
            raise self.ctx.fail(key, f"{what} holds a negative value (element {i} is {host[i]:.6g}); a scale "
                                     "is a max |w| and cannot be negative: the checkpoint is corrupt")


# ------------------------------------------------------------------------------------------
# loading


def _get(ctx, key, *, dtypes=None, shape=None, what=None, copy=True):
    """Read one tensor (an owned numpy copy, or with copy=False a read-only view of the file) with
    dtype/shape checks that name it."""
    if key not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {key!r}" + (f" ({what})" if what else ""))
    info = ctx.ckpt.info(key)
    if dtypes is not None and info.dtype not in dtypes:
        raise ctx.fail(key, f"dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if shape is not None and info.shape != tuple(shape):
        raise ctx.fail(key, f"shape {list(info.shape)}, expected {list(shape)}" + (f" ({what})" if what else ""))
    return ctx.ckpt.get(key, copy=copy)


def _parse_quant_state(ctx, key: str, qt_from_key: str) -> dict:
    raw = _get(ctx, key, dtypes=("U8",))
    if raw.ndim != 1:
        raise ctx.fail(key, f"shape {list(raw.shape)}, expected a 1-D uint8 tensor of JSON bytes")
    try:
        state = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ctx.fail(key, f"quant_state is not valid UTF-8 JSON ({e})") from e
    if not isinstance(state, dict):
        raise ctx.fail(key, f"quant_state JSON is a {type(state).__name__}, expected an object")
    unknown = sorted(set(state) - set(_QS_FIELDS) - set(_NESTED_FIELDS))
    if unknown:
        raise ctx.fail(key, f"quant_state has unknown fields {unknown}")
    missing = [f for f in _QS_FIELDS if f not in state]
    if missing:
        raise ctx.fail(key, f"quant_state is missing fields {missing}")
    qt, bs, dt, shape = (state[f] for f in _QS_FIELDS)
    if not isinstance(qt, str) or qt not in QUANT_TYPES:
        raise ctx.fail(key, f"unknown quant_type {qt!r}; expected one of {list(QUANT_TYPES)}")
    if qt != qt_from_key:
        raise ctx.fail(key, f"quant_type {qt!r} in the JSON contradicts the key suffix bitsandbytes__{qt_from_key}")
    if not _is_int(bs):
        raise ctx.fail(key, f"blocksize {bs!r} is not an integer")
    if bs not in BLOCKSIZES_4BIT:
        raise ctx.fail(key, f"blocksize {bs} not allowed; expected one of {list(BLOCKSIZES_4BIT)}")
    if not isinstance(dt, str) or dt not in STORED_DTYPES:
        raise ctx.fail(key, f"dtype {dt!r}; expected one of {list(STORED_DTYPES)}")
    if not isinstance(shape, list) or not shape or not all(_is_int(d) and d > 0 for d in shape):
        raise ctx.fail(key, f"shape {shape!r} is not a non-empty list of positive integers")
    present = [f for f in _NESTED_FIELDS if f in state]
    if present:
        if len(present) != len(_NESTED_FIELDS):
            raise ctx.fail(key, f"nested quant_state fields partially present: has {present}, missing "
                                f"{[f for f in _NESTED_FIELDS if f not in state]}")
        nbs, ndt, off = (state[f] for f in _NESTED_FIELDS)
        if not _is_int(nbs) or nbs != NESTED_BLOCKSIZE:
            raise ctx.fail(key, f"nested_blocksize {nbs!r}; only {NESTED_BLOCKSIZE} is supported (as in bitsandbytes)")
        if ndt != "float32":
            raise ctx.fail(key, f"nested_dtype {ndt!r}; expected 'float32'")
        if not _is_num(off) or abs(off) > float(np.finfo(np.float32).max):
            raise ctx.fail(key, f"nested_offset {off!r} is not a finite float32 number")
    return state


def _parse_4bit(ctx, module: str, parts: dict[str, str], wkey: str | None = None) -> dict:
    """Validate the quant_state JSON and which siblings exist; returns the facts _build_4bit needs.
    wkey: the packed codes' key (default ``module.weight``; a fused expert parameter's own name)."""
    wkey = module + ".weight" if wkey is None else wkey
    qs_parts = [p for p in parts if p.startswith(_QS_PREFIX)]
    if not qs_parts:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {wkey + '.quant_state.bitsandbytes__<nf4|fp4>'!r} "
                              f"(4-bit siblings {sorted(parts.values())} are present)")
    if len(qs_parts) > 1:
        raise ctx.fail(parts[qs_parts[0]], f"more than one quant_state tensor for {module!r}: "
                                           f"{sorted(parts[p] for p in qs_parts)}")
    qs_key = parts[qs_parts[0]]
    suffix = qs_parts[0][len(_QS_PREFIX):]
    if not suffix.startswith("bitsandbytes__"):
        raise ctx.fail(qs_key, "unknown quant_state key; expected quant_state.bitsandbytes__nf4 or __fp4")
    qt_from_key = suffix[len("bitsandbytes__"):]
    if qt_from_key not in QUANT_TYPES:
        raise ctx.fail(qs_key, f"unknown quant_type {qt_from_key!r} in the key; expected one of {list(QUANT_TYPES)}")
    state = _parse_quant_state(ctx, qs_key, qt_from_key)
    qt, bs, stored, shape = state["quant_type"], state["blocksize"], state["dtype"], tuple(state["shape"])
    nested_fields = "nested_blocksize" in state
    nested_tensors = [p for p in ("nested_absmax", "nested_quant_map") if p in parts]
    if (nested_tensors and not nested_fields) or (nested_fields and len(nested_tensors) != 2):
        have = sorted([parts[p] for p in nested_tensors] + [f"{qs_key}:{f}" for f in _NESTED_FIELDS if f in state])
        need = sorted([f"{wkey}.{p}" for p in ("nested_absmax", "nested_quant_map") if p not in parts]
                      + [f"{qs_key}:{f}" for f in _NESTED_FIELDS if f not in state])
        raise ctx.fail(qs_key, f"nested (double) quantization partially present for {module!r}: has {have}, "
                               f"missing {need}")
    nested = nested_fields
    for p in ("absmax", "quant_map"):
        if p not in parts:
            raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {wkey + '.' + p!r} (4-bit module {module!r})")
    n = math.prod(shape)
    nb = -(-n // bs)
    npacked = (n + 1) // 2
    return dict(module=module, wkey=wkey, qs_key=qs_key, qt=qt, bs=bs, stored=stored, shape=shape,
                nested=nested, n=n, nb=nb, npacked=npacked, state=state)


def _build_4bit(ctx, s: dict, put, copy: bool = True) -> Weight4bit:
    wkey, bs, n, nb, npacked = s["wkey"], s["bs"], s["n"], s["nb"], s["npacked"]
    if wkey not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {wkey!r} (packed 4-bit codes of {s['module']!r})")
    info = ctx.ckpt.info(wkey)
    if not (len(info.shape) == 1 or len(info.shape) == 2 and info.shape[1] == 1):
        raise ctx.fail(wkey, f"packed 4-bit weight has shape {list(info.shape)}; bitsandbytes stores a column "
                             "((n + 1) // 2, 1)")
    packed = ctx.ckpt.get(wkey, copy=copy).reshape(-1).view(np.uint8)
    if packed.shape[0] != npacked:
        raise ctx.fail(wkey, f"packed length {packed.shape[0]} bytes != (n + 1) // 2 = {npacked} for shape "
                             f"{list(s['shape'])} (n = {n})")
    akey = wkey + ".absmax"
    adtype = "U8" if s["nested"] else "F32"
    absmax = _get(ctx, akey, dtypes=(adtype,), copy=copy)
    if absmax.shape != (nb,):
        raise ctx.fail(akey, f"absmax length {list(absmax.shape)} != ceil(n / blocksize) = ceil({n} / {bs}) = {nb}")
    qkey = wkey + ".quant_map"
    qmap = _get(ctx, qkey, dtypes=("F32",), shape=(16,))
    if not np.array_equal(qmap, code_4bit(s["qt"])):
        raise ctx.fail(qkey, f"quant_map differs from the standard {s['qt']} table")
    kw = {}
    if s["nested"]:
        ng = -(-nb // NESTED_BLOCKSIZE)
        nkey, nmkey = wkey + ".nested_absmax", wkey + ".nested_quant_map"
        nabs = _get(ctx, nkey, dtypes=("F32",), copy=copy)
        if nabs.shape != (ng,):
            raise ctx.fail(nkey, f"nested_absmax length {list(nabs.shape)} != ceil(nblocks / 256) = {ng}")
        nmap = _get(ctx, nmkey, dtypes=("F32",), shape=(256,))
        if not np.array_equal(nmap, dynamic_map()):
            raise ctx.fail(nmkey, "nested_quant_map differs from bitsandbytes' 8-bit dynamic map")
        state = s["state"]
        kw = dict(nested_absmax=put(nabs), nested_code=put(nmap),
                  offset=put(np.asarray(state["nested_offset"], np.float32)))
    q = Weight4bit(packed=put(packed), absmax=put(absmax), code=put(qmap), shape=s["shape"], quant_type=s["qt"],
                   blocksize=bs, stored_dtype=s["stored"], **kw)
    try:
        return q.validate(s["module"])
    except ValueError as e:
        raise ctx.fail(wkey, str(e)) from e


def _load_int8(ctx, module: str, parts: dict[str, str], threshold: float, put, copy: bool = True) -> Int8Weight:
    wkey, skey, fkey = module + ".weight", module + ".SCB", module + ".weight_format"
    if wkey not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {wkey!r} (int8 weight of {module!r}; "
                              f"siblings {sorted(parts.values())} are present)")
    if skey not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {skey!r} (row scales of the int8 weight {wkey!r})")
    if fkey in ctx.ckpt:
        info = ctx.ckpt.info(fkey)
        if info.dtype not in ("U8", "I8", "I16", "I32", "I64", "U16", "U32", "U64") or math.prod(info.shape) != 1:
            raise ctx.fail(fkey, f"weight_format must be one integer, got {info.dtype} {list(info.shape)}")
        fmt = int(ctx.ckpt.get(fkey).reshape(-1)[0])
        if fmt != 0:
            name = WEIGHT_FORMATS.get(fmt, "unknown")
            raise ctx.fail(fkey, f"weight_format {fmt} ({name}) is not supported; only 0 (row-major) is")
    winfo = ctx.ckpt.info(wkey)
    if winfo.dtype != "I8" or len(winfo.shape) != 2:
        raise ctx.fail(wkey, f"8-bit weight is {winfo.dtype} {list(winfo.shape)}, expected int8 (out, in)")
    scb = _get(ctx, skey, dtypes=("F32",), copy=copy)
    if scb.shape != (winfo.shape[0],):
        raise ctx.fail(skey, f"SCB shape {list(scb.shape)} != ({winfo.shape[0]},), the rows of {wkey!r} "
                             f"{list(winfo.shape)}")
    cb = ctx.ckpt.get(wkey, copy=copy)
    q = Int8Weight(cb=put(cb), scb=put(scb), threshold=float(threshold))
    try:
        return q.validate(module)
    except ValueError as e:
        raise ctx.fail(wkey, str(e)) from e


def _classify(keys):
    """Split tensor keys into 4-bit module parts, int8 module parts and the rest."""
    fourbit: dict[str, dict[str, str]] = {}
    int8: dict[str, dict[str, str]] = {}
    for key in keys:
        if ".weight." in key or key.startswith("weight."):
            m, _, rest = key.rpartition(".weight.") if ".weight." in key else ("", "", key[len("weight."):])
            if rest in _FOURBIT_PARTS or rest.startswith(_QS_PREFIX):
                fourbit.setdefault(m, {})[rest] = key
                continue
        for suffix, part in ((".SCB", "SCB"), (".weight_format", "weight_format")):
            if key.endswith(suffix):
                int8.setdefault(key[: -len(suffix)], {})[part] = key
                break
    return fourbit, int8


def load_bnb_checkpoint(path, *, transposed: str = "error", device=None,
                        check_values: bool = True, config: dict | None = None) -> tuple[dict, dict]:
    """Load a (bitsandbytes-quantized or plain) HF checkpoint directory into JAX.

    Tensors are read one at a time and ``jax.device_put`` as read (or staged on the host); no torch
    needed.

    Args:
      path: the checkpoint directory (config.json + model.safetensors or a sharded index).
      transposed: "error" (default) or "dequantize"; see the module docstring.
      device: where the arrays go (default: JAX's default device), a callable
        ``put(numpy array) -> jax.Array`` that places each tensor as it is read, or ``"stage"``:
        quantized weights' parts and tensors under ``STAGE_MAX`` elements stay numpy arrays
        (module docstring, staging) for the caller to transfer in bulk.
      check_values: check that scales are finite and not negative and unquantized floating
        tensors finite (module docstring); False skips it (only to measure what it costs).
      config: the checkpoint's config.json as the caller already parsed it (``read_config(path)``:
        `jqlora.models.load_causal_lm` passes its own, so that the file is parsed once); None
        reads the file, as it is (``read_config(path, unwrap=False)``).

    Returns:
      ``(params, config)``: config is the parsed config.json (`config` when given); params follows
      the key scheme in the module docstring (quantized weights by module name, everything else by
      full key).

    Raises:
      CheckpointError: anything malformed or inconsistent, or a NaN/Inf (or negative scale)
        where the checks above forbid it; the message names the file and the tensor.
    """
    if transposed not in ("error", "dequantize"):
        raise ValueError(f"transposed must be 'error' or 'dequantize', got {transposed!r}")
    path = Path(path)
    if config is None:
        config = read_config(path, unwrap=False)
    with open_checkpoint(path) as ckpt:
        ctx = _Ctx(ckpt)
        keys = ckpt.keys()
        fourbit, int8 = _classify(keys)
        fused = split_fused_4bit(keys)  # mixture-of-experts parameters quantized whole (interop.experts)
        both = sorted(set(fourbit) & set(int8))
        if both:
            raise ctx.fail(both[0] + ".SCB", f"module {both[0]!r} has both 4-bit and 8-bit tensors")
        if fourbit or int8 or fused:
            example = next(iter((fourbit or int8 or fused).values()))
            kinds = {"4bit"} if fourbit or fused else set()
            kinds |= {"int8"} if int8 else set()
            qc = _quant_config(config, path, next(iter(example.values())), kinds)
        else:
            qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
            method = qc.get("quant_method")
            if method not in (None, "bitsandbytes"):  # e.g. GPTQ/AWQ: their tensors would be misread
                raise CheckpointError(
                    f"{path / 'config.json'}: quantization_config.quant_method is {method!r}; jqlora reads "
                    f"bitsandbytes-quantized or unquantized checkpoints only")

        staging = isinstance(device, str) and device == "stage"

        def put(arr):  # a callable device places each tensor itself (e.g. onto its shards)
            return device(arr) if callable(device) else jax.device_put(arr, None if staging else device)

        def put_quantized(arr):  # a part of a quantized weight: staged as it is
            return arr if staging else put(arr)

        def put_tensor(key):  # an unquantized tensor: staged unless a large floating one
            info = ckpt.info(key)
            if staging and (math.prod(info.shape) < STAGE_MAX or not jnp.issubdtype(info.np_dtype, jnp.floating)):
                return ckpt.get(key)
            return put(ckpt.get(key, copy=True))

        params: dict = {}
        claimed = set()
        checks = _ValueChecks(ctx, check_values)
        for m in sorted(fourbit):
            parts = fourbit[m]
            s = _parse_4bit(ctx, m, parts)
            dense_t = _check_shape(ctx, config, m, s["qs_key"], s["shape"], transposed)
            q = _build_4bit(ctx, s, put_quantized, copy=not staging)
            if s["nested"]:
                checks.add(s["wkey"] + ".nested_absmax", q.nested_absmax, scale=True, what="nested_absmax")
            else:
                checks.add(s["wkey"] + ".absmax", q.absmax, scale=True, what="absmax (4-bit block scales)")
            if dense_t:
                params[m + ".weight"] = dequantize(q, jnp.dtype(q.stored_dtype)).T
            else:
                params[m] = q
            claimed.update(parts.values())
            claimed.add(m + ".weight")
        for p in sorted(fused):
            parts = {k: v for k, v in fused[p].items() if k}
            s = _parse_4bit(ctx, p, parts, wkey=p)
            q = _build_4bit(ctx, s, put_quantized, copy=not staging)
            what = "nested_absmax" if s["nested"] else "absmax (4-bit block scales)"
            checks.add(p + (".nested_absmax" if s["nested"] else ".absmax"),
                       q.nested_absmax if s["nested"] else q.absmax, scale=True, what=what)
            params[p] = q
            claimed.update(fused[p].values())
            claimed.add(p)
        threshold = float(qc.get("llm_int8_threshold", 6.0)) if qc else 6.0
        for m in sorted(int8):
            parts = int8[m]
            dense_t = m + ".weight" in ckpt and _check_shape(ctx, config, m, m + ".weight",
                                                             ckpt.info(m + ".weight").shape, transposed)
            q = _load_int8(ctx, m, parts, threshold, put_quantized, copy=not staging)
            checks.add(m + ".SCB", q.scb, scale=True, what="SCB (int8 row scales)")
            if dense_t:
                params[m + ".weight"] = dequantize(q, jnp.float32).T
            else:
                params[m] = q
            claimed.update(parts.values())
            claimed.add(m + ".weight")
        for key in sorted(k for k in keys if k not in claimed):
            info = ckpt.info(key)
            if key.endswith(".weight") and qc:
                if info.dtype == "I8" and len(info.shape) == 2 and _flag(qc, "load_in_8bit"):
                    raise ctx.fail(key, f"int8 weight without its sibling {key[:-len('.weight')] + '.SCB'!r}")
                if (info.dtype == "U8" and len(info.shape) == 2 and info.shape[1] == 1
                        and _flag(qc, "load_in_4bit")):
                    raise ctx.fail(key, "looks like packed 4-bit codes but has no quant_state / absmax / quant_map "
                                        "siblings")
            if key.endswith((".weight", ".bias")) and not jnp.issubdtype(info.np_dtype, jnp.floating):
                raise ctx.fail(key, f"dtype {info.dtype}: an unquantized weight or bias must be floating point "
                                    "(F16, BF16, F32, F64)")
            params[key] = put_tensor(key)
            checks.add(key, params[key], scale=False, what="unquantized tensor")
        checks.raise_first()
        if fourbit or int8:
            dense = [k[: -len(".weight")] for k in keys if k not in claimed and k.endswith(".weight")
                     and len(ckpt.info(k).shape) == 2]
            _check_skip_list(path, config, qc, set(fourbit) | set(int8), dense)
    return params, config
