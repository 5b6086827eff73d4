"""`jqlora train`: LoRA fine-tuning from a config file and/or flags, ending with a PEFT adapter."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from jqlora._util import ATTENTION_AUTO_HELP, ATTENTION_CHOICES
from jqlora.cli._common import CLIError, disk_error
from jqlora.runs import (RUN_FILE, RUN_FORMAT, RUN_VERSION, load_config_file, lock_run_dir, lora_record,
                         write_run_record)

HELP = "LoRA fine-tuning of a (bitsandbytes) checkpoint; writes a PEFT adapter at the end"
DESCRIPTION = """\
Load a checkpoint with jqlora.models.load_causal_lm, add LoRA, train it with jqlora.train.train
on a JSONL file ({"text": ...} or {"prompt": ..., "completion": ...} per line), and write the
adapter in PEFT format (interop.save_peft_adapter) to --adapter-out (default <out_dir>/adapter).

Settings come from, in increasing priority: the stored settings of the run (<out_dir>/
jqlora_run.json, only with --resume), a config file (--config x.json or x.toml), and flags.
Config file keys: `model`, `compute_dtype`, `backend`, `attention`, `quantize`, `init_adapter`, `adapter_out`,
a `lora` table (rank, alpha, dropout, target_modules, use_rslora) and the TrainConfig fields
(top level or in a `train` table). Example (TOML):

    model = "ckpt/llama-nf4"
    compute_dtype = "bfloat16"
    [lora]
    rank = 16
    alpha = 32
    target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    [train]
    data_path = "data/train.jsonl"
    seq_len = 256
    steps = 500
    out_dir = "runs/x"

