"""`jqlora train`: LoRA fine-tuning from a config file and/or flags, ending with a PEFT adapter."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from jqlora._util import ATTENTION_AUTO_HELP, ATTENTION_CHOICES, BACKENDS, BASE_MATMULS, DTYPES, QUANTIZE_FORMATS
from jqlora.cli._common import CLIError, disk_error, echo_log, model_dir
from jqlora.runs import (CLI_DEFAULTS, LORA_KEYS, MODEL_KEYS, OUTPUT_KEYS, LoraSettings, RunSettings, flag_name,
                         is_switch, train_field_types, type_name)
from jqlora.train.config import LR_SCHEDULES, OBJECTIVES, OPTIMIZERS, TrainConfig
from jqlora.train.objectives import DPO_LOSSES, GRPO_LOSSES, SCALE_REWARDS
from jqlora.train.lock import lock_run_dir

HELP = "LoRA fine-tuning of a (bitsandbytes) checkpoint; writes a PEFT adapter at the end"
QUANTIZE_EXPERTS = "auto"  # --quantize-experts' default (jqlora.runs.ModelSettings; build_parser adds the flag)
DESCRIPTION = """\
Load a checkpoint with jqlora.models.load_causal_lm, add LoRA, train it with jqlora.train.train
on its data (JSONL, a JSON array, CSV/TSV, Parquet, a `datasets` folder or a cached dataset id;
rows of text, prompt/completion, messages, alpaca or ShareGPT conversations), and write the
adapter in PEFT format (interop.save_peft_adapter) to --adapter-out (default <out_dir>/adapter).

