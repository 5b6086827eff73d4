"""Read and write bitsandbytes-quantized Hugging Face checkpoints without torch.

Key scheme of ``params`` (what load returns and save takes)
-----------------------------------------------------------
* A quantized linear weight is keyed by its **module name**, without ``.weight``:
  ``params["model.layers.0.self_attn.q_proj"]`` is a :class:`jqlora.quant.Weight4bit` or
  :class:`jqlora.quant.Int8Weight` (logical shape (out_features, in_features), y = x @ W.T).
* Every other tensor is keyed by its **full tensor key** and is a jax array in its stored dtype:
  ``"model.embed_tokens.weight"``, ``"model.layers.0.input_layernorm.weight"``,
  ``"model.layers.0.self_attn.q_proj.bias"``, ``"lm_head.weight"`` (unquantized lm_head).
  So a quantized module ``m`` is ``params[m]`` and its bias is ``params[m + ".bias"]``; a dense
  linear is ``params[m + ".weight"]``. The two kinds of keys never collide.

On-disk format (BNB_FORMAT.md §3, §5)
-------------------------------------
4-bit module ``m``: ``m.weight`` (packed codes, uint8 ((n+1)//2, 1), or the same bytes viewed as
the ``bnb_4bit_quant_storage`` dtype), ``m.weight.absmax`` (float32, or uint8 codes when nested),
``m.weight.quant_map`` (float32 (16,)), when nested ``m.weight.nested_absmax`` and
``m.weight.nested_quant_map``, and ``m.weight.quant_state.bitsandbytes__nf4|fp4`` (uint8 bytes of
``json.dumps({"quant_type", "blocksize", "dtype", "shape"[, "nested_blocksize", "nested_dtype",
"nested_offset"]})``). 8-bit module ``m``: ``m.weight`` int8 (out, in), ``m.SCB`` float32 (out,),
``m.weight_format`` uint8 0-d (0 = row; bitsandbytes treats a missing one as row, so do we).

Shape check and transposed weights (DESIGN invariant 4)
-------------------------------------------------------
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

Validation: every malformed, missing or inconsistent piece raises :class:`CheckpointError`
(a ValueError) naming the file and the tensor or key.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from interop.errors import CheckpointError
from interop.safetensors_io import LazyArray, open_checkpoint, write_bytes_atomic, write_sharded_safetensors
from jqlora.quant import Int8Weight, Weight4bit, dequantize
from jqlora.quant.tables import BLOCKSIZES_4BIT, NESTED_BLOCKSIZE, QUANT_TYPES, code_4bit, dynamic_map
from jqlora.quant.weights import STORED_DTYPES

CONFIG_FILE = "config.json"
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
_FOURBIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_QS_PREFIX = "quant_state."
_QS_FIELDS = ("quant_type", "blocksize", "dtype", "shape")
_NESTED_FIELDS = ("nested_blocksize", "nested_dtype", "nested_offset")
_PROJ_RE = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn\.([qkvo])_proj|mlp\.(gate|up|down)_proj)$")


# ------------------------------------------------------------------------------------------
# small helpers

def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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


def read_config(path) -> dict:
    """Parse ``config.json`` of a checkpoint directory (CheckpointError if missing/malformed)."""
    cfg_path = Path(path) / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing (a checkpoint directory needs {CONFIG_FILE})")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: top level is a JSON {type(config).__name__}, expected an object")
    return config


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
    return qc


def expected_linear_shape(config: dict, module: str):
    """(out, in) a Llama-family config implies for `module`, or None when it says nothing."""
    if config.get("model_type") not in LLAMA_FAMILY:
        return None

    def get(name, default=None):
        v = config.get(name, default)
        return int(v) if _is_int(v) and v > 0 else None

    hidden = get("hidden_size")
    if module == "lm_head":
        vocab = get("vocab_size")
        return (vocab, hidden) if vocab and hidden else None
    m = _PROJ_RE.search(module)
    if m is None or hidden is None:
        return None
    heads = get("num_attention_heads")
    kv = get("num_key_value_heads", heads)
    head_dim = get("head_dim") or (hidden // heads if heads and hidden % heads == 0 else None)
    inter = get("intermediate_size")
    attn, mlp = m.group(1), m.group(2)
    shapes = {
        "q": (heads * head_dim, hidden) if heads and head_dim else None,
        "k": (kv * head_dim, hidden) if kv and head_dim else None,
        "v": (kv * head_dim, hidden) if kv and head_dim else None,
        "o": (hidden, heads * head_dim) if heads and head_dim else None,
        "gate": (inter, hidden) if inter else None,
        "up": (inter, hidden) if inter else None,
        "down": (hidden, inter) if inter else None,
    }
    return shapes[attn or mlp]


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


# ------------------------------------------------------------------------------------------
# loading

def _get(ctx, key, *, dtypes=None, shape=None, what=None):
    """Read one tensor (owned numpy copy) with dtype/shape checks that name it."""
    if key not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {key!r}" + (f" ({what})" if what else ""))
    info = ctx.ckpt.info(key)
    if dtypes is not None and info.dtype not in dtypes:
        raise ctx.fail(key, f"dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if shape is not None and info.shape != tuple(shape):
        raise ctx.fail(key, f"shape {list(info.shape)}, expected {list(shape)}" + (f" ({what})" if what else ""))
    return ctx.ckpt.get(key, copy=True)


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
        if not _is_num(off):
            raise ctx.fail(key, f"nested_offset {off!r} is not a finite number")
    return state


def _parse_4bit(ctx, module: str, parts: dict[str, str]) -> dict:
    """Validate the quant_state JSON and which siblings exist; returns the facts _build_4bit needs."""
    wkey = module + ".weight"
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


def _build_4bit(ctx, s: dict, put) -> Weight4bit:
    wkey, bs, n, nb, npacked = s["wkey"], s["bs"], s["n"], s["nb"], s["npacked"]
    if wkey not in ctx.ckpt:
        raise CheckpointError(f"{ctx.ckpt.root}: missing tensor {wkey!r} (packed 4-bit codes of {s['module']!r})")
    info = ctx.ckpt.info(wkey)
    if not (len(info.shape) == 1 or len(info.shape) == 2 and info.shape[1] == 1):
        raise ctx.fail(wkey, f"packed 4-bit weight has shape {list(info.shape)}; bitsandbytes stores a column "
                             "((n + 1) // 2, 1)")
    packed = ctx.ckpt.get(wkey, copy=True).reshape(-1).view(np.uint8)
    if packed.shape[0] != npacked:
        raise ctx.fail(wkey, f"packed length {packed.shape[0]} bytes != (n + 1) // 2 = {npacked} for shape "
                             f"{list(s['shape'])} (n = {n})")
    akey = wkey + ".absmax"
    adtype = "U8" if s["nested"] else "F32"
    absmax = _get(ctx, akey, dtypes=(adtype,))
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
        nabs = _get(ctx, nkey, dtypes=("F32",))
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


def _load_int8(ctx, module: str, parts: dict[str, str], threshold: float, put) -> Int8Weight:
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
    scb = _get(ctx, skey, dtypes=("F32",))
    if scb.shape != (winfo.shape[0],):
        raise ctx.fail(skey, f"SCB shape {list(scb.shape)} != ({winfo.shape[0]},), the rows of {wkey!r} "
                             f"{list(winfo.shape)}")
    cb = ctx.ckpt.get(wkey, copy=True)
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


def load_bnb_checkpoint(path, *, transposed: str = "error", device=None) -> tuple[dict, dict]:
    """Load a (bitsandbytes-quantized or plain) HF checkpoint directory into JAX.

    Returns ``(params, config)``: config is the parsed config.json; params follows the key scheme
    in the module docstring (quantized weights by module name, everything else by full key).
    Tensors are read one at a time and ``jax.device_put`` (to `device`, default: JAX's default
    device) as read; no torch needed. transposed: "error" (default) or "dequantize"; see the
    module docstring. Raises CheckpointError on anything malformed or inconsistent.
    """
    if transposed not in ("error", "dequantize"):
        raise ValueError(f"transposed must be 'error' or 'dequantize', got {transposed!r}")
    path = Path(path)
    config = read_config(path)
    with open_checkpoint(path) as ckpt:
        ctx = _Ctx(ckpt)
        keys = ckpt.keys()
        fourbit, int8 = _classify(keys)
        both = sorted(set(fourbit) & set(int8))
        if both:
            raise ctx.fail(both[0] + ".SCB", f"module {both[0]!r} has both 4-bit and 8-bit tensors")
        if fourbit or int8:
            example = next(iter((fourbit or int8).values()))
            kinds = {"4bit"} if fourbit else set()
            kinds |= {"int8"} if int8 else set()
            qc = _quant_config(config, path, next(iter(example.values())), kinds)
        else:
            qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}

        def put(arr):
            return jax.device_put(arr, device)

        params: dict = {}
        claimed = set()
        for m in sorted(fourbit):
            parts = fourbit[m]
            s = _parse_4bit(ctx, m, parts)
            dense_t = _check_shape(ctx, config, m, s["qs_key"], s["shape"], transposed)
            q = _build_4bit(ctx, s, put)
            if dense_t:
                params[m + ".weight"] = dequantize(q, jnp.dtype(q.stored_dtype)).T
            else:
                params[m] = q
            claimed.update(parts.values())
            claimed.add(m + ".weight")
        threshold = float(qc.get("llm_int8_threshold", 6.0)) if qc else 6.0
        for m in sorted(int8):
            parts = int8[m]
            dense_t = m + ".weight" in ckpt and _check_shape(ctx, config, m, m + ".weight",
                                                             ckpt.info(m + ".weight").shape, transposed)
            q = _load_int8(ctx, m, parts, threshold, put)
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
            params[key] = put(ckpt.get(key, copy=True))
    return params, config


# ------------------------------------------------------------------------------------------
# saving

def _quantized_tensors(m: str, q) -> dict:
    """The tensors bitsandbytes' state_dict holds for module `m` (BNB_FORMAT.md §3, §5)."""
    if isinstance(q, Weight4bit):
        k = m + ".weight"
        n = q.numel
        out = {k: LazyArray(lambda: np.asarray(q.packed).reshape(-1, 1), ((n + 1) // 2, 1), np.uint8),
               k + ".absmax": q.absmax, k + ".quant_map": q.code}
        state = {"quant_type": q.quant_type, "blocksize": q.blocksize, "dtype": q.stored_dtype,
                 "shape": list(q.shape)}
        if q.nested:
            out[k + ".nested_absmax"] = q.nested_absmax
            out[k + ".nested_quant_map"] = q.nested_code
            state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32",
                         nested_offset=float(np.asarray(q.offset, np.float32)))
        out[f"{k}.quant_state.bitsandbytes__{q.quant_type}"] = np.frombuffer(json.dumps(state).encode("utf-8"),
                                                                            np.uint8)
        return out
    return {m + ".weight": q.cb, m + ".SCB": q.scb, m + ".weight_format": np.array(0, np.uint8)}


def _uniform(values, what):
    vals = sorted(set(values), key=str)
    if len(vals) > 1:
        raise ValueError(f"save_bnb_checkpoint: weights disagree on {what} ({vals}); transformers' "
                         "quantization_config holds one value")
    return vals[0] if vals else None


def _most_common(values):
    counts = Counter(values)
    return max(sorted(counts, key=str), key=counts.__getitem__) if counts else None


def build_quantization_config(params: dict, config: dict) -> dict | None:
    """quantization_config (as transformers writes it) describing the quantized weights in
    `params`, or None if there are none. Fields the weights do not determine (compute dtype,
    skip modules, fp32 offload) are kept from config's existing quantization_config when present.
    bnb_4bit_compute_dtype defaults to the weights' stored dtype (transformers: float32).
    4-bit weights may differ in quant_type / double quantization (the config records the most
    common; each weight's quant_state is what bitsandbytes uses); int8 weights must share one
    threshold; 4-bit and 8-bit weights cannot be mixed (ValueError).
    llm_int8_skip_modules: kept if set; else None when the only dense 2-D weights are lm_head and
    embeddings (transformers skips those by default); else the sorted dense linear module names
    plus "lm_head", so transformers does not quantize them on load."""
    q4 = {k: v for k, v in params.items() if isinstance(v, Weight4bit)}
    q8 = {k: v for k, v in params.items() if isinstance(v, Int8Weight)}
    if not q4 and not q8:
        return None
    if q4 and q8:
        raise ValueError("save_bnb_checkpoint: params mix 4-bit and 8-bit weights; transformers loads one kind")
    old = config.get("quantization_config")
    old = old if isinstance(old, dict) and old.get("quant_method") == "bitsandbytes" else {}
    # 4-bit weights may mix quant types / nesting / blocksizes: transformers rebuilds each weight
    # from its own quant_state, so the config just records the most common choice.
    quant_type = _most_common(v.quant_type for v in q4.values()) or old.get("bnb_4bit_quant_type", "fp4")
    nested = _most_common(v.nested for v in q4.values())
    if nested is None:
        nested = bool(old.get("bnb_4bit_use_double_quant", False))
    compute = old.get("bnb_4bit_compute_dtype")
    if compute is None:
        stored = {v.stored_dtype for v in q4.values()}
        compute = stored.pop() if len(stored) == 1 else "float32"
    threshold = _uniform((v.threshold for v in q8.values()), "llm_int8_threshold")
    if threshold is None:
        threshold = old.get("llm_int8_threshold", 6.0)
    skip = old.get("llm_int8_skip_modules")
    if skip is None:
        dense = sorted(k[: -len(".weight")] for k, v in params.items()
                       if k.endswith(".weight") and not isinstance(v, (Weight4bit, Int8Weight))
                       and len(getattr(v, "shape", ())) == 2)
        extra = [m for m in dense if m != "lm_head" and "embed" not in m.rsplit(".", 1)[-1]]
        skip = sorted(set(extra) | {"lm_head"}) if extra else None
    return {
        "_load_in_4bit": bool(q4),
        "_load_in_8bit": bool(q8),
        "bnb_4bit_compute_dtype": compute,
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": bool(nested),
        "llm_int8_enable_fp32_cpu_offload": bool(old.get("llm_int8_enable_fp32_cpu_offload", False)),
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip,
        "llm_int8_threshold": float(threshold),
        "load_in_4bit": bool(q4),
        "load_in_8bit": bool(q8),
        "quant_method": "bitsandbytes",
    }


def _collect_tensors(params: dict):
    tensors: dict = {}
    groups: list[list[str]] = []
    owner: dict[str, str] = {}

    def add(key, value, who):
        if key in tensors:
            raise ValueError(f"save_bnb_checkpoint: tensor key {key!r} produced by both {owner[key]!r} and {who!r}")
        tensors[key] = value
        owner[key] = who

    for name, v in params.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_bnb_checkpoint: invalid params key {name!r}")
        if isinstance(v, (Weight4bit, Int8Weight)):
            if name.endswith(".weight"):
                raise ValueError(f"save_bnb_checkpoint: quantized weights are keyed by module name; got {name!r} "
                                 f"(use {name[: -len('.weight')]!r})")
            v.validate(name)
            part = _quantized_tensors(name, v)
            for k, t in part.items():
                add(k, t, name)
            groups.append(list(part))
        elif hasattr(v, "shape") and hasattr(v, "dtype"):
            add(name, v, name)
        else:
            raise TypeError(f"save_bnb_checkpoint: params[{name!r}] is a {type(v).__name__}; expected Weight4bit, "
                            "Int8Weight or an array")
    return tensors, groups


def save_bnb_checkpoint(path, params: dict, config: dict, *, max_shard_bytes: int | None = None,
                        overwrite: bool = False, metadata: dict | None = None) -> Path:
    """Write `params` (the load_bnb_checkpoint key scheme) and `config` as a checkpoint directory
    that transformers + bitsandbytes load: config.json (its quantization_config rebuilt from the
    weights, see :func:`build_quantization_config`; removed when nothing is quantized) and
    model.safetensors, or shards + model.safetensors.index.json when larger than
    `max_shard_bytes` (a module's tensors always share a shard). Tensor keys, dtypes, shapes and
    the quant_state JSON bytes are exactly what bitsandbytes writes; safetensors metadata defaults
    to {"format": "pt"} like transformers.

    The directory is built under a temporary name next to `path` and renamed into place; on any
    failure nothing is left behind. An existing non-empty `path` is an error unless `overwrite`,
    in which case it is replaced as a whole (other files in it are not kept).
    """
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        if any(target.iterdir()) and not overwrite:
            raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True to replace it")
    tensors, groups = _collect_tensors(params)
    cfg = copy.deepcopy(dict(config))
    qc = build_quantization_config(params, cfg)
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        write_bytes_atomic(tmp / CONFIG_FILE, (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        write_sharded_safetensors(tmp, tensors, {"format": "pt"} if metadata is None else metadata,
                                  max_shard_bytes=max_shard_bytes, groups=groups)
        if target.exists():
            old = parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