Every TrainConfig field also has a flag (--seq-len, --batch-size, --lr, ...; `none` sets an
optional one to None). The tokenizer defaults to the model directory's tokenizer.json.
--epochs N sets the steps from the data (packed rows / (batch_size * grad_accum), rounded up,
times N) instead of --steps; --warmup-ratio sets the warmup as a fraction of the steps instead
of --warmup. Outputs in out_dir: loss.csv (step, loss, lr, tokens_per_s, grad_norm), eval.csv
(step, eval_loss, perplexity), loss.png, tensorboard/ (event files; --no-tensorboard: none),
checkpoints/step_*, jqlora_run.json (what export-peft needs) and the adapter. --resume continues
from the newest checkpoint with the stored settings (raise --steps or --epochs to train longer);
model and LoRA settings must not change."""

_TOP_KEYS = ("model", "compute_dtype", "backend", "attention", "quantize", "init_adapter", "adapter_out")
_LORA_KEYS = ("rank", "alpha", "dropout", "target_modules", "use_rslora")
_LORA_DEFAULTS = dict(rank=16, alpha=32.0, dropout=0.0, target_modules=None, use_rslora=False)
_TRAIN_DEFAULTS = dict(remat="auto")  # the CLI's defaults where they differ from TrainConfig's
_CHOICES = {"lr_schedule": ("cosine", "linear", "constant")}  # jqlora.train.optim.LR_SCHEDULES
# pairs of settings where one replaces the other: a layer of settings gives at most one of each
_EITHER_OR = (("epochs", "steps"), ("warmup_ratio", "warmup"))


def _train_fields():
    from jqlora.train import TrainConfig

    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _parse_value(text: str, typ: str, name: str):
    """Parse a flag value for a TrainConfig field whose annotation is `typ` (a string such as
    "int", "float | None", "bool | str", "Any")."""
    parts = [t.strip() for t in typ.split("|")]
    low = text.lower()
    if "Any" in parts:  # bos/eos: 'auto', true/false, none, a token id or a token string
        if low in ("none", "null", "false"):
            return None
        if low == "true":
            return True
        return int(text) if text.lstrip("-").isdigit() else text
    if "None" in parts and low in ("none", "null"):
        return None
    if "bool" in parts and low in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        return low in ("true", "yes", "on", "1")
    for kind, conv in (("int", int), ("float", float)):
        if kind in parts:
            try:
                return conv(text)
            except ValueError:
                if "str" not in parts:
                    raise CLIError(f"--{name.replace('_', '-')}: cannot parse {text!r} as {typ}") from None
    if "str" in parts:
        return text
    raise CLIError(f"--{name.replace('_', '-')}: cannot parse {text!r} as {typ}")


_FIELD_HELP = {
    "data_path": "JSONL training data", "tokenizer_path": "tokenizer.json or its directory (default: the model's)",
    "seq_len": "tokens per row", "batch_size": "rows per micro-batch", "grad_accum": "micro-batches per step",
    "lr": "peak learning rate", "warmup": "linear warmup steps", "steps": "total optimizer steps",
    "lr_schedule": "after warmup: cosine or linear decay to lr * final_lr_ratio, or constant",
    "warmup_ratio": "warmup as a fraction of the steps (instead of --warmup)",
    "epochs": "passes over the training data; sets the steps (instead of --steps)",
    "final_lr_ratio": "the decay's end: lr * this",
    "tensorboard": "TensorBoard event files in out_dir/tensorboard (default: on when tensorboardX is installed)",
    "out_dir": "output directory", "save_every": "checkpoint every N steps (0: only at the end)",
    "eval_data_path": "JSONL evaluation data", "eval_every": "evaluate every N steps",
    "data_format": "auto (per line, from its keys), messages, alpaca, text or prompt_completion",
    "chat_template": "a Jinja file replacing the tokenizer folder's chat template",
    "resume": "continue from the newest checkpoint in out_dir", "progress": "progress bar (default: on a terminal; plain lines in a log file)",
    "remat": "rematerialize decoder layers: auto (chosen by memory), true, false or a policy name", "grad_clip": "global-norm clip (none: off)",
}


def add_arguments(p: argparse.ArgumentParser):
    S = argparse.SUPPRESS
    g = p.add_argument_group("model and LoRA")
    g.add_argument("--config", help="JSON or TOML config file (see above)")
    g.add_argument("--model", default=S, help="checkpoint directory (bitsandbytes 4/8-bit or plain)")
    g.add_argument("--compute-dtype", dest="compute_dtype", default=S, choices=("float32", "bfloat16", "float16"),
                   help="dtype of every matmul (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--backend", default=S, choices=("auto", "pallas", "interpret", "xla"),
                   help="qmatmul backend (default auto)")
    g.add_argument("--attention", default=S, choices=ATTENTION_CHOICES,
                   help=f"attention implementation (default auto; {ATTENTION_AUTO_HELP})")
    g.add_argument("--quantize", default=S, choices=("nf4", "fp4", "int8"),
                   help="quantize a plain checkpoint's linear layers at load")
    g.add_argument("--rank", type=int, default=S, help=f"LoRA rank (default {_LORA_DEFAULTS['rank']})")
    g.add_argument("--alpha", type=float, default=S, help=f"LoRA alpha (default {_LORA_DEFAULTS['alpha']:g})")
    g.add_argument("--lora-dropout", dest="dropout", type=float, default=S, help="LoRA dropout (default 0)")
    g.add_argument("--target-modules", dest="target_modules", default=S,
                   help="comma-separated module-name suffixes (q_proj,v_proj) or re:<regex> on the full "
                        "dotted name (default: all attention and MLP projections)")
    g.add_argument("--use-rslora", dest="use_rslora", action=argparse.BooleanOptionalAction, default=S,
                   help="scale alpha/sqrt(r) instead of alpha/r")
    g.add_argument("--init-adapter", dest="init_adapter", default=S,
                   help="start from this PEFT adapter's weights (its rank/alpha/targets are used)")
    g.add_argument("--adapter-out", dest="adapter_out", default=S,
                   help="where to write the PEFT adapter at the end (default <out_dir>/adapter)")
    g.add_argument("--dry-run", action="store_true", help="print the resolved settings as JSON and exit")
    t = p.add_argument_group("training (jqlora.train.TrainConfig fields)")
    from jqlora.train.config import TrainConfig  # light: no jax

    defaults = TrainConfig()
    for name, f in _train_fields().items():
        typ = str(f.type)
        flag = "--" + name.replace("_", "-")
        dflt = _TRAIN_DEFAULTS.get(name, getattr(defaults, name))
        what = _FIELD_HELP.get(name, "")
        if name == "tensorboard":
            t.add_argument(flag, dest="t_" + name, action=argparse.BooleanOptionalAction, default=S,
                           help=what)
        elif typ in ("bool", "bool | None"):
            t.add_argument(flag, dest="t_" + name, action=argparse.BooleanOptionalAction, default=S,
                           help=f"{what} (default {dflt})".strip())
        elif name in _CHOICES:
            t.add_argument(flag, dest="t_" + name, default=S, choices=_CHOICES[name],
                           help=f"{what} (default {dflt})")
        else:
            t.add_argument(flag, dest="t_" + name, default=S, metavar=name.upper(),
                           help=f"{what}{': ' if what else ''}{typ} (default {dflt})")


# ------------------------------------------------------------------------------------- settings
def _split_file_settings(data: dict, where: str) -> dict:
    """Config file dict -> {"top": {...}, "lora": {...}, "train": {...}} (unknown keys rejected)."""
    fields = _train_fields()
    top, lora, train = {}, {}, {}
    for k, v in data.items():
        if k in _TOP_KEYS:
            top[k] = v
        elif k == "lora":
            if not isinstance(v, dict):
                raise CLIError(f"{where}: 'lora' must be a table/object")
            for lk, lv in v.items():
                if lk not in _LORA_KEYS:
                    raise CLIError(f"{where}: unknown key lora.{lk}; expected one of {', '.join(_LORA_KEYS)}")
                lora[lk] = lv
        elif k == "train":
            if not isinstance(v, dict):
                raise CLIError(f"{where}: 'train' must be a table/object")
            for tk, tv in v.items():
                if tk not in fields:
                    raise CLIError(f"{where}: unknown key train.{tk}; expected a TrainConfig field")
                train[tk] = tv
        elif k in fields:
            train[k] = v
        elif k in ("format", "version", "skipped_batches"):  # what a run record adds
            continue
        else:
            raise CLIError(f"{where}: unknown key {k!r}; expected {', '.join(_TOP_KEYS)}, 'lora', 'train' "
                           "or a TrainConfig field")
    return {"top": top, "lora": lora, "train": train}


def _targets(v):
    if v is None:
        return None
    if isinstance(v, str):
        if v.startswith("re:"):
            return v[3:]
        if v.strip() == "all-linear":
            return "all-linear"
        return tuple(s.strip() for s in v.split(",") if s.strip())
    return tuple(v)


def resolve_settings(args) -> dict:
    """Merge stored run settings (with --resume), the config file and flags."""
    fields = _train_fields()
    layers = []
    resume = getattr(args, "t_resume", None)
    cfg_file = None
    if args.config:
        raw = load_config_file(args.config)
        cfg_file = _split_file_settings(raw, args.config)
        if raw.get("format") == RUN_FORMAT:  # a run record given as a config file
            _drop_derived(cfg_file["train"])
        _refuse_both(cfg_file["train"], lambda k: f"{k} in {args.config}")
    flags = {"top": {k: getattr(args, k) for k in _TOP_KEYS if hasattr(args, k)},
             "lora": {k: getattr(args, k) for k in _LORA_KEYS if hasattr(args, k)},
             "train": {k: _flag_value(getattr(args, "t_" + k), str(f.type), k)
                       for k, f in fields.items() if hasattr(args, "t_" + k)}}
    _refuse_both(flags["train"], lambda k: "--" + k.replace("_", "-"))
    if "target_modules" in flags["lora"]:
        flags["lora"]["target_modules"] = _targets(flags["lora"]["target_modules"])
    out_dir = flags["train"].get("out_dir") or (cfg_file or {}).get("train", {}).get("out_dir")
    if resume is None and cfg_file is not None:
        resume = cfg_file["train"].get("resume")
    stored = None
    if resume:
        from jqlora.train import TrainConfig

        run_file = Path(out_dir or TrainConfig().out_dir) / RUN_FILE
        if run_file.is_file():
            stored = _split_file_settings(load_config_file(run_file), str(run_file))
            _drop_derived(stored["train"])
            layers.append(stored)
    if cfg_file is not None:
        layers.append(cfg_file)
    layers.append(flags)
    merged = {"top": {}, "lora": dict(_LORA_DEFAULTS), "train": dict(_TRAIN_DEFAULTS)}
    for layer in layers:
        for part in merged:
            merged[part].update(layer[part])
        _keep_the_later_of_each_pair(merged["train"], layer["train"])
    merged["lora_explicit"] = sorted(set((cfg_file or {}).get("lora", {})) | set(flags["lora"]))
    merged["lora"]["target_modules"] = _targets(merged["lora"]["target_modules"])
    if stored is not None:
        # model, LoRA shape and dtype must match the run being resumed
        for key in ("model", "compute_dtype", "quantize"):
            same = (lambda a, b: a is not None and b is not None and Path(a).resolve() == Path(b).resolve()) \
                if key == "model" else (lambda a, b: a == b)
            if key in stored["top"] and not same(merged["top"].get(key), stored["top"][key]):
                raise CLIError(f"--resume: {key} is {merged['top'].get(key)!r} but the run in {out_dir} used "
                               f"{stored['top'][key]!r}")
        for key in ("rank", "alpha", "target_modules", "use_rslora"):
            if key in stored["lora"] and _norm(merged["lora"][key]) != _norm(_targets(stored["lora"][key])
                                                                           if key == "target_modules" else stored["lora"][key]):
                raise CLIError(f"--resume: lora.{key} is {merged['lora'][key]!r} but the run in {out_dir} used "
                               f"{stored['lora'][key]!r}")
    merged["resumed_settings"] = stored is not None
    return merged


def _refuse_both(train: dict, name) -> None:
    """One layer of settings (flags, a config file) may not give both of a pair in _EITHER_OR."""
    for a, b in _EITHER_OR:
        if train.get(a) is not None and b in train:
            raise CLIError(f"{name(a)} and {name(b)} both given: {name(a)} sets {b}; give one of them")


def _drop_derived(train: dict) -> None:
    """A run record holds `steps` (`warmup`) as counted from its `epochs` (`warmup_ratio`):
    counted again on resume, from the settings then in force."""
    for a, b in _EITHER_OR:
        if train.get(a) is not None:
            train.pop(b, None)


def _keep_the_later_of_each_pair(merged: dict, layer: dict) -> None:
    """A later layer's `steps` (`warmup`) overrides an earlier layer's `epochs` (`warmup_ratio`),
    and the other way round: `--resume --steps 2000` on a run of `--epochs 2` trains to step 2000."""
    for a, b in _EITHER_OR:
        if b in layer and a not in layer:
            merged[a] = None
        elif layer.get(a) is not None and b not in layer:
            merged.pop(b, None)  # TrainConfig's default; the value comes from `a`


def _norm(v):
    if isinstance(v, (tuple, list)):
        return sorted(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


def _flag_value(value, typ: str, name: str):
    if not isinstance(value, str):
        return value  # booleans from BooleanOptionalAction
    return _parse_value(value, typ, name)


def run(args) -> int:
    with contextlib.ExitStack() as held:  # the out_dir's lock, once taken
        try:
            return _run(args, held)
        except OSError as e:
            err = disk_error(e)
            if err is None:
                raise
            raise err from None


def _run(args, held: contextlib.ExitStack) -> int:
    s = resolve_settings(args)
    top, lcfg, tcfg = s["top"], s["lora"], s["train"]
    if not top.get("model"):
        raise CLIError("no model: pass --model PATH or set `model` in the config file")
    from jqlora._util import default_compute_dtype, jnp_dtype, quiet_third_party, resolve_attention, resolve_remat

    quiet_third_party()
    from jqlora.train import TrainConfig

    try:
        config = TrainConfig(**tcfg)
        config.validate()
    except (TypeError, ValueError) as e:
        raise CLIError(f"invalid training settings: {e}") from None
    model_path = Path(top["model"])
    if not model_path.is_dir():
        raise CLIError(f"{model_path}: no such checkpoint directory")
    if config.data_path is None:
        raise CLIError("no training data: pass --data-path FILE.jsonl or set data_path in the config file")
    if config.tokenizer_path is None:
        if (model_path / "tokenizer.json").is_file():
            config.tokenizer_path = str(model_path)
        else:
            raise CLIError(f"no tokenizer: {model_path} has no tokenizer.json; pass --tokenizer-path")
    from jqlora.train.data import check_training_data

    data = check_training_data(config, model_path)  # a bad line fails here, before the model loads
    print(f"data: {data['train']['examples']} examples "
          f"({', '.join(f'{k} {v}' for k, v in data['train']['formats'].items())}), "
          f"{data['train']['trained_tokens']} of {data['train']['tokens']} tokens trained", file=sys.stderr)
    compute = top.get("compute_dtype") or default_compute_dtype()
    out_dir = Path(config.out_dir)
    adapter_out = Path(top.get("adapter_out") or out_dir / "adapter")

    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import LoraConfig

    init = None
    if top.get("init_adapter"):
        init_cfg, init_params, _ = adapters.load_adapter(top["init_adapter"])
        from jqlora.lora.config import lora_conflicts

        clash = lora_conflicts({k: lcfg[k] for k in s["lora_explicit"] if k in lcfg}, init_cfg)
        if clash:
            raise CLIError(f"--init-adapter {top['init_adapter']} conflicts with the LoRA settings given "
                           f"({'; '.join(clash)}): drop them (the adapter's are used) or start a new adapter")
        lora_cfg = dataclasses.replace(init_cfg, dropout=float(lcfg.get("dropout") or 0.0))
        init = init_params
    else:
        kw = {k: v for k, v in lcfg.items() if v is not None}
        lora_cfg = LoraConfig(**kw)
    record = {
        "format": RUN_FORMAT, "version": RUN_VERSION,
        "model": str(model_path.resolve()), "compute_dtype": compute, "backend": top.get("backend", "auto"),
        "attention": top.get("attention", "auto"),
        **({"quantize": top["quantize"]} if top.get("quantize") else {}),
        **({"init_adapter": str(top["init_adapter"])} if top.get("init_adapter") else {}),
        **({"adapter_out": str(top["adapter_out"])} if top.get("adapter_out") else {}),
        "lora": lora_record(lora_cfg),
        "train": dataclasses.asdict(config),
    }
    if args.dry_run:
        print(json.dumps(record, indent=2))
        return 0
    # one writer per out_dir; the run record is written by train() through on_ready, once the
    # data and the checkpoint to resume from passed their checks: a refused run changes nothing
    held.enter_context(lock_run_dir(out_dir))
    attention, why = resolve_attention(top.get("attention", "auto"), compute)
    print(f"attention: {attention} ({why})", file=sys.stderr)
    model = models.load_causal_lm(model_path, lora=lora_cfg, compute_dtype=jnp_dtype(compute),
                                  quantize=top.get("quantize"), backend=top.get("backend", "auto"),
                                  attention=attention, rngs=nnx.Rngs(config.seed), mesh=config.mesh)
    if init is not None:
        rep = adapters.attach_adapter(model, init, where=str(top["init_adapter"]))
        print(f"initialized {len(rep['matched'])} LoRA modules from {top['init_adapter']}", file=sys.stderr)
    from jqlora.train import NonFiniteLossError, train

    def ready(resolved):  # the record keeps what train() counted from epochs and warmup_ratio
        record["train"].update(steps=resolved.steps, warmup=resolved.warmup)
        write_run_record(out_dir, record)

    try:
        res = train(model, dataclasses.replace(config, remat=resolve_remat(config.remat)),
                    lock=False, on_ready=ready)
    except NonFiniteLossError as e:
        raise CLIError(str(e)) from None
    try:
        adapters.save_adapter(adapter_out, model, lora_cfg, base_model=str(model_path))
    except OSError as e:
        if e.filename is None and e.errno is not None:  # e.g. ENOSPC from a write(): say which adapter
            raise OSError(e.errno, e.strerror, str(adapter_out)) from e
        raise
    if res.skipped_batches:
        write_run_record(out_dir, {**record, "skipped_batches": res.skipped_batches})
        print(f"skipped {res.skipped_batches} batch(es) without a supervised token (all-prompt "
              "after truncation to seq_len)", file=sys.stderr)
    start = res.resumed_from
    print(f"trained steps {(start or 0) + 1}..{res.step}" + (f" (resumed from step {start})" if start else "")
          if res.steps else f"nothing to train: already at step {res.step} of {res.total_steps}")
    if res.losses:
        print(f"loss: first {res.losses[0]:.4f}, last {res.losses[-1]:.4f}")
    if res.eval_losses:
        print(f"eval loss: {res.eval_losses[-1][1]:.4f} (step {res.eval_losses[-1][0]})")
    print(f"loss curve: {res.csv_path}" + (f", {res.png_path}" if res.png_path else ""))
    print(f"checkpoint: {res.checkpoint}")
    print(f"adapter (PEFT): {adapter_out}")
    return 0
