"""PEFT adapters <-> jqlora models: the glue the CLI, the demo and the cross-check share.

The file format lives in `interop.peft_adapter` (save_peft_adapter / load_peft_adapter); this
module only maps it onto `jqlora.lora.LoraConfig` and a model's LoRA layers:

* `lora_config_from_peft(adapter_config)`  PEFT adapter_config.json dict -> LoraConfig
* `save_adapter(path, model, lora_config, base_model=...)`  a model's LoRA weights -> PEFT dir
* `load_adapter(path)`  -> (LoraConfig, {module: {"lora_A", "lora_B"}}, adapter_config)
* `attach_adapter(model, params)`  set a model's LoRA weights (strict: every module must match)
* `load_model_with_adapter(model_path, adapter_dir, ...)`  load_causal_lm + the adapter
* `import_adapter(adapter_dir, model_path)`  check an adapter against a model (`jqlora import-peft`)
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from jqlora.errors import Error
from jqlora.lora import LoraConfig, linear_names, lora_params_by_module, set_lora_params


class AdapterMismatchError(Error, ValueError):
    """A PEFT adapter that does not fit the model (unknown module, wrong shape, unsupported option),
    or that names no local base model to apply it to."""


def lora_config_from_peft(cfg: Mapping[str, Any], where: str = "adapter_config.json") -> LoraConfig:
    """The LoraConfig a PEFT LoRA adapter config describes.

    Args:
      cfg: the parsed adapter_config.json.
      where: the file to name in errors.

    Raises:
      AdapterMismatchError: an option jqlora cannot apply ("not supported: <option> in <where>":
        per-module ranks or alphas, DoRA, layers_to_transform, modules_to_save, embedding LoRA,
        trained biases, fan_in_fan_out, ...; the list is `interop.peft_adapter.UNSUPPORTED_OPTIONS`),
        or a field of the wrong type or range (r, lora_alpha, lora_dropout, target_modules,
        use_rslora).
    """
    from interop.peft_adapter import AdapterFormatError, check_adapter_config, unsupported

    if not isinstance(cfg, Mapping):
        raise AdapterMismatchError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    try:
        unsupported(cfg, where)
    except AdapterFormatError as e:
        raise AdapterMismatchError(str(e)) from None
    if cfg.get("target_modules") is None:
        raise AdapterMismatchError(f"{where}: target_modules is missing")
    cfg = {**cfg, "lora_alpha": cfg.get("lora_alpha", cfg.get("r"))}  # no lora_alpha: alpha = r
    check_adapter_config(cfg, where, AdapterMismatchError)
    targets = cfg["target_modules"]
    params = cfg.get("target_parameters") or []  # mixture-of-experts stacks (checked by `unsupported`)
    if params:
        names = [".".join(p.split(".")[-2:]) for p in params]  # "experts.gate_up_proj"
        if isinstance(targets, str):
            targets = "|".join([f"(?:{targets})"] + [rf".*\.{re.escape(n)}" for n in names])
        else:
            targets = [*(targets or []), *names]
    return LoraConfig(rank=cfg["r"], alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout") or 0.0),
                      target_modules=targets if isinstance(targets, str) else tuple(targets),
                      use_rslora=bool(cfg.get("use_rslora")))


def save_adapter(path, model, lora_config: LoraConfig, *, base_model: Optional[str] = None) -> str:
    """Write the model's LoRA weights as a PEFT adapter directory (float32); returns the path."""
    import interop

    params = lora_params_by_module(model)
    if not params:
        raise ValueError("the model has no LoRA layers: nothing to export")
    from jqlora.lora.config import peft_target_modules

    experts = sorted({".".join(n.split(".")[-3:]) for n, p in params.items() if p["lora_A"].ndim == 3})
    linears = [n for n, p in params.items() if p["lora_A"].ndim == 2]
    if experts:
        targets = _moe_target_modules(linears, model)
    else:
        targets = peft_target_modules(lora_config.target_modules, list(params))
    multimodal = getattr(model, "text_of_multimodal", None)  # set by the loader; else ask the folder
    if multimodal if multimodal is not None else multimodal_base(base_model):  # PEFT's names inside it
        params = {MULTIMODAL_TEXT_PREFIX + n.removeprefix("model."): p for n, p in params.items()}
        targets = _text_model_regex(list(params))
    return interop.save_peft_adapter(
        path, params, rank=int(lora_config.rank), alpha=float(lora_config.alpha),
        target_modules=targets, target_parameters=experts or None,
        base_model_name_or_path=base_model, use_rslora=bool(lora_config.use_rslora),
        dropout=float(lora_config.dropout))


