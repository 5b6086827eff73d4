"""PEFT LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``), no torch.

Layout written by PEFT 0.21 ``save_pretrained`` (checked against it in tests/interop/test_peft_adapter.py):

* ``adapter_config.json``: the LoraConfig fields (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ...).
* ``adapter_model.safetensors``: per adapted module ``<m>`` (a module name of the base model, e.g.
  ``model.layers.0.self_attn.q_proj``) two tensors
  ``base_model.model.<m>.lora_A.weight`` with shape ``(r, in_features)`` and
  ``base_model.model.<m>.lora_B.weight`` with shape ``(out_features, r)``;
  the update is ``W + s * B @ A`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
  PEFT strips the adapter name when saving; a model's live ``state_dict()`` has it
  (``...lora_A.default.weight``), and the loader accepts that form too.

In memory an adapter is ``{module_name: {"lora_A": (r, in), "lora_B": (out, r)}}``.

The weights file is read and written by :mod:`interop.safetensors_io`, whose writer produces the
bytes ``safetensors.numpy.save_file`` would (tests load our adapters with ``safetensors`` and with
``peft``).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from interop.atomic_io import atomic_directory, write_text_atomic
from interop.errors import CheckpointError
from interop.experts import EXPERT_PARAMS, from_peft_factors, peft_param_modules, to_peft_factors
from interop.json_io import read_json_object
from interop.safetensors_io import SafetensorsFile, write_safetensors

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# base_model.model.<module>.lora_A[.<adapter>].weight
_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # the dtypes a LoRA weight may have on disk


def _in_use(v) -> bool:
    """A PEFT option is in use when it is set to something other than its off value (null,
    false, empty, "none"); 0 is a value (layers_to_transform=0 is layer 0)."""
    if v is None or v is False:
        return False
    if isinstance(v, (str, list, dict)):
        return len(v) > 0 and v != "none"
    return True


# adapter_config.json options jqlora cannot apply: (key, what the option means). Each one, when
# in use, changes which weights exist or how they combine, so ignoring it would be silently wrong.
UNSUPPORTED_OPTIONS = (
    ("use_dora", "DoRA, weight-decomposed LoRA"),
    ("layers_to_transform", "LoRA on a subset of the layers"),
    ("layers_pattern", "LoRA on a subset of the layers"),
    ("modules_to_save", "fully trained extra modules stored with the adapter"),
    ("trainable_token_indices", "trainable token embeddings"),
    ("target_parameters", "LoRA on parameters rather than modules"),
    ("exclude_modules", "modules excluded from target_modules"),
    ("layer_replication", "replicated layers"),
    ("fan_in_fan_out", "Conv1D (GPT-2) weight layout"),
    ("bias", "trained biases"),
    ("lora_bias", "a bias on lora_B"),
    ("use_qalora", "QA-LoRA"),
    ("alora_invocation_tokens", "activated LoRA"),
    ("megatron_config", "Megatron parallel layers"),
)
# Read by load_peft_adapter (their shapes are checked) but not applied by jqlora models.
PER_MODULE_OPTIONS = (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"))
# Module names of token embeddings in the supported architectures: PEFT gives them Embedding
# LoRA (lora_embedding_A/B tensors), which jqlora models do not have.
_EMBEDDING_MODULES = ("model.embed_tokens", "embed_tokens")


def unsupported(config: Mapping, where: str, *, per_module: bool = True) -> None:
    """Raise AdapterFormatError "not supported: <option> in <where>" for the first option of a
    PEFT adapter config that jqlora cannot apply (`UNSUPPORTED_OPTIONS`, `PER_MODULE_OPTIONS`
    unless `per_module` is False, and target_modules naming the token embedding).

    Args:
      config: the parsed adapter_config.json.
      where: the file to name in the message.
      per_module: also refuse rank_pattern / alpha_pattern.
    """
    options = UNSUPPORTED_OPTIONS + (PER_MODULE_OPTIONS if per_module else ())
    for key, what in options:
        v = config.get(key)
        if key == "target_parameters" and expert_targets(v):
            continue  # LoRA on mixture-of-experts stacks (interop.experts) is read
        if _in_use(v):
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            raise AdapterFormatError(f"not supported: {key}={shown} in {where} ({what})")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            emb = [m for m in _EMBEDDING_MODULES[:1] if re.fullmatch(targets, m)]
        except re.error:
            emb = []
    elif isinstance(targets, list):
        emb = [t for t in targets if isinstance(t, str) and any(m == t or m.endswith("." + t)
                                                                for m in _EMBEDDING_MODULES)]
    else:
        emb = []
    if emb:
        raise AdapterFormatError(f"not supported: target_modules={targets!r} in {where} (embedding LoRA: it "
                                 f"includes the token embedding {emb[0]!r})")


# one family of interop errors: catching CheckpointError (a ValueError) catches these too
class AdapterFormatError(CheckpointError):
    """A PEFT adapter directory, file or in-memory adapter that jqlora cannot read or write.

    A ValueError (and an interop CheckpointError); the message names the file and the tensor key
    (or module) at fault.
    """


def check_adapter_config(config: Mapping, where: str, error: type[Exception] = AdapterFormatError) -> None:
    """Check the LoRA fields of a PEFT adapter config, in this order: ``r`` (a positive integer),
    ``lora_alpha`` (a finite number), ``lora_dropout`` (a number in [0, 1) or null),
    ``use_rslora`` (true, false or null) and ``target_modules`` (a non-empty list of module names
    or a regex string). The one check of these fields: the reader (`load_peft_adapter`), the writer
    (`save_peft_adapter`, on the config it is about to write) and `jqlora.adapters` use it.

    Args:
      config: the adapter config (JSON values).
      where: the file to name in the message.
      error: the exception class raised.

    Raises:
      `error`: "<where>: 'r' must be a positive integer, got 0" and the like.
    """
    def bad(key, want):
        return error(f"{where}: {key!r} must be {want}, got {config.get(key)!r}")

    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise bad("r", "a positive integer")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad("lora_alpha", "a finite number")
    dropout = config.get("lora_dropout")
    if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                                or not 0.0 <= dropout < 1.0):
        raise bad("lora_dropout", "a number in [0, 1) or null")
    if config.get("use_rslora") is not None and not isinstance(config.get("use_rslora"), bool):
        raise bad("use_rslora", "true, false or null")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise error(f"{where}: 'target_modules' regex {targets!r} is invalid: {e}") from None
    elif targets in (None, []) and expert_targets(config.get("target_parameters")):
        pass  # LoRA on expert stacks only
    elif not (isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets)):
        raise bad("target_modules", "a non-empty list of module names or a regex string")


def expert_targets(v) -> bool:
    """Whether `v` (a target_parameters value) is a non-empty list of mixture-of-experts stacks
    jqlora reads (``[...]experts.gate_up_proj`` / ``[...]experts.down_proj``)."""
    return (isinstance(v, list) and bool(v)
            and all(isinstance(t, str) and t.split(".")[-2:] in (["experts", p] for p in EXPERT_PARAMS) for t in v))


# ------------------------------------------------------------------------------------------ helpers
def _as_float32(x, what: str) -> np.ndarray:
    """Any array (JAX, numpy, ml_dtypes bf16) -> contiguous float32 numpy array (exact for bf16/fp16)."""
    try:
        arr = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - any conversion failure becomes a named error
        raise AdapterFormatError(f"{what}: cannot convert {type(x).__name__} to an array: {e}") from e
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise AdapterFormatError(f"{what}: expected a floating-point array, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr.astype(np.float32))
    if not np.all(np.isfinite(arr)):
        raise AdapterFormatError(f"{what}: contains NaN or Inf")
    return arr


def _target_matches(module: str, target_modules) -> bool:
    """PEFT's rule: a str is a full regex match on the module name; a list matches the name or a
    dotted suffix of it."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules)


