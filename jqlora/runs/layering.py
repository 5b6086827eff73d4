"""One layer of a run's settings (a config file, a run record, flags) as a flat {key: value}, and the
rules that merge layers: a pair of settings that replace each other, and what a resumed run must
keep. `RunSettings.layered` applies them."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from jqlora.runs.config_file import RunError
from jqlora.runs.flags import flag_name, parse_flag, train_field_types
from jqlora.runs.parts import LORA_KEYS, MODEL_KEYS, OUTPUT_KEYS, LoraSettings

_TOP_KEYS = MODEL_KEYS + OUTPUT_KEYS  # the keys of a config file's top level besides TrainConfig's
_RECORD_ONLY = ("format", "version", "skipped_batches")  # what a run record adds
# `jqlora train`'s defaults where they differ from the dataclasses'
CLI_DEFAULTS = {"attention": "auto", "remat": "auto"}
# pairs of settings where one replaces the other: a layer of settings gives at most one of each
EITHER_OR = (("epochs", "steps"), ("warmup_ratio", "warmup"))
# what a resumed run must keep: the base, its numerics, the optimizer (whose state the checkpoint
# holds) and the shape of the LoRA being trained
RESUME_FIXED = ("model", "compute_dtype", "quantize", "quantize_experts", "base_matmul", "optimizer")
# what a record (or a run's settings) that leaves a RESUME_FIXED key out means
_RECORD_DEFAULTS = {"quantize_experts": "auto", "base_matmul": "compute", "optimizer": "adamw"}
RESUME_FIXED_LORA = ("rank", "alpha", "target_modules", "use_rslora")


def _targets(v, *, record: bool):
    """`target_modules` as LoraConfig takes it. In flags and config files a string is
    comma-separated names, "all-linear", or "re:<regex>"; in a run record a string is what
    LoraConfig holds (a regex, or "all-linear"), "re:" allowed."""
    if v is None:
        return None
    if isinstance(v, str):
        if v.startswith("re:"):
            return v[3:]
        if record:
            return v
        if v.strip() == "all-linear":
            return "all-linear"
        return tuple(s.strip() for s in v.split(",") if s.strip())
    return tuple(v)


def layer_from_file(data: Mapping, where: str, *, record: bool = False) -> dict:
    """A config file's or run record's settings as one flat layer {key: value} (the keys of
    ModelSettings, LoraSettings, OutputSettings and TrainConfig are distinct).

    Raises:
      RunError: an unknown key, or a `lora`/`train` entry that is not a table.
    """
    fields = train_field_types()
    out = {}
    for k, v in data.items():
        if k in _TOP_KEYS:
            out[k] = v
        elif k == "lora":
            if not isinstance(v, dict):
                raise RunError(f"{where}: 'lora' must be a table/object")
            for lk, lv in v.items():
                if lk not in LORA_KEYS:
                    raise RunError(f"{where}: unknown key lora.{lk}; expected one of {', '.join(LORA_KEYS)}")
                out[lk] = lv
        elif k == "train":
            if not isinstance(v, dict):
                raise RunError(f"{where}: 'train' must be a table/object")
            for tk, tv in v.items():
                if tk not in fields:
                    raise RunError(f"{where}: unknown key train.{tk}; expected a TrainConfig field")
                out[tk] = tv
        elif k in fields:
            out[k] = v
        elif k in _RECORD_ONLY:
            continue
        else:
            raise RunError(f"{where}: unknown key {k!r}; expected {', '.join(_TOP_KEYS)}, 'lora', 'train' "
                           "or a TrainConfig field")
    if "target_modules" in out:
        out["target_modules"] = _targets(out["target_modules"], record=record)
    return out


def layer_from_flags(flags: Mapping) -> dict:
    """Flags as one flat layer: a TrainConfig field's text is parsed by its type (`parse_flag`),
    `target_modules` as in a config file; other values are taken as they are.

    Raises:
      RunError: a text a field cannot take, both of a pair in EITHER_OR, or an unknown key.
    """
    fields = train_field_types()
    out = {}
    for k, v in flags.items():
        if k in fields:
            out[k] = parse_flag(k, v) if isinstance(v, str) else v
        elif k in _TOP_KEYS or k in LORA_KEYS:
            out[k] = v
        else:
            raise RunError(f"unknown setting {k!r}")
    if "target_modules" in out:
        out["target_modules"] = _targets(out["target_modules"], record=False)
    refuse_both(out, flag_name)
    return out


def refuse_both(layer: dict, name) -> None:
    """One layer of settings (flags, a config file) may not give both of a pair in EITHER_OR."""
    for a, b in EITHER_OR:
        if layer.get(a) is not None and b in layer:
            raise RunError(f"{name(a)} and {name(b)} both given: {name(a)} sets {b}; give one of them")


def drop_derived(layer: dict) -> None:
    """A run record holds `steps` (`warmup`) as counted from its `epochs` (`warmup_ratio`):
    counted again on resume, from the settings then in force."""
    for a, b in EITHER_OR:
        if layer.get(a) is not None:
            layer.pop(b, None)


def keep_the_later_of_each_pair(merged: dict, layer: dict) -> None:
    """A later layer's `steps` (`warmup`) overrides an earlier layer's `epochs` (`warmup_ratio`),
    and the other way round: `--resume --steps 2000` on a run of `--epochs 2` trains to step 2000."""
    for a, b in EITHER_OR:
        if b in layer and a not in layer:
            merged[a] = None
        elif layer.get(a) is not None and b not in layer:
            merged.pop(b, None)  # TrainConfig's default; the value comes from `a`


def _same_path(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def check_resume(merged: dict, recorded_lora: LoraSettings, stored: dict, run_dir) -> None:
    """Refuse a resumed run whose model, dtype, quantization or LoRA shape differs from its record
    (`stored`, whose LoRA settings are `recorded_lora`)."""
    for key in RESUME_FIXED:
        default = _RECORD_DEFAULTS.get(key)
        theirs = stored.get(key, stored.get("train", {}).get(key, default))  # a TrainConfig field: in "train"
        mine = merged.get(key, default)
        same = _same_path if key == "model" else (lambda a, b: a == b)
        if theirs is not None and not same(mine, theirs):
            raise RunError(f"--resume: {key} is {mine!r} but the run in {run_dir} used {theirs!r}")
    from jqlora.lora.config import lora_differences

    asked = {k: merged.get(k) for k in RESUME_FIXED_LORA}
    for key, mine, _ in lora_differences(asked, recorded_lora):
        raise RunError(f"--resume: lora.{key} is {mine!r} but the run in {run_dir} used {stored['lora'][key]!r}")
