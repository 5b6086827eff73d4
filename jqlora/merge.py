"""A LoRA adapter merged into its base checkpoint: a dense folder that plain transformers loads, or a
re-quantized bitsandbytes NF4 folder that transformers + bitsandbytes load.

Why: to serve or share a fine-tuned model without peft (and, for the dense formats, without
bitsandbytes). The merge of a target module is ``W' = dequant(W) + scale * B @ A`` in float32 with
``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), as `jqlora.lora.QLoRALinear.merge`
computes it: W is dequantized in float32, the numbers the adapter was trained against in jqlora
(bitsandbytes first rounds a bf16-stored weight to bf16, so PEFT over bitsandbytes differs from
this by that rounding). Then, by format:

* ``bf16`` / ``float32``: every floating tensor in that dtype (quantized weights dequantized),
  config.json without ``quantization_config`` and with ``dtype`` set.
* ``nf4``: each merged weight quantized again with `jqlora.quant.quantize_4bit` (NF4, the base
  weight's blocksize and double quantization, its recorded dtype); NF4 weights the adapter leaves
  alone keep their bytes; other tensors keep their stored dtype; config.json gets the
  ``quantization_config`` that describes the weights (`interop.bnb_save`). Quantized in the
  output: the base's quantized linears (an int8 or fp4 base's too), or, when the base holds none,
  the decoder layers' linears (blocksize 64, double quantization); lm_head stays as it is.
  Re-quantization can throw the fine-tune away (a delta below NF4's resolution leaves the codes
  as they were), so the nf4 path measures what it keeps (`requantization_report`) before writing
  anything, and refuses below ``min_kept`` unless forced. A mixture-of-experts model's experts and
  routers are written dense, per expert, in the checkpoint's dtype (config.json ``dtype``, else
  as stored), as transformers + bitsandbytes write them: transformers 5 holds experts as 3-D
  parameters that bitsandbytes does not quantize and cannot load 4-bit experts
  (`interop.experts.kept_dense_by_transformers`); jqlora quantizes them again at load
  (``quantize_experts="auto"``), so their merge is kept exactly in the file.

Tokenizer files and generation_config.json are copied when present. The folder is written
atomically (nothing half-written on failure) and a tensor at a time: the base is held once, in
its stored (quantized) form, and each dense output tensor exists only while it is written.
The base is merged as stored: a run that quantized a dense base at load is merged into the dense
weights, as PEFT merges into the original weights.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jqlora.errors import Error
from jqlora.lora.linear import base_shape
from jqlora.quant import Int8Weight, Weight4bit, dequantize, quantize_4bit, unpack_codes

FORMATS = ("bf16", "float32", "nf4")
_DENSE_DTYPES = {"bf16": "bfloat16", "float32": "float32"}
# Files of a Hugging Face folder that belong with the weights but are not weights.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                "chat_template.json", "generation_config.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default ("5GB")
# The 4-bit format of a weight that had none in the base (QLoRA's recipe, jqlora's quantize default).
DEFAULT_BLOCKSIZE = 64
DEFAULT_DOUBLE_QUANT = True
_STORED_DTYPES = ("float16", "bfloat16", "float32")
# The NF4 export is refused below this kept share of the adapter's effect: under it the exported
# weights are further from the fine-tuned ones than half of what the fine-tune changed.
DEFAULT_MIN_KEPT = 0.5
# The fixed random inputs of the kept-share measure: rows of N(0, 1) float32, seeded.
PROBE_ROWS = 256
PROBE_SEED = 0


class MergeError(Error, ValueError):
    """An adapter that does not fit the base checkpoint; the message names the adapter file and
    the tensor key."""


class RequantizationError(MergeError):
    """An NF4 export refused because re-quantization keeps less of the adapter's effect than the
    threshold; `report` is the measurement (`merge_adapter`'s "requantization" entry)."""

    def __init__(self, message: str, report: Mapping[str, Any]):
        super().__init__(message)
        self.report = dict(report)


# ------------------------------------------------------------------------------------------- merge
def _merged_impl(base, a, b, scale):
    delta = jnp.matmul(b.astype(jnp.float32), a.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return dequantize(base, jnp.float32) + scale * delta


# Compiled once per weight format and shape; the matmul at full float32 precision (no TF32 on a GPU).
_merged = jax.jit(_merged_impl)


def merged_weight(base_weight, lora_A, lora_B, scale: float) -> jax.Array:
    """``dequant(base_weight) + scale * lora_B @ lora_A`` as a float32 (out, in) array.

    Args:
      base_weight: a `Weight4bit`, an `Int8Weight` or a dense (out, in) array.
      lora_A: (r, in); lora_B: (out, r); any float dtype (computed in float32).
      scale: alpha / r, or alpha / sqrt(r) with rsLoRA (`jqlora.lora.linear.lora_scale`).
    """
    return _merged(base_weight, jnp.asarray(lora_A), jnp.asarray(lora_B), jnp.float32(scale))


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """A PEFT adapter as the merge needs it: weights per module, the scale, where it came from."""

    path: Path
    params: Mapping[str, Mapping[str, Any]]  # {module: {"lora_A": (r, in), "lora_B": (out, r)}}
    rank: int
    alpha: float
    use_rslora: bool
    targets: Any
    scale: float

    def key(self, module: str, which: str = "lora_A") -> str:
        """`module`'s `which` tensor in adapter_model.safetensors, named for messages."""
        from interop.peft_adapter import KEY_PREFIX, WEIGHTS_NAME

        return f"{self.path / WEIGHTS_NAME}: tensor {KEY_PREFIX}{module}.{which}.weight"

    def merged(self, module: str, base_weight) -> jax.Array:
        pair = self.params[module]
        return merged_weight(base_weight, pair["lora_A"], pair["lora_B"], self.scale)


def _load_adapter(path) -> _Adapter:
    from jqlora.adapters import load_adapter
    from jqlora.lora.linear import lora_scale

    cfg, params, _ = load_adapter(path)
    return _Adapter(Path(path), params, cfg.rank, cfg.alpha, cfg.use_rslora, cfg.target_modules,
                    lora_scale(cfg.rank, cfg.alpha, cfg.use_rslora))


def _per_expert(params: dict, config: Mapping, adapter: _Adapter) -> tuple[dict, _Adapter]:
    """A mixture-of-experts base and adapter in the per-expert layout transformers loads: fused
    expert stacks split into per-expert float32 weights, expert LoRA stacks into per-expert pairs
    (`interop.experts`), so each expert merges as a linear layer of its own."""
    from interop.experts import per_expert_adapter, per_expert_params

    mt = config.get("model_type")
    return (per_expert_params(params, mt),
            dataclasses.replace(adapter, params=per_expert_adapter(adapter.params, mt)))


def _is_quantized(v) -> bool:
    return isinstance(v, (Weight4bit, Int8Weight))


def _linear_modules(params: Mapping) -> dict[str, str]:
    """module name -> its params key for every linear layer of the base: quantized weights (keyed
    by module) and dense 2-D ``.weight`` tensors other than embeddings."""
    out = {}
    for k, v in params.items():
        if _is_quantized(v):
            out[k] = k
        elif k.endswith(".weight") and len(getattr(v, "shape", ())) == 2:
            module = k[: -len(".weight")]
            if "embed" not in module.rsplit(".", 1)[-1]:
                out[module] = k
    return out


def _check_fit(adapter: _Adapter, params: Mapping, base: Path) -> dict[str, str]:
    """module -> params key of every module the adapter changes, once each has a base weight of a
    matching shape and no linear layer that the adapter's target_modules selects lacks weights."""
    from jqlora.lora.config import module_name_matches

    linears = _linear_modules(params)
    plan = {}
    for m, pair in sorted(adapter.params.items()):
        if m.startswith("model.") and m not in linears:  # a multimodal base: its text model's keys
            alt = next((a for a in ("language_model." + m, "model.language_model." + m[6:]) if a in linears), None)
            if alt is not None:
                linears[m] = linears.pop(alt)
        if m not in linears:
            raise MergeError(f"{adapter.key(m)}: the base checkpoint {base} has no linear layer {m!r} "
                             f"(no tensor {m + '.weight'!r}); is it the adapter's base model?")
        out_f, in_f = base_shape(params[linears[m]])
        a_shape, b_shape = tuple(pair["lora_A"].shape), tuple(pair["lora_B"].shape)
        if a_shape[1] != in_f:
            raise MergeError(f"{adapter.key(m, 'lora_A')}: shape {list(a_shape)} does not fit the base weight "
                             f"{m + '.weight'!r} of {base}, (out, in) = {[out_f, in_f]}: expected [r, {in_f}]")
        if b_shape[0] != out_f:
            raise MergeError(f"{adapter.key(m, 'lora_B')}: shape {list(b_shape)} does not fit the base weight "
                             f"{m + '.weight'!r} of {base}, (out, in) = {[out_f, in_f]}: expected [{out_f}, r]")
        plan[m] = linears[m]
    missing = sorted(m for m in linears if m not in plan and module_name_matches(m, adapter.targets))
    if missing:
        raise MergeError(f"{adapter.key(missing[0])} is missing: target_modules={adapter.targets!r} selects "
                         f"{len(missing)} linear layer(s) of {base} without adapter weights (e.g. "
                         f"{missing[0]!r}); the adapter is incomplete or belongs to another model")
    return plan


# ------------------------------------------------------------------------------------------ writing
def _copy_side_files(base: Path, out: Path) -> list[str]:
    copied = []
    for name in COPIED_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
            copied.append(name)
    return copied


def _dense_tensors(params: dict, plan: Mapping[str, str], adapter: _Adapter, dtype) -> dict:
    """{tensor key: LazyArray} of a dense output: each tensor is computed, and its base entry
    dropped from `params`, only when the writer reaches it."""
    from interop.safetensors_io import LazyArray

    module_of = {key: m for m, key in plan.items()}

    def compute(key: str) -> np.ndarray:
        v = params.pop(key)
        if key in module_of:
            return np.asarray(adapter.merged(module_of[key], v).astype(dtype))
        return np.asarray(dequantize(v, dtype))  # a quantized weight dequantized, a dense tensor cast

    tensors = {}
    for key, v in params.items():
        if _is_quantized(v):
            tensors[key + ".weight"] = LazyArray(lambda key=key: compute(key), base_shape(v), dtype)
        elif jnp.issubdtype(v.dtype, jnp.floating):
            tensors[key] = LazyArray(lambda key=key: compute(key), tuple(v.shape), dtype)
        else:
            tensors[key] = v
    return tensors


def _dense_config(config: dict, dtype_name: str) -> dict:
    cfg = copy.deepcopy(config)
    cfg.pop("quantization_config", None)
    cfg["dtype"] = dtype_name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype_name
    return cfg


# ---------------------------------------------------------------- what NF4 re-quantization keeps
def probe_inputs(in_features: int, rows: int = PROBE_ROWS, seed: int = PROBE_SEED) -> np.ndarray:
    """The fixed inputs X of the kept-share measure: (rows, in_features) standard normal float32
    from ``numpy.random.default_rng(seed)``, the same for every layer of a given in_features."""
    return np.random.default_rng(seed).standard_normal((rows, in_features), dtype=np.float32)


def _effect_impl(new_q, base_q, a, b, scale, x):
    hi = jax.lax.Precision.HIGHEST
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    effect_true = scale * jnp.matmul(jnp.matmul(x, a.T, precision=hi), b.T, precision=hi)
    delta_q = dequantize(new_q, jnp.float32) - dequantize(base_q, jnp.float32)
    effect_kept = jnp.matmul(x, delta_q.T, precision=hi)
    n = new_q.numel
    changed = jnp.sum(unpack_codes(new_q.packed, n) != unpack_codes(base_q.packed, n))
    return jnp.linalg.norm(effect_kept - effect_true), jnp.linalg.norm(effect_true), changed


# Compiled once per weight format and shape; float32 products at full precision (no TF32).
_effect = jax.jit(_effect_impl)


def requantized_effect(new_q: Weight4bit, base_q: Weight4bit, lora_A, lora_B, scale: float,
                       x=None) -> dict[str, Any]:
    """What the NF4 weight `new_q` (the merge, re-quantized) keeps of one LoRA module's effect.

    With X = `probe_inputs` (or `x`), the adapter's effect is ``effect_true = X (scale B A)^T`` and
    what the export keeps of it is ``effect_kept = X (dequant(new_q) - dequant(base_q))^T``, in
    float32 (norms Frobenius).

    Returns {"kept", "error", "effect_norm", "error_norm", "codes_changed", "codes"}:
      effect_norm, error_norm: ||effect_true||, ||effect_kept - effect_true||.
      error: error_norm / effect_norm, the exported layer's distance from the fine-tuned one in
        units of the fine-tune's effect (0.0 when effect_norm is 0: nothing to lose).
      kept: max(0, 1 - error): 1.0 for a perfect merge, 0 when re-quantization gives back the
        base's weights (kept = 0: the delta is gone) or adds more noise than the delta.
      codes_changed / codes: 4-bit codes of `new_q` that differ from `base_q`'s, and all of them.
    """
    in_features = new_q.shape[1]
    x = probe_inputs(in_features) if x is None else x
    err, true, changed = _effect(new_q, base_q, jnp.asarray(lora_A), jnp.asarray(lora_B), jnp.float32(scale),
                                 jnp.asarray(x, jnp.float32))
    err, true = float(err), float(true)
    error = err / true if true > 0 else 0.0
    return dict(kept=max(0.0, 1.0 - error), error=error, effect_norm=true, error_norm=err,
                codes_changed=int(changed), codes=int(new_q.numel))


def requantization_report(modules: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The totals over `requantized_effect`'s per-module results: the relative error is
    sum(error_norm) / sum(effect_norm), i.e. the per-module errors averaged with the effect norms as
    weights, and kept = max(0, 1 - that) (1.0 when no module has any effect: nothing to lose);
    codes_changed / codes are summed over the merged modules."""
    true = sum(m["effect_norm"] for m in modules.values())
    err = sum(m["error_norm"] for m in modules.values())
    error = err / true if true > 0 else 0.0
    changed, codes = sum(m["codes_changed"] for m in modules.values()), sum(m["codes"] for m in modules.values())
    return dict(measure="kept = max(0, 1 - sum ||X (dQ - scale B A)^T|| / sum ||X (scale B A)^T||) over the "
                        "merged layers, dQ = dequant(merged NF4) - dequant(base NF4), X: "
                        f"{PROBE_ROWS} seeded N(0, 1) rows",
                kept=max(0.0, 1.0 - error), error=error, codes_changed=changed, codes=codes,
                changed_share=changed / codes if codes else 0.0, modules=dict(modules))


def _requantize(params: dict, config: Mapping, plan: Mapping[str, str],
                adapter: _Adapter) -> tuple[int, int, dict[str, Any]]:
    """Rewrite `params` for the NF4 output, a weight at a time: each weight the module docstring
    says is quantized becomes an NF4 `Weight4bit` of its merged (or unchanged) value; a merged
    weight that stays dense keeps its dtype; experts and routers are dense in the checkpoint's
    dtype. Returns how many weights were quantized, how many expert and router weights were
    written dense, and `requantization_report` over the merged weights that were quantized.

    A merged weight's NF4 codes and effect are compared with the base's quantization in the same
    format: the stored weight of an NF4 base, else the base weight quantized as the output is
    (an int8, fp4 or dense base is quantized too, so its own rounding is not counted as lost)."""
    from interop.experts import kept_dense_by_transformers

    linears = _linear_modules(params)
    quantized = {m for m, k in linears.items() if _is_quantized(params[k])}
    if not quantized:  # a dense base: what transformers quantizes, the decoder layers' linears
        quantized = {m for m in linears if ".layers." in f".{m}"}
    moe = {m for m in linears if kept_dense_by_transformers(m, config.get("model_type", ""))}
    quantized -= moe
    config_dtype = config.get("dtype", config.get("torch_dtype"))
    count, effects = 0, {}
    for m in sorted(quantized | set(plan) | {m for m in moe if _is_quantized(params[linears[m]])}):
        key = linears[m]
        base = params[key]
        if m in plan:
            w = adapter.merged(m, base)
        elif m not in moe and isinstance(base, Weight4bit) and base.quant_type == "nf4":
            continue  # already NF4 and unchanged: its bytes stay
        else:
            w = dequantize(base, jnp.float32)
        del params[key]
        if m in moe:  # dense, per expert, in the checkpoint's dtype (a quantized one's as stored)
            stored = config_dtype if config_dtype in _STORED_DTYPES else (
                base.stored_dtype if _is_quantized(base) else base.dtype)
            params[m + ".weight"] = w.astype(stored)
            continue
        if m not in quantized:  # a dense linear of a quantized base (a skipped module) stays dense
            params[key] = w.astype(base.dtype)
            continue
        if isinstance(base, Weight4bit):
            blocksize, nested, stored = base.blocksize, base.nested, base.stored_dtype
        elif isinstance(base, Int8Weight):
            stored = config_dtype if config_dtype in _STORED_DTYPES else base.stored_dtype
            blocksize, nested = DEFAULT_BLOCKSIZE, DEFAULT_DOUBLE_QUANT
        else:
            blocksize, nested, stored = DEFAULT_BLOCKSIZE, DEFAULT_DOUBLE_QUANT, jnp.dtype(base.dtype).name
        params[m] = dataclasses.replace(quantize_4bit(w, "nf4", blocksize, nested), stored_dtype=stored)
        count += 1
        if m in plan:
            if isinstance(base, Weight4bit) and base.quant_type == "nf4":
                base_q = base
            else:
                base_q = quantize_4bit(dequantize(base, jnp.float32), "nf4", blocksize, nested)
            pair = adapter.params[m]
            effects[m] = requantized_effect(params[m], base_q, pair["lora_A"], pair["lora_B"], adapter.scale)
    for m in moe:  # unmerged dense experts and routers: cast to the checkpoint's dtype as well
        key = linears[m]
        if key in params and config_dtype in _STORED_DTYPES and params[key].dtype != jnp.dtype(config_dtype):
            params[key] = params[key].astype(config_dtype)
    return count, len(moe), requantization_report(effects)


def _refusal(report: Mapping[str, Any], min_kept: float) -> str:
    return (f"nf4 re-quantization keeps {report['kept']:.1%} of the adapter's effect on its layers' outputs "
            f"({report['codes_changed']} of the merged weights' {report['codes']} 4-bit codes changed), below "
            f"min_kept={min_kept:.0%}: nothing written. format='bf16' keeps the merge exactly; force=True "
            f"writes the NF4 folder anyway")


# ------------------------------------------------------------------------------------------ the API
def _check_args(out: Path, format: str) -> None:  # noqa: A002
    if format not in FORMATS:
        raise MergeError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if os.path.lexists(out):
        raise FileExistsError(f"{out} already exists; choose a new output folder")


def merge_adapter(base, adapter, out, *, format: str = "bf16",  # noqa: A002 - the CLI's word
                  max_shard_bytes: Optional[int] = DEFAULT_MAX_SHARD_BYTES, min_kept: float = DEFAULT_MIN_KEPT,
                  force: bool = False) -> dict[str, Any]:
    """Merge the PEFT adapter `adapter` into the checkpoint `base` and write the folder `out`.

    Args:
      base: the base checkpoint folder (bitsandbytes 4-bit or 8-bit, or plain safetensors).
      adapter: a PEFT LoRA adapter folder for it (adapter_config.json + adapter_model.safetensors).
      out: the folder to write; must not exist.
      format: "bf16" or "float32" (dense: plain transformers) or "nf4" (bitsandbytes NF4).
      max_shard_bytes: weights larger than this are split into shards plus an index, as
        transformers does; None writes one file.
      min_kept: nf4 only: the least share of the adapter's effect the re-quantized weights must
        keep ("kept" of `requantization_report`, 0..1); below it nothing is written and
        RequantizationError is raised.
      force: nf4 only: write the folder whatever share is kept.

    Returns:
      {"out", "format", "base", "adapter", "merged" (modules changed), "quantized" (weights
      quantized anew, nf4), "experts_dense" (nf4: mixture-of-experts expert and router weights
      written dense), "rank", "alpha", "use_rslora", "scale", "files" (copied beside the
      weights), "requantization" (nf4: `requantization_report` plus "min_kept" and "below_min";
      None for the dense formats)}.

    Raises:
      MergeError: an adapter module the base lacks, a shape mismatch, or a module the adapter's
        target_modules selects without weights (the message names the adapter file and key).
      interop.CheckpointError, AdapterFormatError, AdapterMismatchError: a malformed base or
        adapter (the message names the file and tensor).
      FileExistsError: `out` exists.
      RequantizationError: nf4, not `force`, and re-quantization keeps less than `min_kept`.
    """
    import interop
    from interop.atomic_io import atomic_directory
    from interop.bnb_common import CONFIG_FILE
    from interop.safetensors_io import write_sharded_safetensors

    base, out = Path(base), Path(out)
    _check_args(out, format)
    adapter = _load_adapter(adapter)
    params, config = interop.load_bnb_checkpoint(base)
    params, adapter = _per_expert(params, config, adapter)
    plan = _check_fit(adapter, params, base)
    quantized, moe_dense, requant = 0, 0, None
    if format == "nf4":  # quantized and measured in memory: a refusal writes nothing
        quantized, moe_dense, requant = _requantize(params, config, plan, adapter)
        requant.update(min_kept=min_kept, below_min=requant["kept"] < min_kept)
        if requant["below_min"] and not force:
            raise RequantizationError(_refusal(requant, min_kept), requant)
    with atomic_directory(out) as tmp:
        if format == "nf4":
            interop.save_bnb_checkpoint(tmp, params, config, max_shard_bytes=max_shard_bytes, overwrite=True)
        else:
            dtype_name = _DENSE_DTYPES[format]
            cfg = _dense_config(config, dtype_name)
            (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            write_sharded_safetensors(tmp, _dense_tensors(params, plan, adapter, jnp.dtype(dtype_name)),
                                      {"format": "pt"}, max_shard_bytes=max_shard_bytes)
        files = _copy_side_files(base, tmp)
    return dict(out=str(out), format=format, base=str(base), adapter=str(adapter.path), merged=len(plan),
                quantized=quantized, experts_dense=moe_dense, rank=adapter.rank, alpha=adapter.alpha, use_rslora=adapter.use_rslora,
                scale=adapter.scale, files=files, requantization=requant)


def merge_run(source, out, *, format: str = "bf16", step: Optional[int] = None,  # noqa: A002
              model_path=None, max_shard_bytes: Optional[int] = DEFAULT_MAX_SHARD_BYTES,
              min_kept: float = DEFAULT_MIN_KEPT, force: bool = False) -> dict[str, Any]:
    """Merge a training run's checkpoint into its base model: the checkpoint is exported as a PEFT
    adapter into a temporary folder by `jqlora.runs.export_adapter` (which validates it), then
    merged by `merge_adapter`.

    Args:
      source: a run directory, its checkpoints/ directory, or one step directory.
      out: the folder to write; must not exist.
      format, min_kept, force: as in `merge_adapter`.
      step: the checkpoint's step (None: the newest).
      model_path: the base checkpoint (None: the run record's model).

    Returns:
      `merge_adapter`'s report with "source", "step" and "checkpoint" in place of "adapter".
    """
    from jqlora.runs import export_adapter

    out = Path(out)
    _check_args(out, format)
    with tempfile.TemporaryDirectory(prefix="jqlora-merge-") as tmp:
        exported = export_adapter(source, Path(tmp) / "adapter", step=step, model_path=model_path)
        report = merge_adapter(exported["model"], exported["adapter"], out, format=format,
                               max_shard_bytes=max_shard_bytes, min_kept=min_kept, force=force)
    report.pop("adapter")  # a temporary folder, gone
    return dict(report, source=str(source), step=exported["step"], checkpoint=exported["checkpoint"])


def merged_tensors(base, adapter, *, dtype: str = "float32") -> tuple[dict, dict, _Adapter]:
    """The dense merge of `merge_adapter` without its folder, for writers of other formats (GGUF).

    Args:
      base: the base checkpoint folder; adapter: a PEFT LoRA adapter folder for it.
      dtype: "float32" or "bf16", the dtype of every floating tensor.

    Returns:
      (config, tensors, adapter): the base's config as `interop.load_bnb_checkpoint` reads it;
      {tensor key: LazyArray} with the keys of the dense folder, each floating tensor merged,
      dequantized or cast only when read (once), so a writer holds one at a time, integer tensors
      as stored; the loaded adapter (`params`, `rank`, `alpha`, `use_rslora`, `scale`, `path`).

    Raises:
      As `merge_adapter`.
    """
    import interop

    if dtype not in _DENSE_DTYPES:
        raise MergeError(f"dtype must be one of {', '.join(_DENSE_DTYPES)}, got {dtype!r}")
    base = Path(base)
    adapter = _load_adapter(adapter)
    params, config = interop.load_bnb_checkpoint(base)
    params, adapter = _per_expert(params, config, adapter)
    plan = _check_fit(adapter, params, base)
    return config, _dense_tensors(params, plan, adapter, jnp.dtype(_DENSE_DTYPES[dtype])), adapter


__all__ = ["FORMATS", "COPIED_FILES", "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_MIN_KEPT", "MergeError",
           "RequantizationError", "merge_adapter", "merge_run", "merged_tensors", "merged_weight", "probe_inputs",
           "requantized_effect", "requantization_report"]
