"""The parts of a run's settings besides its TrainConfig: the model (`ModelSettings`), the LoRA
(`LoraSettings`) and the outputs (`OutputSettings`), and the keys each part takes."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass
class ModelSettings:
    """The base model and how it runs. None in `compute_dtype` is the machine's default (float32
    on CPU, bfloat16 on a GPU); None in `attention` is the loader's default (`jqlora train`
    layers in "auto"); `quantize` ("nf4", "fp4", "int8") quantizes a plain checkpoint at load;
    `quantize_experts` is the format of dense mixture-of-experts weights (`load_causal_lm`'s:
    "auto", "none", "nf4", "fp4", "int8"); `init_adapter` is a PEFT adapter to start from."""

    model: Optional[str] = None
    compute_dtype: Optional[str] = None
    backend: str = "auto"
    attention: Optional[str] = None
    quantize: Optional[str] = None
    quantize_experts: str = "auto"
    init_adapter: Optional[str] = None


@dataclasses.dataclass
class LoraSettings:
    """The fields of `jqlora.lora.LoraConfig`, as a run gives them: None is LoraConfig's default
    (for `target_modules`: every attention and MLP projection). `target_modules` is a tuple of
    names or one string (a regex on the full dotted name, or "all-linear")."""

    rank: Optional[int] = 16
    alpha: Optional[float] = 32.0
    dropout: Optional[float] = 0.0
    target_modules: Union[str, tuple[str, ...], None] = None
    use_rslora: Optional[bool] = False

    @classmethod
    def from_config(cls, config) -> "LoraSettings":
        """The settings of a `jqlora.lora.LoraConfig`."""
        return cls(rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                   target_modules=config.target_modules, use_rslora=config.use_rslora)

    def to_config(self):
        """The `jqlora.lora.LoraConfig` (imports jqlora.lora, which imports jax).

        Raises:
          jqlora.errors.SettingError: a value of the wrong type or out of range (rank, dropout, no targets).
        """
        from jqlora.lora.config import LoraConfig

        return LoraConfig(**{k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    def to_record(self) -> dict:
        """The `lora` table of a run record (JSON types only)."""
        targets = self.target_modules
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": targets if targets is None or isinstance(targets, str) else list(targets),
                "use_rslora": self.use_rslora}


@dataclasses.dataclass
class OutputSettings:
    """Where the PEFT adapter goes at the end (None: <out_dir>/adapter). The run directory itself
    is `TrainConfig.out_dir` (`RunSettings.out_dir`): training writes its checkpoints there."""

    adapter_out: Optional[str] = None


MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelSettings))
LORA_KEYS = tuple(f.name for f in dataclasses.fields(LoraSettings))
OUTPUT_KEYS = tuple(f.name for f in dataclasses.fields(OutputSettings))