def _pattern_value(patterns: Mapping, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


# --------------------------------------------------------------------------------------------- save
def save_peft_adapter(
    path,
    lora_params: Mapping[str, Mapping[str, Any]],
    *,
    rank: int,
    alpha: float,
    target_modules,
    base_model_name_or_path: Optional[str] = None,
    use_rslora: bool = False,
    dropout: float = 0.0,
    bias: str = "none",
    task_type: Optional[str] = "CAUSAL_LM",
    target_parameters: Optional[Sequence[str]] = None,
) -> str:
    """Write a PEFT LoRA adapter directory that ``peft.PeftModel.from_pretrained`` loads.

    lora_params: ``{module_name: {"lora_A": (rank, in), "lora_B": (out, rank)}}`` with JAX or numpy
        arrays; module names are the base model's (``model.layers.0.self_attn.q_proj``).
    target_modules: list of module-name suffixes (``["q_proj", "v_proj"]``) or one regex string,
        as in ``peft.LoraConfig``; every module in ``lora_params`` must match it, or PEFT would
        silently drop its weights on load.
    target_parameters: mixture-of-experts stacks (``["mlp.experts.gate_up_proj", ...]``): their
        entries in ``lora_params`` (``...mlp.experts.gate_up_proj``) hold stacks A (E, rank, in),
        B (E, out, rank), written in PEFT's ``target_parameters`` layout (`interop.experts`).

    Tensors are saved as **float32** whatever their dtype in memory (bf16/fp16 convert exactly);
    PEFT casts them to the model's dtype on load. The directory is written to a temporary
    directory beside ``path`` and renamed into place; if ``path`` already is a directory, the two
    files are each replaced atomically (weights first, config last) and other files there are left
    alone. On any error nothing is left behind. Returns ``path`` as a string.
    """
    path = os.fspath(path)
    config = _make_config(
        os.path.join(path, CONFIG_NAME), rank=rank, alpha=alpha, target_modules=target_modules,
        base_model_name_or_path=base_model_name_or_path, use_rslora=use_rslora,
        dropout=dropout, bias=bias, task_type=task_type, target_parameters=target_parameters,
    )
    tensors = _adapter_tensors(lora_params, rank=rank, target_modules=config["target_modules"],
                               target_parameters=config["target_parameters"])
    config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"

    if os.path.exists(path) and not os.path.isdir(path):
        raise AdapterFormatError(f"{path}: exists and is not a directory")
    if os.path.isdir(path):  # weights first, config last, each replaced atomically
        write_safetensors(os.path.join(path, WEIGHTS_NAME), tensors, metadata={"format": "pt"})
        write_text_atomic(os.path.join(path, CONFIG_NAME), config_text)
    else:
        with atomic_directory(path) as tmp:
            write_safetensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(config_text, encoding="utf-8")
    return path


def _make_config(config_file: str, *, rank, alpha, target_modules, base_model_name_or_path, use_rslora, dropout,
                 bias, task_type, target_parameters=None):
    """The adapter_config.json to write to `config_file`, its LoRA fields checked by
    `check_adapter_config` (numpy scalars count as the numbers they hold)."""
    def plain(v):
        return v.item() if isinstance(v, (np.integer, np.floating)) else v

    if isinstance(target_modules, Sequence) and not isinstance(target_modules, str):
        target_modules = list(target_modules)
    params = sorted(set(target_parameters)) if target_parameters else None
    if params is not None and not expert_targets(params):
        raise AdapterFormatError(f"{config_file}: target_parameters {params!r}: only mixture-of-experts stacks "
                                 f"(...experts.{' / ...experts.'.join(EXPERT_PARAMS)}) are supported")
    if params is not None and dropout:
        raise AdapterFormatError(f"{config_file}: lora_dropout {dropout} with target_parameters: PEFT's expert "
                                 "LoRA has no dropout (train the experts' LoRA with dropout 0)")
    check_adapter_config({"r": plain(rank), "lora_alpha": plain(alpha), "lora_dropout": float(dropout),
                          "target_modules": target_modules, "target_parameters": params}, config_file)
    targets: Any = target_modules if isinstance(target_modules, str) or target_modules is None \
        else (sorted(set(target_modules)) or None)
    if bias not in ("none", "all", "lora_only"):
        raise AdapterFormatError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    if bias != "none":
        raise AdapterFormatError(f"bias={bias!r} needs bias tensors in the adapter; only bias='none' is supported")
    alpha = plain(alpha)
    alpha = int(alpha) if float(alpha).is_integer() else float(alpha)
    # The LoraConfig fields PEFT 0.21 writes that affect loading, with PEFT's defaults for the rest.
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "target_modules": targets,
        "target_parameters": params,
        "exclude_modules": None,
        "bias": bias,
        "use_rslora": bool(use_rslora),
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layer_replication": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "loftq_config": {},
        "lora_bias": False,
    }


