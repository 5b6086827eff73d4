"""NNX LoRA over frozen quantized weights: `QLoRALinear`, `LoraConfig`, `apply_lora`."""
from jqlora.lora.apply import apply_lora, lora_params_by_module, named_linears, set_lora_params
from jqlora.lora.config import DEFAULT_TARGETS, LoraConfig, module_name_matches
from jqlora.lora.linear import (FrozenParam, QLoRALinear, QuantizedBase, base_shape, lora_scale,
                                peft_lora_a_init)

__all__ = [
    "QLoRALinear", "QuantizedBase", "FrozenParam", "LoraConfig", "DEFAULT_TARGETS", "apply_lora",
    "lora_params_by_module", "set_lora_params", "named_linears", "module_name_matches", "lora_scale",
    "peft_lora_a_init", "base_shape",
]
