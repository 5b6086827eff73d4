"""NNX LoRA over frozen quantized weights: `QLoRALinear`, `LoraConfig`, `apply_lora`.

The names below are the public API; helpers (``lora_scale``, ``peft_lora_a_init``,
``module_name_matches``, ...) stay importable from :mod:`jqlora.lora.linear` and
:mod:`~jqlora.lora.config`.
"""
from jqlora.lora.apply import (apply_lora, linear_names, lora_params_by_module, lora_state_by_module, named_linears,
                               set_lora_params)
from jqlora.lora.config import DEFAULT_TARGETS, LoraConfig
from jqlora.lora.linear import FrozenParam, QLoRALinear, QuantizedBase

__all__ = [
    "QLoRALinear", "LoraConfig", "apply_lora", "lora_params_by_module", "set_lora_params",
    "named_linears", "QuantizedBase", "FrozenParam", "DEFAULT_TARGETS", "linear_names", "lora_state_by_module",
]