def _adapter_tensors(lora_params, *, rank: int, target_modules, target_parameters=None) -> dict:
    if not isinstance(lora_params, Mapping) or not lora_params:
        raise AdapterFormatError(
            f"lora_params must be a non-empty mapping module_name -> {{'lora_A', 'lora_B'}}, got {type(lora_params).__name__}"
        )
    tensors = {}
    for module, pair in lora_params.items():
        if not isinstance(module, str) or not module or module.startswith(KEY_PREFIX) or module.endswith("."):
            raise AdapterFormatError(f"invalid module name {module!r} (expected e.g. 'model.layers.0.self_attn.q_proj')")
        if not isinstance(pair, Mapping) or set(pair) != {"lora_A", "lora_B"}:
            got = sorted(pair) if isinstance(pair, Mapping) else type(pair).__name__
            raise AdapterFormatError(f"{module}: expected exactly the keys 'lora_A' and 'lora_B', got {got}")
        a = _as_float32(pair["lora_A"], f"{module}.lora_A")
        b = _as_float32(pair["lora_B"], f"{module}.lora_B")
        if a.ndim == 3 or b.ndim == 3:
            tensors.update(_expert_tensors(module, a, b, rank, target_parameters, lora_params))
            continue
        if target_modules is None or not _target_matches(module, target_modules):
            raise AdapterFormatError(
                f"{module}: not matched by target_modules={target_modules!r}; PEFT would ignore its weights"
            )
        if a.ndim != 2 or b.ndim != 2:
            raise AdapterFormatError(f"{module}: lora_A {a.shape} and lora_B {b.shape} must both be 2-D")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterFormatError(
                f"{module}: lora_A has shape {a.shape} (expected (r={rank}, in)) and lora_B has shape "
                f"{b.shape} (expected (out, r={rank}))"
            )
        tensors[f"{KEY_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{KEY_PREFIX}{module}.lora_B.weight"] = b
    return tensors


