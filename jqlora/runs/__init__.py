"""A training run's settings (`RunSettings`), its directory and record, and export of its
checkpoints to PEFT. One module a job: `config_file` (a config file or record read into a dict;
`RunError`), `flags` (TrainConfig's fields as flags), `parts` (the model, LoRA and output
settings), `layering` (one layer of settings; the rules that merge layers), `settings`
(`RunSettings`), `locate` (a run's record and checkpoint from a path), `export` (a checkpoint as
a PEFT adapter).

A run directory (the `out_dir` of `jqlora train` or of the demo) holds `checkpoints/step_*`,
loss.csv / loss.png and the run record `jqlora_run.json`. The record says what a checkpoint alone
does not: the base model, the compute dtype, the LoRA settings and the TrainConfig. It is written
once every check of a run has passed, before its first step (so a partial run can still be
exported, and a refused or failed command leaves the record of the run already there untouched),
and again at the end. Its keys:

    format "jqlora-run", version 1, model, compute_dtype, backend, attention (optional),
    quantize (optional), quantize_experts (optional, default "auto"), init_adapter (optional),
    adapter_out (optional),
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
from jqlora.runs.config_file import RunError, load_config_file
from jqlora.runs.export import export_adapter
from jqlora.runs.flags import flag_name, is_switch, parse_flag, train_field_types, type_name
from jqlora.runs.layering import CLI_DEFAULTS
from jqlora.runs.locate import find_checkpoint, find_run_file
from jqlora.runs.parts import LORA_KEYS, MODEL_KEYS, OUTPUT_KEYS, LoraSettings, ModelSettings, OutputSettings
from jqlora.runs.settings import RunSettings
from jqlora.train.run_record import RUN_FILE, RUN_FORMAT, RUN_VERSION

__all__ = ["RUN_FILE", "RUN_FORMAT", "RUN_VERSION", "RunError", "RunSettings", "ModelSettings", "LoraSettings",
           "OutputSettings", "load_config_file", "parse_flag", "find_run_file", "find_checkpoint", "export_adapter",
           "CLI_DEFAULTS", "MODEL_KEYS", "LORA_KEYS", "OUTPUT_KEYS", "flag_name", "is_switch", "train_field_types",
           "type_name"]