Settings come from, in increasing priority: the stored settings of the run (<out_dir>/
jqlora_run.json, only with --resume), a config file (--config x.json or x.toml), and flags.
Config file keys: `model`, `compute_dtype`, `backend`, `attention`, `quantize`, `quantize_experts`,
`init_adapter`, `adapter_out`,
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
of --warmup. Outputs in out_dir: loss.csv (step, loss, lr, tokens_per_s, grad_norm: a row at step
1, every --log-every steps and the last, its loss the mean since the row before), eval.csv
(step, eval_loss, perplexity), loss.png, tensorboard/ (event files; --no-tensorboard: none),
checkpoints/step_*, jqlora_run.json (what export-peft needs) and the adapter. --resume continues
from the newest checkpoint with the stored settings (raise --steps or --epochs to train longer);
model, LoRA and --optimizer settings must not change. --optimizer adamw8bit keeps AdamW's moments
in 8 bits (bitsandbytes' AdamW8bit), for runs whose optimizer state is most of their memory.

--objective dpo trains on preference pairs ({"prompt", "chosen", "rejected"} per row), --objective
grpo on prompts with reward functions (--reward module:function or file.py:function, repeatable);
docs/training.md, "Preference and RL training", has their options and what they log."""

_CHOICES = {"lr_schedule": LR_SCHEDULES,  # TrainConfig fields whose flag takes one of a few names
            "objective": OBJECTIVES, "dpo_loss": DPO_LOSSES, "grpo_loss": GRPO_LOSSES,
            "scale_rewards": SCALE_REWARDS, "base_matmul": BASE_MATMULS, "optimizer": OPTIMIZERS}

_FIELD_HELP = {
    "data_path": "training data: .jsonl, .json (array), .csv, .tsv, .parquet, a datasets folder or a cached dataset id", "tokenizer_path": "tokenizer.json or its directory (default: the model's)",
    "seq_len": "tokens per row", "batch_size": "rows per micro-batch", "grad_accum": "micro-batches per step",
    "lr": "peak learning rate", "warmup": "linear warmup steps", "steps": "total optimizer steps",
    "lr_schedule": "after warmup: cosine or linear decay to lr * final_lr_ratio, or constant",
    "warmup_ratio": "warmup as a fraction of the steps (instead of --warmup)",
    "epochs": "passes over the training data; sets the steps (instead of --steps)",
    "final_lr_ratio": "the decay's end: lr * this",
    "optimizer": "adamw, or adamw8bit: AdamW with its moments stored in 8 bits per element plus a float32 "
                 "absmax per 256 (bitsandbytes' AdamW8bit; about a quarter of the state memory)",
    "tensorboard": "TensorBoard event files in out_dir/tensorboard (default: on when tensorboardX is installed)",
    "out_dir": "output directory", "save_every": "checkpoint every N steps (0: only at the end)",
    "eval_data_path": "evaluation data (the same kinds as --data-path)", "eval_every": "evaluate every N steps",
    "data_format": "auto (per row, from its keys), messages, sharegpt, alpaca, text or prompt_completion",
    "data_split": "the split of a datasets folder or dataset id (default train)",
    "eval_data_split": "the split of --eval-data-path's folder or dataset id",
    "text_field": "the column holding plain text (default text)",
    "prompt_field": "the column holding the prompt (default prompt)",
    "completion_field": "the column holding the completion (default completion)",
    "messages_field": "the column holding a conversation (messages, or ShareGPT turns with from/value)",
    "role_map": "ShareGPT speakers to roles, e.g. human=user,gpt=assistant",
    "chat_template": "a Jinja file replacing the tokenizer folder's chat template",
    "resume": "continue from the newest checkpoint in out_dir", "progress": "progress bar (default: on a terminal; plain lines in a log file)",
    "remat": "rematerialize decoder layers: auto (by the memory there is: the GPU's, or this process's RAM limit on CPU; JQLORA_MEMORY_GB=N overrides), true, false or a policy name", "grad_clip": "global-norm clip (none: off)",
    "base_matmul": "the frozen 4-bit weights' products: in the compute dtype, or fp8 (E4M3 operands "
                   "scaled per row: relative error about 0.04 a product, docs/numerics.md)",
    "objective": "sft (supervised), dpo (preference pairs) or grpo (prompts + reward functions)",
    "dpo_beta": "DPO beta", "dpo_loss": "DPO loss (TRL's definitions)",
    "precompute_ref": "DPO: reference log-probs of the whole set once, before step 1",
    "reward": "GRPO reward function module:function or file.py:function (repeat for several)",
    "reward_weights": "GRPO: comma-separated weights, one per --reward",
    "num_generations": "GRPO: completions per prompt", "max_completion_length": "GRPO: new tokens at most",
    "grpo_beta": "GRPO: KL weight (0: no reference pass)", "epsilon": "GRPO: ratio clip",
    "grpo_loss": "GRPO loss normalisation (TRL's)", "scale_rewards": "GRPO: advantages over the std of",
    "router_aux_loss_coef": "mixture-of-experts models: add the router's load-balancing loss times this "
                            "(transformers' router_aux_loss_coef * aux_loss; loss.csv: aux_loss); none: as "
                            "config.json says (on at its router_aux_loss_coef when output_router_logits is "
                            "true, as transformers does); 0: off",
}


def add_arguments(p: argparse.ArgumentParser):
    S = argparse.SUPPRESS  # a flag not given is absent from args: it does not override a config file
    lora = LoraSettings()
    g = p.add_argument_group("model and LoRA")
    g.add_argument("--config", help="JSON or TOML config file (see above)")
    g.add_argument("--model", default=S, help="checkpoint directory (bitsandbytes 4/8-bit or plain), or a Hugging "
                                              "Face model id org/name[@revision] (the cache, else a download)")
    g.add_argument("--compute-dtype", dest="compute_dtype", default=S, choices=DTYPES,
                   help="dtype of every matmul (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--backend", default=S, choices=BACKENDS,
                   help="qmatmul backend (default auto)")
    g.add_argument("--attention", default=S, choices=ATTENTION_CHOICES,
                   help=f"attention implementation (default auto; {ATTENTION_AUTO_HELP})")
    g.add_argument("--quantize", default=S, choices=QUANTIZE_FORMATS,
                   help="quantize a plain checkpoint's linear layers at load")
    g.add_argument("--rank", type=int, default=S, help=f"LoRA rank (default {lora.rank})")
    g.add_argument("--alpha", type=float, default=S, help=f"LoRA alpha (default {lora.alpha:g})")
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
    defaults = TrainConfig()
    for name, hint in train_field_types().items():  # the text of a value is parsed by RunSettings
        flag = flag_name(name)
        dflt = CLI_DEFAULTS.get(name, getattr(defaults, name))
        what = _FIELD_HELP.get(name, "")
        if name == "tensorboard":
            t.add_argument(flag, dest="t_" + name, action=argparse.BooleanOptionalAction, default=S,
                           help=what)
        elif is_switch(hint):
            t.add_argument(flag, dest="t_" + name, action=argparse.BooleanOptionalAction, default=S,
                           help=f"{what} (default {dflt})".strip())
        elif name == "reward":  # repeatable: one reward function per flag
            t.add_argument(flag, dest="t_" + name, default=S, action="append", metavar="MODULE:FUNCTION",
                           help=what)
        elif name in _CHOICES:
            t.add_argument(flag, dest="t_" + name, default=S, choices=_CHOICES[name],
                           help=f"{what} (default {dflt})")
        else:
            t.add_argument(flag, dest="t_" + name, default=S, metavar=name.upper(),
                           help=f"{what}{': ' if what else ''}{type_name(hint)} (default {dflt})")


def flags_given(args) -> dict:
    """{setting: value} of the flags on the command line (argparse leaves the others out of `args`)."""
    out = {k: getattr(args, k) for k in MODEL_KEYS + OUTPUT_KEYS + LORA_KEYS if hasattr(args, k)}
    out.update({k: getattr(args, "t_" + k) for k in train_field_types() if hasattr(args, "t_" + k)})
    return out


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
    flags = flags_given(args)
    if flags.get("model"):  # a Hugging Face id resolves to its folder, as the run record keeps it
        flags["model"] = str(model_dir(flags["model"]))
    s = RunSettings.resolve(args.config, flags)
    if not s.model.model:
        raise CLIError("no model: pass --model PATH or set `model` in the config file")
    from jqlora._util import default_compute_dtype, jnp_dtype, quiet_third_party, resolve_attention

    quiet_third_party()
    config = s.train
    try:
        config.validate()
    except (TypeError, ValueError) as e:
        raise CLIError(f"invalid training settings: {e}") from None
    model_path = model_dir(s.model.model)
    if config.data_path is None:
        raise CLIError("no training data: pass --data-path (a file, a datasets folder or a dataset id) or set data_path in the config file")
    if config.tokenizer_path is None:
        if (model_path / "tokenizer.json").is_file():
            config.tokenizer_path = str(model_path)
        else:
            raise CLIError(f"no tokenizer: {model_path} has no tokenizer.json; pass --tokenizer-path")
    if config.objective == "sft":
        from jqlora.train.data import check_training_data
    else:  # pairs (DPO) or prompts and reward functions (GRPO)
        from jqlora.train.objective_loop import check_objective_data as check_training_data

    data = check_training_data(config, model_path)  # a bad line fails here, before the model loads
    print(f"data: {data['train']['examples']} examples "
          f"({', '.join(f'{k} {v}' for k, v in data['train']['formats'].items())}), "
          f"{data['train']['trained_tokens']} of {data['train']['tokens']} tokens trained", file=sys.stderr)
    compute = s.model.compute_dtype or default_compute_dtype()

    from flax import nnx

    from jqlora import adapters, models

    init = None
    if s.model.init_adapter:
        init_cfg, init, _ = adapters.load_adapter(s.model.init_adapter)
        from jqlora.lora.config import lora_conflicts

        clash = lora_conflicts({k: getattr(s.lora, k) for k in s.lora_given}, init_cfg)
        if clash:
            raise CLIError(f"--init-adapter {s.model.init_adapter} conflicts with the LoRA settings given "
                           f"({'; '.join(clash)}): drop them (the adapter's are used) or start a new adapter")
        lora_cfg = dataclasses.replace(init_cfg, dropout=float(s.lora.dropout or 0.0))
    else:
        lora_cfg = s.lora.to_config()
    # what the record keeps: the resolved model path and dtype, the LoRA built, a copy of the config,
    # every path absolute (a resume or an export may run from another directory)
    run_settings = dataclasses.replace(
        s, model=dataclasses.replace(s.model, model=str(model_path.resolve()), compute_dtype=compute),
        lora=LoraSettings.from_config(lora_cfg), train=dataclasses.replace(config)).absolute()
    adapter_out = run_settings.adapter_dir
    if args.dry_run:
        print(json.dumps(run_settings.to_record(), indent=2))
        return 0
    # one writer per out_dir; the run record is written by train() through on_ready, once the
    # data and the checkpoint to resume from passed their checks: a refused run changes nothing
    held.enter_context(lock_run_dir(run_settings.out_dir))
    from jqlora.models.config import attn_softcap_of

    attention, why = resolve_attention(s.model.attention, compute,
                                       soft_capped=attn_softcap_of(data["model_config"]) is not None)
    print(f"attention: {attention} ({why})", file=sys.stderr)
    model = models.load_causal_lm(model_path, lora=lora_cfg, compute_dtype=jnp_dtype(compute),
                                  quantize=s.model.quantize, quantize_experts=s.model.quantize_experts,
                                  backend=s.model.backend, base_matmul=config.base_matmul,
                                  attention=attention, rngs=nnx.Rngs(config.seed), mesh=config.mesh)
    if init is not None:
        rep = adapters.attach_adapter(model, init, where=str(s.model.init_adapter))
        print(f"initialized {len(rep['matched'])} LoRA modules from {s.model.init_adapter}", file=sys.stderr)
    from jqlora.train import NonFiniteLossError, train

    record = [run_settings]  # the settings last written to the run record

    def ready(resolved):  # the record keeps what train() counted from epochs and warmup_ratio
        record[0] = dataclasses.replace(run_settings, train=dataclasses.replace(
            run_settings.train, steps=resolved.steps, warmup=resolved.warmup))
        record[0].write_record()

    try:
        with echo_log("jqlora.models"):  # remat="auto"'s choice, one line per compiled shape
            res = train(model, config, data=data["batches"], eval_data=data["eval_batches"], lock=False,
                        on_ready=ready, tokenizer=data.get("tokenizer"))
    except NonFiniteLossError as e:
        raise CLIError(str(e)) from None
    try:
        adapters.save_adapter(adapter_out, model, lora_cfg, base_model=str(model_path))
    except OSError as e:
        if e.filename is None and e.errno is not None:  # e.g. ENOSPC from a write(): say which adapter
            raise OSError(e.errno, e.strerror, str(adapter_out)) from e
        raise
    if res.skipped_batches:
        record[0].write_record(skipped_batches=res.skipped_batches)
        print(f"skipped {res.skipped_batches} batch(es) without a supervised token (all-prompt "
              "after truncation to seq_len)", file=sys.stderr)
    start = res.resumed_from
    print(f"trained steps {(start or 0) + 1}..{res.step}" + (f" (resumed from step {start})" if start else "")
          if res.steps else f"nothing to train: already at step {res.step} of {res.total_steps}")
    if res.losses:
        print(f"loss: first {res.losses[0]:.4f}, last {res.losses[-1]:.4f}")
    for key in ("reward", "rewards/accuracies"):  # GRPO, DPO
        if res.metrics and key in res.metrics[0]:
            print(f"{key}: first {res.metrics[0][key]:.4f}, last {res.metrics[-1][key]:.4f}")
    if res.eval_losses:
        print(f"eval loss: {res.eval_losses[-1][1]:.4f} (step {res.eval_losses[-1][0]})")
    print(f"loss curve: {res.csv_path}" + (f", {res.png_path}" if res.png_path else ""))
    print(f"checkpoint: {res.checkpoint}")
    print(f"adapter (PEFT): {adapter_out}")
    return 0