def _expert_tensors(module, a, b, rank, target_parameters, lora_params) -> dict:
    """The PEFT tensors of one expert stack's LoRA (A (E, r, in), B (E, out, r))."""
    root, _, param = module.rpartition(".")
    if param not in EXPERT_PARAMS or not root.endswith("experts"):
        raise AdapterFormatError(f"{module}: 3-D LoRA factors belong to mixture-of-experts stacks "
                                 f"(...experts.{' / ...experts.'.join(EXPERT_PARAMS)})")
    if not target_parameters or not any(module == t or module.endswith("." + t) for t in target_parameters):
        raise AdapterFormatError(f"{module}: not matched by target_parameters={target_parameters!r}; PEFT would "
                                 "ignore its weights")
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != rank or b.shape[2] != rank:
        raise AdapterFormatError(f"{module}: lora_A {a.shape} and lora_B {b.shape}: expected (E, r={rank}, in) and "
                                 f"(E, out, r={rank})")
    siblings = [p for p in EXPERT_PARAMS if f"{root}.{p}" in lora_params]
    where = peft_param_modules(siblings)[param]
    name = f"{root}.{where}" if where else root
    pa, pb = to_peft_factors(a, b)
    return {f"{KEY_PREFIX}{name}.lora_A.weight": pa, f"{KEY_PREFIX}{name}.lora_B.weight": pb}


