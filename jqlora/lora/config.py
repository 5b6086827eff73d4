"""`LoraConfig` and the module-name matching rules (PEFT's `target_modules` semantics)."""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence, Union

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which linear layers get LoRA, and its hyper-parameters.

    target_modules: a sequence of names; an entry matches a module whose dotted name equals it
      or ends with "." + entry (PEFT's rule: "q_proj" matches "model.layers.0.self_attn.q_proj",
      "self_attn.q_proj" too). A single string is a regex that must match the *whole* dotted name
      (`re.fullmatch`), e.g. r".*\\.(q|v)_proj".
    scale = alpha / rank, or alpha / sqrt(rank) with use_rslora.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Union[str, Sequence[str]] = DEFAULT_TARGETS
    use_rslora: bool = False

    def __post_init__(self):
        if int(self.rank) <= 0:
            raise ValueError(f"LoraConfig.rank must be positive, got {self.rank}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise ValueError("LoraConfig.target_modules is empty")

    def matches(self, name: str) -> bool:
        return module_name_matches(name, self.target_modules)


def module_name_matches(name: str, targets: Union[str, Sequence[str]]) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)
