"""`jqlora export-peft` and `jqlora import-peft`: training checkpoints <-> PEFT adapter directories."""
from __future__ import annotations

import json
import sys
import types

from jqlora.cli._common import model_dir, quantize_experts

# ============================================================================== export-peft
EXPORT_DESCRIPTION = """\
Turn a jqlora training checkpoint into a PEFT LoRA adapter directory (adapter_config.json +
adapter_model.safetensors, float32) that peft.PeftModel.from_pretrained, `jqlora generate
--adapter`, `jqlora crosscheck --adapter` and `jqlora train --init-adapter` load.

SOURCE is a training output directory (as written by `jqlora train`), its checkpoints/
directory, or one checkpoints/step_XXXXXXXX directory; without --step the newest checkpoint is
used. The base model and LoRA settings come from <out_dir>/jqlora_run.json (written by `jqlora
train`); --model overrides the base model path. The checkpoint is validated (checksums, keys,
shapes) while it is restored into the model. Library: jqlora.runs.export_adapter."""


def _export_args(p):
    p.add_argument("source", help="training out_dir, its checkpoints/ dir, or a step_XXXXXXXX dir")
    p.add_argument("out", help="adapter directory to write")
    p.add_argument("--step", type=int, default=None, help="export this step's checkpoint (default: newest)")
    p.add_argument("--model", default=None, help="base checkpoint, a folder or a Hugging Face model id (default: the "
                                                 "one in jqlora_run.json)")


def _export_run(args) -> int:
    from jqlora.runs import export_adapter

    model = None if args.model is None else str(model_dir(args.model))
    r = export_adapter(args.source, args.out, step=args.step, model_path=model)
    print(f"exported step {r['step']} ({r['checkpoint']}): {r['modules']} LoRA modules, r={r['rank']}, "
          f"alpha={r['alpha']:g} -> {r['adapter']}")
    return 0


export = types.SimpleNamespace(
    HELP="a training checkpoint -> a PEFT adapter directory", DESCRIPTION=EXPORT_DESCRIPTION,
    add_arguments=_export_args, run=_export_run)


# ============================================================================== import-peft
IMPORT_DESCRIPTION = """\
Check that a PEFT LoRA adapter (from PEFT, or from export-peft) applies to a model in jqlora,
and show what it does. Loads the adapter (interop.load_peft_adapter: format, ranks), maps its
adapter_config.json onto a jqlora LoraConfig (rank, alpha, rsLoRA, target_modules), loads the
model with jqlora.models.load_causal_lm and sets every adapter module's weights (strict: an
adapter module that is not a linear layer of the model, a shape mismatch or an unsupported
option such as DoRA or rank_pattern is an error, exit 2). Then reports the modules matched,
the model's linear layers the adapter leaves alone, the LoRA parameter count, and how much the
adapter changes the logits on random tokens (0 means a no-op adapter, e.g. untrained B = 0).

The model defaults to the adapter's base_model_name_or_path when that is a local directory.
Once it checks out, use the adapter with `jqlora generate MODEL --adapter DIR`,
`jqlora crosscheck MODEL --adapter DIR` (against PEFT in torch) or continue training it with
`jqlora train --init-adapter DIR`. Library: jqlora.adapters.import_adapter."""


def _import_args(p):
    p.add_argument("adapter", help="PEFT adapter directory")
    p.add_argument("--model", default=None, help="base checkpoint (default: adapter_config's base_model_name_or_path)")
    p.add_argument("--tokens", type=int, default=16, help="random tokens per row for the logits-change check")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def _import_run(args) -> int:
    from jqlora.adapters import import_adapter

    model = None if args.model is None else str(model_dir(args.model))
    r = import_adapter(args.adapter, model, tokens=args.tokens, dtype=args.dtype,
                       quantize_experts=quantize_experts(args, import_.QUANTIZE_EXPERTS))
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"adapter {r['adapter']} -> model {r['model']}")
    print(f"  r={r['rank']} alpha={r['alpha']:g} scale={r['scale']:g} rslora={r['use_rslora']} "
          f"dropout={r['dropout']:g} targets={r['target_modules']}")
    print(f"  matched {len(r['matched'])} modules ({r['lora_params']} LoRA parameters); "
          f"{len(r['untouched'])} linear layers without LoRA" + (f" (e.g. {r['untouched'][0]})" if r["untouched"] else ""))
    if r["zero_B_modules"]:
        print(f"  note: {len(r['zero_B_modules'])} modules have lora_B == 0 (no effect), e.g. {r['zero_B_modules'][0]}")
    print(f"  logits change vs the base model on {tuple(r['tokens_shape'])} random tokens: max |delta| = "
          f"{r['logits_max_abs_change']:.4e} (max |logit| {r['logits_max_abs']:.3e})")
    print("OK: the adapter applies to this model", file=sys.stderr)
    return 0


import_ = types.SimpleNamespace(
    HELP="check a PEFT adapter against a model: modules matched, shapes, effect on logits",
    DESCRIPTION=IMPORT_DESCRIPTION, add_arguments=_import_args, run=_import_run, QUANTIZE_EXPERTS="auto")
