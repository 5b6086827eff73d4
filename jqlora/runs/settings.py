"""`RunSettings`: everything a training run is given, typed; the one writer and reader of the run
record, and the layering of a record, a config file and flags into one run's settings."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Optional, Union

from jqlora.runs.config_file import load_config_file
from jqlora.runs.flags import train_field_types
from jqlora.runs.layering import (CLI_DEFAULTS, check_resume, drop_derived, keep_the_later_of_each_pair,
                                  layer_from_file, layer_from_flags, refuse_both)
from jqlora.runs.parts import LORA_KEYS, MODEL_KEYS, OUTPUT_KEYS, LoraSettings, ModelSettings, OutputSettings
from jqlora.train.config import TrainConfig
from jqlora.train.run_record import RUN_FILE, RUN_FORMAT, RUN_VERSION, write_run_record


@dataclasses.dataclass
class RunSettings:
    """Everything a training run is given: the model, the LoRA, the TrainConfig and the outputs.

    `lora_given` (not part of the record, not compared) names the LoRA settings that a config
    file or a flag gave, as opposed to defaults or a resumed run's record: an `init_adapter`'s
    own LoRA settings must agree with them.
    """

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    output: OutputSettings = dataclasses.field(default_factory=OutputSettings)
    lora_given: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @property
    def out_dir(self) -> Path:
        """The run directory (`TrainConfig.out_dir`)."""
        return Path(self.train.out_dir)

    @property
    def adapter_dir(self) -> Path:
        """Where the PEFT adapter is written: `adapter_out`, else <out_dir>/adapter."""
        return Path(self.output.adapter_out or self.out_dir / "adapter")

    def absolute(self) -> "RunSettings":
        """A copy whose file and folder settings are absolute paths (made from the working
        directory), so that the record works from any directory (`--resume`, export): the
        model, init_adapter, adapter_out, out_dir, and the TrainConfig's data_path,
        eval_data_path, tokenizer_path and chat_template. A data or model setting that is not
        an existing path (a Hugging Face id) stays as it is."""
        def existing(p):
            return os.path.abspath(p) if isinstance(p, (str, os.PathLike)) and os.path.exists(p) else p

        def always(p):
            return os.path.abspath(p) if isinstance(p, (str, os.PathLike)) else p

        m, t = self.model, self.train
        return dataclasses.replace(
            self, model=dataclasses.replace(m, model=existing(m.model), init_adapter=existing(m.init_adapter)),
            output=dataclasses.replace(self.output, adapter_out=always(self.output.adapter_out)),
            train=dataclasses.replace(t, out_dir=always(t.out_dir), data_path=existing(t.data_path),
                                      eval_data_path=existing(t.eval_data_path),
                                      tokenizer_path=existing(t.tokenizer_path),
                                      chat_template=existing(t.chat_template)))

    # ---------------------------------------------------------------------------- layering
    @classmethod
    def layered(cls, record: Optional["RunSettings"] = None, file: Optional[Mapping] = None,
                flags: Optional[Mapping] = None, *, file_name: str = "config file",
                run_dir: Optional[str] = None) -> "RunSettings":
        """The settings of a run from three layers, each overriding the one before: the stored
        `record` of the run being resumed, a config `file`'s dict and `flags`, over
        `CLI_DEFAULTS` and the dataclasses' defaults.

        A file and the flags are flat or nested as `jqlora train --config` takes them (top-level
        model and output keys, a `lora` table, TrainConfig fields at the top or in a `train`
        table); a flag's text for a TrainConfig field is parsed by the field's type. Within one
        layer, a pair of EITHER_OR (epochs/steps, warmup_ratio/warmup) may not both be given;
        across layers the later one wins. A record's (or a record given as the file's) `steps`
        and `warmup` are dropped where its `epochs`/`warmup_ratio` count them. With a `record`,
        the model, compute dtype, quantization, optimizer and LoRA shape (`RESUME_FIXED`,
        `RESUME_FIXED_LORA`) must stay as the record has them.

        Args:
          record: the stored settings of the run being resumed (`RunSettings.read`), or None.
          file: a config file's dict (`load_config_file`), or None.
          flags: {setting: value} for the flags given (TrainConfig fields, LoRA, model and
            output keys by name).
          file_name: the file, as errors name it.
          run_dir: the run being resumed, as errors name it (default: the record's out_dir).

        Raises:
          RunError: an unknown key, a value a flag cannot parse, both of a pair in one layer, or
            a resumed run's fixed setting changed.
        """
        file_layer = None if file is None else cls._config_layer(file, file_name)
        return cls._combine(record, file_layer, layer_from_flags(flags or {}), run_dir)

    @classmethod
    def resolve(cls, config_file: Union[str, os.PathLike, None] = None,
                flags: Optional[Mapping] = None) -> "RunSettings":
        """`jqlora train`'s settings: `layered` over the config file at `config_file` and `flags`;
        with `resume` set (by a flag, else by the file) and a record in the run directory
        (`out_dir` of the flags, else of the file, else TrainConfig's), over that record too.

        Raises:
          RunError: as `layered`; a config file or record that cannot be read.
        """
        file_layer = None
        if config_file is not None:
            file_layer = cls._config_layer(load_config_file(config_file), str(config_file))
        flag_layer = layer_from_flags(flags or {})
        resume = flag_layer.get("resume")
        if resume is None and file_layer is not None:
            resume = file_layer.get("resume")
        run_dir = flag_layer.get("out_dir") or (file_layer or {}).get("out_dir") or TrainConfig().out_dir
        record = None
        if resume and (Path(run_dir) / RUN_FILE).is_file():
            record = cls.read(Path(run_dir) / RUN_FILE)
        return cls._combine(record, file_layer, flag_layer, run_dir)

    @staticmethod
    def _config_layer(data: Mapping, where: str) -> dict:
        is_record = data.get("format") == RUN_FORMAT  # a run record given as a config file
        layer = layer_from_file(data, where, record=is_record)
        if is_record:
            drop_derived(layer)
        refuse_both(layer, lambda k: f"{k} in {where}")
        return layer

    @classmethod
    def _combine(cls, record, file_layer, flag_layer, run_dir) -> "RunSettings":
        layers = []
        stored = None
        if record is not None:
            stored = record.to_record()
            layer = layer_from_file(stored, RUN_FILE, record=True)
            drop_derived(layer)
            layers.append(layer)
            run_dir = run_dir or record.train.out_dir
        if file_layer is not None:
            layers.append(file_layer)
        layers.append(flag_layer)
        merged = dict(CLI_DEFAULTS)
        for layer in layers:
            merged.update(layer)
            keep_the_later_of_each_pair(merged, layer)
        given = tuple(k for k in LORA_KEYS if k in (file_layer or {}) or k in flag_layer)
        if stored is not None:
            check_resume(merged, record.lora, stored, run_dir)
        return cls._build(merged, lora_given=given)

    @classmethod
    def _build(cls, flat: Mapping, lora_given: tuple = ()) -> "RunSettings":
        def part(keys):
            return {k: flat[k] for k in keys if k in flat}

        return cls(model=ModelSettings(**part(MODEL_KEYS)), lora=LoraSettings(**part(LORA_KEYS)),
                   train=TrainConfig(**part(train_field_types())), output=OutputSettings(**part(OUTPUT_KEYS)),
                   lora_given=lora_given)

    # ----------------------------------------------------------------------------- records
    @classmethod
    def from_record(cls, record: Mapping, where: str = RUN_FILE) -> "RunSettings":
        """The settings a run record holds (inverse of `to_record`); absent keys take the
        dataclasses' defaults.

        Raises:
          RunError: an unknown key or a `lora`/`train` entry that is not a table, named with `where`.
        """
        return cls._build(layer_from_file(record, where, record=True))

    def to_record(self) -> dict:
        """The run record (JSON types only; its keys: `jqlora.runs`)."""
        m = self.model
        rec = {"format": RUN_FORMAT, "version": RUN_VERSION, "model": None if m.model is None else str(m.model),
               "compute_dtype": m.compute_dtype, "backend": m.backend}
        if m.attention is not None:
            rec["attention"] = m.attention
        if m.quantize:
            rec["quantize"] = m.quantize
        if m.quantize_experts != ModelSettings.quantize_experts:
            rec["quantize_experts"] = m.quantize_experts
        if m.init_adapter:
            rec["init_adapter"] = str(m.init_adapter)
        if self.output.adapter_out:
            rec["adapter_out"] = str(self.output.adapter_out)
        rec["lora"] = self.lora.to_record()
        rec["train"] = dataclasses.asdict(self.train)
        return rec

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> "RunSettings":
        """Read a run record file (`jqlora_run.json`).

        Raises:
          RunError: the file cannot be read or parsed, or holds an unknown key (named with its path).
        """
        return cls.from_record(load_config_file(path), str(path))

    def write_record(self, *, skipped_batches: Optional[int] = None) -> Path:
        """Write the run record atomically to `<out_dir>/jqlora_run.json` (the directory is created
        if missing); returns its path.

        Args:
          skipped_batches: recorded when given: steps' batches skipped for having no supervised token.

        Raises:
          OSError: the write failed; its filename is the record's path.
        """
        rec = self.to_record()
        if skipped_batches is not None:
            rec["skipped_batches"] = skipped_batches
        return write_run_record(self.out_dir, rec)