# Leaf names PEFT 0.21 moves onto a transformers-5 MoE's expert stacks or router when they appear in
# target_modules (peft.utils.transformers_weight_conversion, _MOE_TARGET_MODULE_MAPPING).
_PEFT_MOE_REMAPPED = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _moe_target_modules(linears, model) -> list:
    """target_modules of a mixture-of-experts adapter: the leaf names of its other LoRA modules
    (attention). PEFT remaps the leaf names of `_PEFT_MOE_REMAPPED` onto the expert stacks of such
    a model, so LoRA on a router or on a dense MLP layer (Qwen3-MoE's mlp_only_layers) cannot be
    written in a form PEFT loads back as it is: refused."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    bad = [n for n in linears if n.rsplit(".", 1)[-1] in _PEFT_MOE_REMAPPED]
    if bad:
        raise AdapterMismatchError(
            f"cannot export LoRA on {bad[0]!r} of a {model.config.model_type} model to PEFT: PEFT 0.21 maps "
            f"{bad[0].rsplit('.', 1)[-1]!r} in target_modules onto the expert stacks; leave the router and dense "
            "MLP layers out of target_modules")
    return leaves


def load_adapter(path):
    """-> (LoraConfig, {module: {"lora_A": (r, in), "lora_B": (out, r)}}, adapter_config dict)."""
    import interop

    params, cfg = interop.load_peft_adapter(path)
    lora_cfg = lora_config_from_peft(cfg, f"{path}/adapter_config.json")
    mapped = {_text_model_name(n): p for n, p in params.items()}
    if list(mapped) != list(params):  # an adapter of a multimodal base: its text model's modules
        params = mapped
        if not all(lora_cfg.matches(n) for n in params):  # e.g. PEFT's `.*language_model.*` regex
            lora_cfg = dataclasses.replace(lora_cfg, target_modules=tuple(sorted(params)))
    return lora_cfg, params, cfg


# A multimodal checkpoint's text model (Gemma 3's Gemma3ForConditionalGeneration): PEFT names its
# modules `model.language_model.layers...` under transformers 5 (`language_model.model.layers...`
# under transformers 4); jqlora's text model names them `model.layers...`.
MULTIMODAL_TEXT_PREFIX = "model.language_model."
_TEXT_NAME_RE = re.compile(r"^(?:model\.language_model|language_model\.model)\.(layers\..+)$")


def multimodal_base(base_model) -> bool:
    """Whether `base_model` is a local checkpoint folder whose config.json wraps its text model
    (a `text_config` object: a multimodal model, whose text modules PEFT names with
    `MULTIMODAL_TEXT_PREFIX`)."""
    if base_model is None or not (Path(base_model) / "config.json").is_file():
        return False
    from interop.bnb_common import read_config

    return isinstance(read_config(base_model, unwrap=False).get("text_config"), dict)


def _text_model_name(name: str) -> str:
    m = _TEXT_NAME_RE.match(name)
    return "model." + m.group(1) if m else name


def _text_model_regex(names) -> str:
    """target_modules for the text model inside a multimodal model: one regex naming exactly these
    modules (their layers grouped by projection), so that it reaches neither the vision tower's
    projections of the same names nor layers without weights; it matches jqlora's text-only names
    (`model.layers...`) too, so the adapter reads back."""
    by_leaf: dict[str, set] = {}
    for n in names:
        m = re.fullmatch(r"model\.language_model\.layers\.(\d+)\.(.+)", n)
        if m is None:
            raise AdapterMismatchError(f"cannot name {n!r} for PEFT on a multimodal base (not a text-model layer)")
        by_leaf.setdefault(m.group(2), set()).add(int(m.group(1)))
    groups: dict[tuple, list] = {}
    for leaf, layers in by_leaf.items():
        groups.setdefault(tuple(sorted(layers)), []).append(re.escape(leaf))
    alts = [rf"(?:{'|'.join(map(str, layers))})\.(?:{'|'.join(sorted(leaves))})"
            for layers, leaves in sorted(groups.items())]
    return rf"model(?:\.language_model)?\.layers\.(?:{'|'.join(alts)})"


def attach_adapter(model, params: Mapping[str, Mapping[str, Any]], *, where: str = "adapter") -> dict:
    """Set the model's LoRA weights from `params` (every adapter module must be a LoRA layer of
    the model and every LoRA layer must be given). Returns a report: matched modules, the model's
    linear layers the adapter leaves alone, rank, parameter count."""
    layers = linear_names(model)  # names only: no per-layer copies of stacked weights
    unknown = sorted(set(params) - set(layers))
    if unknown:
        raise AdapterMismatchError(f"{where}: module(s) {unknown[:5]} not in the model"
                                   + (" ..." if len(unknown) > 5 else "")
                                   + f" (the model has {len(layers)} linear layers, e.g. {next(iter(layers), None)!r})")
    try:
        set_lora_params(model, params, strict=True)
    except (KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise AdapterMismatchError(f"{where}: {msg}") from None
    n = sum(int(p["lora_A"].size) + int(p["lora_B"].size) for p in params.values())
    return dict(matched=sorted(params), untouched=sorted(set(layers) - set(params)), lora_params=n)


def load_model_with_adapter(model_path, adapter_dir=None, *, compute_dtype=None, rngs=None, **load_kw):
    """`models.load_causal_lm(model_path)`, with the PEFT adapter in `adapter_dir` applied when
    given. Returns (model, report or None, LoraConfig or None)."""
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import models

    compute_dtype = jnp.float32 if compute_dtype is None else compute_dtype
    if adapter_dir is None:
        return models.load_causal_lm(model_path, compute_dtype=compute_dtype, **load_kw), None, None
    cfg, params, _ = load_adapter(adapter_dir)
    # The adapter's dropout only matters for training; evaluation runs in eval mode anyway.
    cfg = dataclasses.replace(cfg, dropout=0.0)
    model = models.load_causal_lm(model_path, lora=cfg, compute_dtype=compute_dtype,
                                  rngs=rngs if rngs is not None else nnx.Rngs(0), **load_kw)
    report = attach_adapter(model, params, where=str(adapter_dir))
    return model, report, cfg


def import_adapter(adapter, model_path=None, *, tokens: int = 16, dtype: str = "float32",
                   quantize_experts: str = "auto") -> dict:
    """Check that a PEFT adapter applies to a model and measure what it does (`jqlora import-peft`).

    Loads the model with the adapter (strict, see `attach_adapter`) and without it, runs both on
    the same random tokens and compares the logits.

    Args:
      adapter: the PEFT adapter directory.
      model_path: the base checkpoint (None: the adapter's base_model_name_or_path, which must be
        a local directory).
      tokens: random tokens per row (2 rows) for the logits comparison.
      dtype: compute dtype name ("float32", "bfloat16", "float16").
      quantize_experts: the format of dense mixture-of-experts weights (`models.load_causal_lm`).

    Returns:
      A report: adapter, model, rank, alpha, use_rslora, scale, dropout, target_modules, matched,
      untouched, lora_params, zero_B_modules (modules whose lora_B is all zero: no effect),
      logits_max_abs_change, logits_max_abs, tokens_shape.

    Raises:
      interop.peft_adapter.AdapterFormatError: no such adapter directory, or a malformed adapter.
      AdapterMismatchError: no model to apply it to, the adapter does not fit the model, or the
        logits with or without it hold NaN or Inf.
    """
    from interop.peft_adapter import AdapterFormatError

    adapter = Path(adapter)
    if not adapter.is_dir():
        raise AdapterFormatError(f"{adapter}: no such adapter directory")
    from jqlora._util import jnp_dtype, quiet_third_party

    quiet_third_party()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jqlora import models
    from jqlora.lora.linear import lora_scale
    from jqlora.train import frozen_jit

    lora_cfg, params, raw = load_adapter(adapter)
    if model_path is None:
        base = raw.get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise AdapterMismatchError(f"{adapter}: pass --model (adapter_config's base_model_name_or_path {base!r} "
                                       "is not a local directory)")
        model_path = base
    cdt = jnp_dtype(dtype)
    model, report, _ = load_model_with_adapter(model_path, adapter, compute_dtype=cdt,
                                               quantize_experts=quantize_experts)
    base_model = models.load_causal_lm(model_path, compute_dtype=cdt, quantize_experts=quantize_experts)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, max(1, tokens)))
    fwd = frozen_jit(lambda m, x: m(x))  # the weights stay inputs only (no output copy)
    model.eval()
    y1 = np.asarray(jax.device_get(fwd(model, jnp.asarray(ids)).astype(jnp.float32)))
    y0 = np.asarray(jax.device_get(fwd(base_model, jnp.asarray(ids)).astype(jnp.float32)))
    delta = float(np.max(np.abs(y1 - y0)))
    if not (np.all(np.isfinite(y0)) and np.all(np.isfinite(y1))):
        which = "the base model's" if not np.all(np.isfinite(y0)) else "the adapted model's"
        raise AdapterMismatchError(f"{adapter}: {which} logits hold NaN or Inf ({dtype} compute on {model_path}); "
                                   "the adapter does not apply cleanly")
    b_zero = sorted(m for m, p in params.items() if not np.any(np.asarray(p["lora_B"], np.float32)))
    targets = lora_cfg.target_modules
    return dict(
        adapter=str(adapter), model=str(model_path), rank=lora_cfg.rank, alpha=lora_cfg.alpha,
        use_rslora=lora_cfg.use_rslora, scale=lora_scale(lora_cfg.rank, lora_cfg.alpha, lora_cfg.use_rslora),
        dropout=lora_cfg.dropout, target_modules=targets if isinstance(targets, str) else list(targets),
        matched=report["matched"], untouched=report["untouched"], lora_params=report["lora_params"],
        zero_B_modules=b_zero, logits_max_abs_change=delta, logits_max_abs=float(np.max(np.abs(y0))),
        tokens_shape=list(ids.shape))


__all__ = ["AdapterMismatchError", "lora_config_from_peft", "save_adapter", "load_adapter", "attach_adapter",
           "load_model_with_adapter", "import_adapter"]