def _expert_params(found: dict, config: dict, weights_file: str) -> dict:
    """PEFT's expert LoRA tensors (modules ``...experts`` / ``...experts.base_layer``) as
    {``...experts.gate_up_proj``: {"lora_A": (E, r, in), "lora_B": (E, out, r)}}; `found` loses them."""
    targets = config.get("target_parameters")
    if not expert_targets(targets):
        return {}
    params = [p for p in EXPERT_PARAMS if any(t.split(".")[-1] == p for t in targets)]
    where = {v: k for k, v in peft_param_modules(params).items()}
    r = config["r"]
    out = {}
    for module in sorted(found):
        root = module[: -len(".base_layer")] if module.endswith(".base_layer") else module
        if not root.endswith(".experts") and root != "experts":
            continue
        param = where.get("base_layer" if module.endswith(".base_layer") else "")
        pair = found.pop(module)
        if param is None or set(pair) != {"lora_A", "lora_B"}:
            raise AdapterFormatError(f"{weights_file}: {module}: expert LoRA tensors that target_parameters "
                                     f"{targets!r} does not explain (or a lora_A without its lora_B)")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % r or b.shape[1] != a.shape[0]:
            raise AdapterFormatError(f"{weights_file}: {module}: lora_A {a.shape} and lora_B {b.shape} are not "
                                     f"(r*E, in) and (out, r*E) with r={r}")
        a3, b3 = from_peft_factors(a, b, a.shape[0] // r)
        out[f"{root}.{param}"] = {"lora_A": a3, "lora_B": b3}
    return out


# --------------------------------------------------------------------------------------------- load
def load_peft_adapter(path):
    """Read a PEFT LoRA adapter directory -> ``(lora_params, adapter_config)``.

    lora_params: ``{module_name: {"lora_A": np.ndarray (r, in), "lora_B": np.ndarray (out, r)}}``
        in the dtype stored in the file (float32/float16, or ``ml_dtypes.bfloat16`` for BF16).
    adapter_config: the parsed ``adapter_config.json`` dict, as written.

    Raises AdapterFormatError (a ValueError) naming the file and key for: a missing or malformed
    config (a field of the wrong type or range), a peft_type other than LORA, an option jqlora
    cannot apply ("not supported: <option> in <file>", see `UNSUPPORTED_OPTIONS`; rank_pattern
    and alpha_pattern are read), a missing weights file, an unknown tensor key, a tensor holding
    NaN or Inf, a lora_A without its lora_B (or the reverse), and ranks that contradict ``r`` /
    ``rank_pattern``.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise AdapterFormatError(f"{path}: not a directory (expected a PEFT adapter directory)")
    config = _read_config(os.path.join(path, CONFIG_NAME))
    weights_file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_file):
        hint = " (adapter_model.bin is a torch pickle: re-save it with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterFormatError(f"{weights_file}: missing{hint}")
    tensors = _read_safetensors(weights_file)

    found: dict[str, dict[str, np.ndarray]] = {}
    adapters = set()
    for key, arr in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise AdapterFormatError(f"{weights_file}: unknown tensor key {key!r}: {_unknown_key_reason(key)}")
        module, which = m.group("module"), m.group("which")
        adapters.add(m.group("adapter"))
        if which in found.setdefault(module, {}):
            raise AdapterFormatError(f"{weights_file}: {module}.{which} appears twice (key {key!r})")
        found[module][which] = arr
    if len(adapters) > 1:
        raise AdapterFormatError(
            f"{weights_file}: tensors of several adapters {sorted(a or '<unnamed>' for a in adapters)}; expected one"
        )

    r = config["r"]
    rank_pattern = config.get("rank_pattern") or {}
    lora_params = _expert_params(found, config, weights_file)
    for module in sorted(found):
        pair = found[module]
        for which, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if which in pair and other not in pair:
                raise AdapterFormatError(
                    f"{weights_file}: {KEY_PREFIX}{module}.{which}.weight has no matching {other} tensor"
                )
        a, b = pair["lora_A"], pair["lora_B"]
        expected_r = _pattern_value(rank_pattern, module, r)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != expected_r or b.shape[1] != expected_r:
            raise AdapterFormatError(
                f"{weights_file}: {module}: lora_A has shape {a.shape} and lora_B has shape {b.shape}; "
                f"expected (r, in) and (out, r) with r={expected_r} from {CONFIG_NAME}"
            )
        lora_params[module] = {"lora_A": a, "lora_B": b}
    if not lora_params:
        raise AdapterFormatError(f"{weights_file}: holds no LoRA tensors")
    return lora_params, config


def _unknown_key_reason(key: str) -> str:
    """What a tensor key that is not plain LoRA most likely belongs to."""
    expected = "expected 'base_model.model.<module>.lora_A.weight' or '...lora_B.weight'"
    if not key.startswith(KEY_PREFIX):
        return f"{expected} (the key lacks the {KEY_PREFIX!r} prefix)"
    for marker, what in ((".lora_magnitude_vector", "DoRA (use_dora)"),
                         (".lora_embedding_", "embedding LoRA"),
                         (".modules_to_save.", "modules_to_save"),
                         (".trainable_tokens_", "trainable_token_indices")):
        if marker in key:
            return f"not supported: {what}"
    if re.search(r"\.lora_B(\.[^.]+)?\.bias$", key):
        return "not supported: lora_bias"
    return (f"{expected}; a tensor of the base model itself (modules_to_save, a trained bias) is not "
            "supported")


def _read_config(config_file: str) -> dict:
    config = read_json_object(
        config_file, AdapterFormatError, missing="{path}: missing (not a PEFT adapter directory)",
        invalid="{path}: malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterFormatError(f"{config_file}: peft_type is {peft_type!r}; only 'LORA' adapters are supported")

    def bad(key, want):
        return AdapterFormatError(f"{config_file}: {key!r} must be {want}, got {config.get(key)!r}")

    check_adapter_config(config, config_file)
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise bad("base_model_name_or_path", "a string or null")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise bad(key, "an object")
        for k, v in pattern.items():
            try:
                re.compile(k)
            except re.error as e:
                raise AdapterFormatError(f"{config_file}: {key} key {k!r} is not a valid regex: {e}") from None
            if key == "rank_pattern":
                ok, want = isinstance(v, int) and v > 0, "a positive integer"
            else:
                ok, want = isinstance(v, (int, float)) and math.isfinite(v), "a finite number"
            if isinstance(v, bool) or not ok:
                raise AdapterFormatError(f"{config_file}: {key}[{k!r}] is {v!r}, expected {want}")
    unsupported(config, config_file, per_module=False)
    return config


def _read_safetensors(weights_file: str) -> dict:
    try:
        with SafetensorsFile(weights_file) as f:
            for key in f.keys():
                dtype = f.info(key).dtype
                if dtype not in _FLOAT_DTYPES:
                    raise AdapterFormatError(
                        f"{weights_file}: tensor {key!r} has dtype {dtype}; expected F32, F16, BF16 or F64")
            tensors = {key: f.get(key, copy=True) for key in f.keys()}
    except AdapterFormatError:
        raise
    except CheckpointError as e:  # the message names the file (and the tensor)
        raise AdapterFormatError(f"not a valid safetensors file: {e}") from e
    for key, arr in tensors.items():
        finite = np.isfinite(arr.astype(np.float32, copy=False))  # adapters are small: a host pass
        if not finite.all():
            i = int(np.flatnonzero(~finite.reshape(-1))[0])
            raise AdapterFormatError(f"{weights_file}: tensor {key!r} holds NaN or Inf (element {i} of {arr.size} "
                                     f"is {arr.reshape(-1)[i]}); the adapter is corrupt")
    return tensors


__all__ = ["save_peft_adapter", "load_peft_adapter", "check_adapter_config", "AdapterFormatError", "CONFIG_NAME",
           "WEIGHTS_NAME"]
