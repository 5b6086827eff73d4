"""A training run's settings (`RunSettings`), its directory and record, and export of its
checkpoints to PEFT.

A run directory (the `out_dir` of `jqlora train` or of the demo) holds `checkpoints/step_*`,
loss.csv / loss.png and the run record `jqlora_run.json`. The record says what a checkpoint alone
does not: the base model, the compute dtype, the LoRA settings and the TrainConfig. It is written
once every check of a run has passed, before its first step (so a partial run can still be
exported, and a refused or failed command leaves the record of the run already there untouched),
and again at the end. Its keys:

    format "jqlora-run", version 1, model, compute_dtype, backend, attention (optional),
    quantize (optional), init_adapter (optional), adapter_out (optional),
    lora {rank, alpha, dropout, target_modules, use_rslora}, train {TrainConfig fields},
    skipped_batches (optional: steps' batches skipped for having no supervised token)

`RunSettings` is the typed form of a record, and the one writer (`RunSettings.write_record`) and
reader (`RunSettings.read`) of the file. `RunSettings.layered` merges the settings of a run from
three layers, each overriding the one before: the stored record (when resuming), a config file,
and flags (`jqlora train`).

One process writes to a run directory at a time (`jqlora.train.lock.lock_run_dir`).

Config files (`jqlora train --config`) and the record are JSON or TOML objects read by
`load_config_file`. Errors are `RunError`, a `jqlora.errors.Error` and a ValueError whose message
names the file, directory or setting. Nothing heavy is imported at module level: the CLI imports
this before jax.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from jqlora.errors import Error
from jqlora.train.config import TrainConfig
from jqlora.train.run_record import RUN_FILE, RUN_FORMAT, RUN_VERSION, write_run_record


class RunError(Error, ValueError):
    """A run directory, run record, checkpoint choice, setting or config file that cannot be used;
    the message names the file, directory or setting."""


def load_config_file(path: str | os.PathLike) -> dict:
    """Read a JSON (.json) or TOML (.toml) config file, or a run record, into a dict.

    Args:
      path: the file; a .toml suffix selects TOML, anything else is read as JSON.

    Raises:
      RunError: the file cannot be read, does not parse, or its top level is not an object/table.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RunError(f"{p}: cannot read config file: {e}") from None
    if p.suffix.lower() == ".toml":
        import tomllib

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise RunError(f"{p}: invalid TOML: {e}") from None
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"{p}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RunError(f"{p}: top level must be an object/table, got {type(data).__name__}")
    return data


# ------------------------------------------------------------------------------------- settings
@dataclasses.dataclass
class ModelSettings:
    """The base model and how it runs. None in `compute_dtype` is the machine's default (float32
    on CPU, bfloat16 on a GPU); None in `attention` is the loader's default (`jqlora train`
    layers in "auto"); `quantize` ("nf4", "fp4", "int8") quantizes a plain checkpoint at load;
    `init_adapter` is a PEFT adapter to start from."""

    model: Optional[str] = None
    compute_dtype: Optional[str] = None
    backend: str = "auto"
    attention: Optional[str] = None
    quantize: Optional[str] = None
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
_TOP_KEYS = MODEL_KEYS + OUTPUT_KEYS  # the keys of a config file's top level besides TrainConfig's
_RECORD_ONLY = ("format", "version", "skipped_batches")  # what a run record adds
# `jqlora train`'s defaults where they differ from the dataclasses'
CLI_DEFAULTS = {"attention": "auto", "remat": "auto"}
# pairs of settings where one replaces the other: a layer of settings gives at most one of each
EITHER_OR = (("epochs", "steps"), ("warmup_ratio", "warmup"))
# what a resumed run must keep: the base, its numerics and the shape of the LoRA being trained
RESUME_FIXED = ("model", "compute_dtype", "quantize")
RESUME_FIXED_LORA = ("rank", "alpha", "target_modules", "use_rslora")


