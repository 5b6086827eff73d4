"""`LoraConfig` and the module-name matching rules (PEFT's `target_modules` semantics)."""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence, Union

from jqlora.errors import SettingError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused projections: one LoRA each, reached by the names of the projections they hold.
FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj")
# PEFT's shorthand: every linear layer except the output layer (the LM head).
ALL_LINEAR = "all-linear"
OUTPUT_LAYER = "lm_head"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which linear layers get LoRA, and its hyper-parameters.

    target_modules: a sequence of names; an entry matches a module whose dotted name equals it
      or ends with "." + entry (PEFT's rule: "q_proj" matches "model.layers.0.self_attn.q_proj",
      "self_attn.q_proj" too). A single string is a regex that must match the *whole* dotted name
      (`re.fullmatch`), e.g. r".*\\.(q|v)_proj"; "all-linear" (PEFT's shorthand) is every linear
      layer except the LM head.
    scale = alpha / rank, or alpha / sqrt(rank) with use_rslora.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Union[str, Sequence[str]] = DEFAULT_TARGETS
    use_rslora: bool = False

    def __post_init__(self):
        # the dataclass's own fields, as settings give them; a PEFT file's are checked by
        # interop.peft_adapter.check_adapter_config (jqlora.lora imports no interop)
        try:
            rank, dropout = int(self.rank), float(self.dropout)
        except (TypeError, ValueError) as e:  # e.g. a rank of "abc" in a config file
            raise SettingError(str(e)) from None
        if rank <= 0:
            raise SettingError(f"LoraConfig.rank must be positive, got {self.rank}")
        if not 0.0 <= dropout < 1.0:
            raise SettingError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise SettingError("LoraConfig.target_modules is empty")

    def matches(self, name: str) -> bool:
        return module_name_matches(name, self.target_modules)


def module_name_matches(name: str, targets: Union[str, Sequence[str]]) -> bool:
    """Whether the dotted module name `name` is one of `targets` (see `LoraConfig`)."""
    if targets == ALL_LINEAR:
        return name.rsplit(".", 1)[-1] != OUTPUT_LAYER
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def peft_target_modules(targets: Union[str, Sequence[str]], module_names: Sequence[str]):
    """`targets` as written in a PEFT adapter_config.json: "all-linear" becomes the sorted last
    components of the modules that have LoRA (what PEFT itself saves); a list is kept, with the
    last components of LoRA modules it does not name added (fused layers); a regex is kept.

    Args:
      targets: a LoraConfig's target_modules.
      module_names: the dotted names of the modules with LoRA.
    """
    leaves = sorted({n.rsplit(".", 1)[-1] for n in module_names})
    if targets == ALL_LINEAR:
        return leaves
    if isinstance(targets, str):
        return targets
    # a fused layer (Phi-3's qkv_proj) taken by the name of a projection it holds: PEFT needs its own
    return list(targets) + [n for n in leaves if n in FUSED_PROJECTIONS and n not in targets]


def lora_differences(requested: dict, adapter) -> list[tuple[str, object, object]]:
    """The LoRA settings asked for that differ from those of a LoRA being continued (an adapter,
    or a resumed run), as (key, asked, has) triples; empty when they agree. Values compare as
    numbers (rank, alpha), as sets of names ("all-linear" is the Llama family's projections) and
    as booleans (use_rslora); a value None on either side is not compared.

    Args:
      requested: the settings asked for ({"rank", "alpha", "target_modules", "use_rslora"}; any
        subset).
      adapter: a LoraConfig, or anything with those attributes.
    """
    def norm(key, v):
        if key == "target_modules":
            if v == ALL_LINEAR:  # what all-linear resolves to in the Llama-family models
                v = DEFAULT_TARGETS
            return v if isinstance(v, str) else tuple(sorted(v))
        if key in ("rank", "alpha"):
            try:
                return float(v)
            except (TypeError, ValueError):
                return v
        return bool(v)

    out = []
    for key in ("rank", "alpha", "target_modules", "use_rslora"):
        mine, theirs = requested.get(key), getattr(adapter, key)
        if mine is not None and theirs is not None and norm(key, mine) != norm(key, theirs):
            out.append((key, mine, theirs))
    return out


def lora_conflicts(requested: dict, adapter: LoraConfig) -> list[str]:
    """The LoRA settings a user asked for that an adapter being continued does not have, as
    "key: asked X, adapter has Y" strings (empty when they agree; `lora_differences`).

    Args:
      requested: the settings given explicitly ({"rank", "alpha", "target_modules",
        "use_rslora"}; any subset).
      adapter: the adapter's LoraConfig.
    """
    def show(key, v):
        return (v if isinstance(v, str) else ",".join(v)) if key == "target_modules" else v

    return [f"{key}: asked {show(key, mine)}, adapter has {show(key, theirs)}"
            for key, mine, theirs in lora_differences(requested, adapter)]
