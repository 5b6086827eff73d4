"""Write params (the key scheme of :mod:`interop`) as a checkpoint directory that
transformers + bitsandbytes load, and build the quantization_config that describes them.

The writing side of the bitsandbytes checkpoint code: tensor layout exactly as bitsandbytes'
state_dict (docs/bnb_format.md §3, §5), config.json, sharding and the atomic rename.
"""
from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import numpy as np

from interop.atomic_io import atomic_directory, write_bytes_atomic
from interop.bnb_common import CONFIG_FILE
from interop.safetensors_io import LazyArray, write_sharded_safetensors
from jqlora.quant import Int8Weight, Weight4bit
from jqlora.quant.tables import NESTED_BLOCKSIZE


# ------------------------------------------------------------------------------------------
# saving


def _quantized_tensors(m: str, q) -> dict:
    """The tensors bitsandbytes' state_dict holds for module `m` (docs/bnb_format.md §3, §5)."""
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
    with atomic_directory(target, overwrite=target.exists()) as tmp:  # emptiness/overwrite checked above
        write_bytes_atomic(tmp / CONFIG_FILE, (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        write_sharded_safetensors(tmp, tensors, {"format": "pt"} if metadata is None else metadata,
                                  max_shard_bytes=max_shard_bytes, groups=groups)
    return target