@functools.cache
def train_field_types() -> dict[str, Any]:
    """TrainConfig's field name -> its type (`typing.get_type_hints`: `int`, `float | None`,
    `bool | str`, `Any`), in field order."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _type_args(hint) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union \
        else (hint,)


def type_name(hint) -> str:
    """A TrainConfig field type as its annotation spells it: "int", "float | None", "Any"."""
    if hint is Any:
        return "Any"
    return " | ".join("None" if a is type(None) else a.__name__ for a in _type_args(hint))


def is_switch(hint) -> bool:
    """Whether a TrainConfig field is an on/off switch (`bool` or `bool | None`): a --x/--no-x flag."""
    return set(_type_args(hint)) - {type(None)} == {bool}


def flag_name(key: str) -> str:
    """The flag of a setting: `seq_len` -> `--seq-len`."""
    return "--" + key.replace("_", "-")


def parse_flag(key: str, text: str):
    """The value of the flag of TrainConfig field `key` from its text, by the field's type:
    `none`/`null` is None where the field may be None; true/false, yes/no, on/off, 1/0 where it is
    a bool; an int or float where it is one; the text where it may be a string. `bos`/`eos`
    (`Any`): 'auto', true/false, none, a token id or a token string.

    Raises:
      RunError: the text is none of what the field takes ("--seq-len: cannot parse 'x' as int").
    """
    hint = train_field_types()[key]
    low = text.lower()
    if hint is Any:
        if low in ("none", "null", "false"):
            return None
        if low == "true":
            return True
        return int(text) if text.lstrip("-").isdigit() else text
    kinds = _type_args(hint)
    if type(None) in kinds and low in ("none", "null"):
        return None
    if bool in kinds and low in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return low in ("true", "yes", "on", "1")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                if str not in kinds:
                    break
    if str in kinds:
        return text
    raise RunError(f"{flag_name(key)}: cannot parse {text!r} as {type_name(hint)}")


def _targets(v, *, record: bool):
    """`target_modules` as LoraConfig takes it. In flags and config files a string is
    comma-separated names, "all-linear", or "re:<regex>"; in a run record a string is what
    LoraConfig holds (a regex, or "all-linear"), "re:" allowed."""
    if v is None:
        return None
    if isinstance(v, str):
        if v.startswith("re:"):
            return v[3:]
        if record:
            return v
        if v.strip() == "all-linear":
            return "all-linear"
        return tuple(s.strip() for s in v.split(",") if s.strip())
    return tuple(v)


def _file_layer(data: Mapping, where: str, *, record: bool = False) -> dict:
    """A config file's or run record's settings as one flat layer {key: value} (the keys of
    ModelSettings, LoraSettings, OutputSettings and TrainConfig are distinct).

    Raises:
      RunError: an unknown key, or a `lora`/`train` entry that is not a table.
    """
    fields = train_field_types()
    out = {}
    for k, v in data.items():
        if k in _TOP_KEYS:
            out[k] = v
        elif k == "lora":
            if not isinstance(v, dict):
                raise RunError(f"{where}: 'lora' must be a table/object")
            for lk, lv in v.items():
                if lk not in LORA_KEYS:
                    raise RunError(f"{where}: unknown key lora.{lk}; expected one of {', '.join(LORA_KEYS)}")
                out[lk] = lv
        elif k == "train":
            if not isinstance(v, dict):
                raise RunError(f"{where}: 'train' must be a table/object")
            for tk, tv in v.items():
                if tk not in fields:
                    raise RunError(f"{where}: unknown key train.{tk}; expected a TrainConfig field")
                out[tk] = tv
        elif k in fields:
            out[k] = v
        elif k in _RECORD_ONLY:
            continue
        else:
            raise RunError(f"{where}: unknown key {k!r}; expected {', '.join(_TOP_KEYS)}, 'lora', 'train' "
                           "or a TrainConfig field")
    if "target_modules" in out:
        out["target_modules"] = _targets(out["target_modules"], record=record)
    return out


def _flag_layer(flags: Mapping) -> dict:
    """Flags as one flat layer: a TrainConfig field's text is parsed by its type (`parse_flag`),
    `target_modules` as in a config file; other values are taken as they are.

    Raises:
      RunError: a text a field cannot take, both of a pair in EITHER_OR, or an unknown key.
    """
    fields = train_field_types()
    out = {}
    for k, v in flags.items():
        if k in fields:
            out[k] = parse_flag(k, v) if isinstance(v, str) else v
        elif k in _TOP_KEYS or k in LORA_KEYS:
            out[k] = v
        else:
            raise RunError(f"unknown setting {k!r}")
    if "target_modules" in out:
        out["target_modules"] = _targets(out["target_modules"], record=False)
    _refuse_both(out, flag_name)
    return out


def _refuse_both(layer: dict, name) -> None:
    """One layer of settings (flags, a config file) may not give both of a pair in EITHER_OR."""
    for a, b in EITHER_OR:
        if layer.get(a) is not None and b in layer:
            raise RunError(f"{name(a)} and {name(b)} both given: {name(a)} sets {b}; give one of them")


def _drop_derived(layer: dict) -> None:
    """A run record holds `steps` (`warmup`) as counted from its `epochs` (`warmup_ratio`):
    counted again on resume, from the settings then in force."""
    for a, b in EITHER_OR:
        if layer.get(a) is not None:
            layer.pop(b, None)


def _keep_the_later_of_each_pair(merged: dict, layer: dict) -> None:
    """A later layer's `steps` (`warmup`) overrides an earlier layer's `epochs` (`warmup_ratio`),
    and the other way round: `--resume --steps 2000` on a run of `--epochs 2` trains to step 2000."""
    for a, b in EITHER_OR:
        if b in layer and a not in layer:
            merged[a] = None
        elif layer.get(a) is not None and b not in layer:
            merged.pop(b, None)  # TrainConfig's default; the value comes from `a`


def _same_path(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


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
        the model, compute dtype, quantization and LoRA shape (`RESUME_FIXED`,
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
        return cls._combine(record, file_layer, _flag_layer(flags or {}), run_dir)

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
        flag_layer = _flag_layer(flags or {})
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
        layer = _file_layer(data, where, record=is_record)
        if is_record:
            _drop_derived(layer)
        _refuse_both(layer, lambda k: f"{k} in {where}")
        return layer

    @classmethod
    def _combine(cls, record, file_layer, flag_layer, run_dir) -> "RunSettings":
        layers = []
        stored = None
        if record is not None:
            stored = record.to_record()
            layer = _file_layer(stored, RUN_FILE, record=True)
            _drop_derived(layer)
            layers.append(layer)
            run_dir = run_dir or record.train.out_dir
        if file_layer is not None:
            layers.append(file_layer)
        layers.append(flag_layer)
        merged = dict(CLI_DEFAULTS)
        for layer in layers:
            merged.update(layer)
            _keep_the_later_of_each_pair(merged, layer)
        given = tuple(k for k in LORA_KEYS if k in (file_layer or {}) or k in flag_layer)
        if stored is not None:
            _check_resume(merged, record, stored, run_dir)
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
        return cls._build(_file_layer(record, where, record=True))

    def to_record(self) -> dict:
        """The run record (JSON types only; see the module docstring)."""
        m = self.model
        rec = {"format": RUN_FORMAT, "version": RUN_VERSION, "model": None if m.model is None else str(m.model),
               "compute_dtype": m.compute_dtype, "backend": m.backend}
        if m.attention is not None:
            rec["attention"] = m.attention
        if m.quantize:
            rec["quantize"] = m.quantize
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


def _check_resume(merged: dict, record: RunSettings, stored: dict, run_dir) -> None:
    """Refuse a resumed run whose model, dtype, quantization or LoRA shape differs from its record."""
    for key in RESUME_FIXED:
        theirs = stored.get(key)
        same = _same_path if key == "model" else (lambda a, b: a == b)
        if theirs is not None and not same(merged.get(key), theirs):
            raise RunError(f"--resume: {key} is {merged.get(key)!r} but the run in {run_dir} used {theirs!r}")
    from jqlora.lora.config import lora_differences

    asked = {k: merged.get(k) for k in RESUME_FIXED_LORA}
    for key, mine, _ in lora_differences(asked, record.lora):
        raise RunError(f"--resume: lora.{key} is {mine!r} but the run in {run_dir} used {stored['lora'][key]!r}")


def find_run_file(source: str | os.PathLike) -> Optional[Path]:
    """The run record in `source`, its parent or its grandparent (a run dir, its checkpoints/ dir,
    or one step dir), or None."""
    source = Path(source)
    for d in (source, source.parent, source.parent.parent):
        if (d / RUN_FILE).is_file():
            return d / RUN_FILE
    return None


def find_checkpoint(source: str | os.PathLike, step: Optional[int] = None) -> Path:
    """The checkpoint directory `source` names.

    Args:
      source: a run directory, its checkpoints/ directory, or one checkpoints/step_XXXXXXXX directory.
      step: the step to pick; None picks the newest checkpoint.

    Raises:
      RunError: no checkpoint, or none for `step`.
    """
    from jqlora.train import list_checkpoints

    source = Path(source)
    if (source / "state.json").is_file():
        if step is not None and not source.name.endswith(f"{step:08d}"):
            raise RunError(f"{source} is a single checkpoint; --step {step} does not name it")
        return source
    for root in (source / "checkpoints", source):
        cks = list_checkpoints(root)
        if cks:
            if step is None:
                return cks[-1][1]
            for s, p in cks:
                if s == step:
                    return p
            raise RunError(f"{root}: no checkpoint for step {step} (have {[s for s, _ in cks]})")
    raise RunError(f"{source}: no training checkpoint found (expected checkpoints/step_XXXXXXXX)")


def export_adapter(source, out, *, step: Optional[int] = None, model_path=None) -> dict[str, Any]:
    """Restore a run's training checkpoint into its model and write the LoRA weights as a PEFT
    adapter directory (what `jqlora export-peft` does).

    The base model and LoRA settings come from the run record; the checkpoint is validated
    (checksums, keys, shapes) while it is restored.

    Args:
      source: a run directory, its checkpoints/ directory, or one step directory.
      out: the adapter directory to write.
      step: the checkpoint's step (None: the newest).
      model_path: the base checkpoint (None: the `model` of the run record).

    Returns:
      {"checkpoint", "step", "adapter", "modules", "model", "rank", "alpha"}.

    Raises:
      RunError: no such source, no checkpoint, no run record, or no model recorded.
    """
    source = Path(source)
    if not source.exists():
        raise RunError(f"{source}: no such directory")
    ckpt = find_checkpoint(source, step)
    run_file = find_run_file(ckpt.parent if ckpt.parent.name == "checkpoints" else ckpt)
    if run_file is None:
        run_file = find_run_file(source)
    if run_file is None:
        raise RunError(f"no jqlora_run.json found near {ckpt}: it records the base model and LoRA settings "
                       "(written by `jqlora train`)")
    run = RunSettings.read(run_file)
    model_path = model_path or run.model.model
    if not model_path:
        raise RunError(f"{run_file}: no 'model' recorded; pass --model")
    from jqlora.train.checkpoint import CheckpointError, read_state

    try:
        state = read_state(ckpt)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    tc = (state.get("extra") or {}).get("train_config") or dataclasses.asdict(run.train)

    from jqlora._util import jnp_dtype, quiet_third_party

    quiet_third_party()
    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import lora_params_by_module
    from jqlora.train import make_optimizer, restore_checkpoint

    lora_cfg = run.lora.to_config()
    model = models.load_causal_lm(model_path, lora=lora_cfg,
                                  compute_dtype=jnp_dtype(run.model.compute_dtype or "float32"),
                                  quantize=run.model.quantize, rngs=nnx.Rngs(0))
    d = TrainConfig()
    g = lambda k: tc.get(k, getattr(d, k))  # noqa: E731
    tx = make_optimizer(g("lr"), g("warmup"), g("steps"), g("weight_decay"), g("b1"), g("b2"), g("grad_clip"),
                        final_lr_ratio=g("final_lr_ratio"), lr_schedule=g("lr_schedule"))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _, step_done = restore_checkpoint(ckpt, model, optimizer)
    adapters.save_adapter(out, model, lora_cfg, base_model=str(model_path))
    n = len(lora_params_by_module(model))
    return dict(checkpoint=str(ckpt), step=step_done, adapter=str(out), modules=n, model=str(model_path),
                rank=lora_cfg.rank, alpha=lora_cfg.alpha)


__all__ = ["RUN_FILE", "RUN_FORMAT", "RUN_VERSION", "RunError", "RunSettings", "ModelSettings", "LoraSettings",
           "OutputSettings", "load_config_file", "parse_flag", "find_run_file", "find_checkpoint", "export_adapter"]
