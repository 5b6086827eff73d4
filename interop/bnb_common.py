"""Pieces both directions of the bitsandbytes checkpoint code share: config.json reading, the
(out, in) shapes a Llama-family config implies for its linear layers, and which modules
``llm_int8_skip_modules`` leaves unquantized.

Exists so that interop.bnb_load and interop.bnb_save do not import each other, and so that
code which only needs the config or the expected shapes does not pull in the loader.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from interop.errors import CheckpointError
from interop.json_io import read_json_object

CONFIG_FILE = "config.json"
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})
_PROJ_RE = re.compile(r"(?:^|\.)layers\.\d+\.(?:self_attn\.(qkv|[qkvo])_proj|mlp\.(gate_up|gate|up|down)_proj)$")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_config(path, *, unwrap: bool = True) -> dict:
    """Parse ``config.json`` of a checkpoint directory: the one reader of that file.

    Args:
      path: the checkpoint directory.
      unwrap: give the language model's config. A file whose top level holds a ``text_config``
        object (a multimodal wrapper such as transformers' ``Gemma3ForConditionalGeneration``
        config) then gives one flat dict: every key of ``text_config`` (``model_type``,
        ``vocab_size``, the sizes...), plus the outer keys it does not set
        (``quantization_config``, ``torch_dtype``, ``architectures``, ``vision_config``...);
        ``text_config`` itself is left out, and where both set a key, ``text_config``'s value is
        kept. Any other file is returned as it is. False: the file's object as it is (what a
        writer copies back).

    Returns:
      A fresh dict (the caller may change it).

    Raises:
      CheckpointError: naming the file: missing, not UTF-8 JSON, or a top level that is not an
        object.
    """
    config = read_json_object(
        Path(path) / CONFIG_FILE, CheckpointError,
        missing=f"{{path}}: missing (a checkpoint directory needs {CONFIG_FILE})",
        unreadable="{path}: not valid JSON ({error})",
        not_object="{path}: top level is a JSON {type}, expected an object")
    text = config.get("text_config")
    if unwrap and isinstance(text, dict):
        config = {**{k: v for k, v in config.items() if k != "text_config"}, **text}
    return config


# The parts of a multimodal checkpoint (Gemma 3) outside its text model, whose shapes the text config
# does not describe.
NON_TEXT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def expected_linear_shape(config: dict, module: str):
    """(out, in) a Llama-family config implies for `module`, or None when it says nothing."""
    if config.get("model_type") not in LLAMA_FAMILY:
        return None
    if module.startswith(NON_TEXT_PREFIXES):  # a multimodal checkpoint's vision tower: not this config's
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
        # Phi-3's fused projections: q, k, v rows stacked; gate rows, then up rows
        "qkv": ((heads + 2 * kv) * head_dim, hidden) if heads and kv and head_dim else None,
        "gate_up": (2 * inter, hidden) if inter else None,
    }
    return shapes[attn or mlp]


DEFAULT_SKIP_MODULES = ("lm_head",)  # transformers' default for a causal LM (its output embedding)


def skip_patterns(config_path, quantization_config: dict) -> tuple[str, ...]:
    """The module patterns bitsandbytes leaves dense: ``llm_int8_skip_modules``, or transformers'
    default (lm_head) when it is unset. A given list replaces the default, so a list without
    "lm_head" quantizes lm_head. CheckpointError (naming `config_path`) if it is not a list of
    strings."""
    skip = quantization_config.get("llm_int8_skip_modules")
    if skip is None:
        return DEFAULT_SKIP_MODULES
    if not isinstance(skip, list) or not all(isinstance(p, str) and p for p in skip):
        raise CheckpointError(f"{config_path}: quantization_config.llm_int8_skip_modules is {skip!r}, expected a "
                              "list of module names")
    return tuple(skip)


def is_skipped(module: str, patterns) -> bool:
    """True if bitsandbytes leaves `module` dense under `patterns`. transformers' rule
    (quantizers_utils.should_convert_module): a pattern matches the name from its start up to a
    module boundary, as a regex ("model.layers.1.mlp" covers "model.layers.1.mlp.down_proj", not
    "model.layers.11.mlp..."), or the name ends with it ("o_proj" covers every layer's o_proj)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for p in patterns:
        if module.endswith(p):
            return True
        try:
            if re.match(rf"(?:{p}){boundary}", module):
                return True
        except re.error:
            if module == p or module.startswith(p + "."):
                return True
    return False
