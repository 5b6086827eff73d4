"""`jqlora export-merged`: a training run or a PEFT adapter merged into its base model, as a folder
that plain transformers (bf16, float32) or transformers + bitsandbytes (nf4) loads."""
from __future__ import annotations

import sys

from jqlora.cli._common import CLIError, disk_error, model_dir

FORMATS = ("bf16", "float32", "nf4")  # jqlora.merge.FORMATS, repeated so --help imports no jax
DEFAULT_MIN_KEPT = 0.5  # jqlora.merge.DEFAULT_MIN_KEPT, likewise

HELP = "a training run or PEFT adapter merged into its base model (bf16, float32 or NF4 folder)"
DESCRIPTION = """\
Merge LoRA weights into the base model and write a Hugging Face folder that needs no peft:

  --format bf16     dense bfloat16 weights; AutoModelForCausalLM.from_pretrained(OUT) loads it
                    with plain transformers (no bitsandbytes)
  --format float32  the same in float32 (exact merged values, for checks)
  --format nf4      the merged weights quantized again to bitsandbytes NF4 (the base weight's
                    blocksize and double quantization) with a quantization_config: loads in
                    transformers + bitsandbytes and in jqlora; NF4 weights without LoRA keep their bytes.
                    A mixture-of-experts model's experts and routers stay dense (per expert, in the
                    checkpoint's dtype), as transformers + bitsandbytes write them: transformers 5
                    cannot load 4-bit experts; jqlora quantizes them to NF4 at load

SOURCE is a training output directory (as `jqlora train` writes it), its checkpoints/ directory
or one checkpoints/step_XXXXXXXX directory: the newest checkpoint (or --step's) is validated and
merged into the base model recorded in jqlora_run.json (--model overrides it). With --adapter,
SOURCE is the base model folder and DIR a PEFT LoRA adapter for it.

Each target weight becomes dequant(W) + scale * B @ A in float32 (scale = alpha / r, or
alpha / sqrt(r) with rsLoRA), W dequantized in float32 as jqlora computes it (bitsandbytes rounds
a bf16-stored weight to bf16 first, so PEFT over bitsandbytes differs by that rounding). Embeddings, norms and lm_head are copied (cast to bf16 / float32
in the dense formats, as stored in nf4), and so are the tokenizer files and
generation_config.json. Tensors are written one at a time and the folder appears only once
complete. An adapter module missing from the base, a shape mismatch or a target module without
adapter weights is an error naming the tensor (exit 2).

Re-quantizing to NF4 can throw the fine-tune away: a delta below NF4's resolution leaves the
4-bit codes as they were and the folder answers like the base model. So --format nf4 first
measures, per merged layer, the adapter's effect on 256 fixed random inputs X,
effect_true = X (scale B A)^T, against what the NF4 weights keep of it, effect_kept =
X (dequant(W'_nf4) - dequant(W_nf4))^T, and prints kept = 1 - ||effect_kept - effect_true|| /
||effect_true|| (norms summed over the layers, at least 0; 100% is a perfect merge, 0% the base
model) and how many 4-bit codes changed.
Below --min-kept it writes nothing and exits 2 (--format bf16 keeps the merge exactly; --force
writes the NF4 folder anyway, with a warning).
Library: jqlora.merge.merge_run, jqlora.merge.merge_adapter."""


def add_arguments(p):
    p.add_argument("source", help="training out_dir (or its checkpoints/ or a step_XXXXXXXX dir); with --adapter, "
                                  "the base model folder")
    p.add_argument("out", help="folder to write (must not exist)")
    p.add_argument("--format", choices=FORMATS, default="bf16", help="what the merged weights are stored as")
    p.add_argument("--adapter", default=None, metavar="DIR", help="merge this PEFT adapter into SOURCE (a base model)")
    p.add_argument("--model", default=None, help="base checkpoint of a run, a folder or a Hugging Face model id "
                                                 "(None: the one in jqlora_run.json)")
    p.add_argument("--step", type=int, default=None, help="merge this step's checkpoint of a run (None: the newest)")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="split the weights into shards of at most this many GB (10^9 bytes)")
    p.add_argument("--min-kept", type=float, default=DEFAULT_MIN_KEPT, metavar="FRACTION",
                   help="nf4: refuse to write when re-quantization keeps less than this share (0..1) of the "
                        "adapter's effect")
    p.add_argument("--force", action="store_true",
                   help="nf4: write the folder even below --min-kept (with a warning)")


def run(args) -> int:
    if args.adapter is not None and (args.model is not None or args.step is not None):
        raise CLIError("--model and --step choose a run's checkpoint and base; with --adapter, SOURCE is the base "
                       "model and there is no step")
    if not args.max_shard_gb > 0:
        raise CLIError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    if not 0 <= args.min_kept <= 1:
        raise CLIError(f"--min-kept is a share between 0 and 1 (0.5 = 50%), got {args.min_kept:g}")
    model = None if args.model is None else str(model_dir(args.model))
    source = str(model_dir(args.source, "SOURCE")) if args.adapter is not None else args.source
    from jqlora._util import quiet_third_party

    quiet_third_party()
    from jqlora import merge

    shard = int(args.max_shard_gb * 10**9)
    kw = dict(format=args.format, max_shard_bytes=shard, min_kept=args.min_kept, force=args.force)
    try:
        if args.adapter is not None:
            r = merge.merge_adapter(source, args.adapter, args.out, **kw)
            what = f"adapter {r['adapter']}"
        else:
            r = merge.merge_run(source, args.out, step=args.step, model_path=model, **kw)
            what = f"step {r['step']} ({r['checkpoint']})"
    except merge.RequantizationError as e:
        raise CLIError(f"{_kept_line(e.report, 'would keep')}, below --min-kept {args.min_kept:.0%}: "
                       f"{_consequence(e.report['kept'], 'would')}; nothing written to {args.out}. --format bf16 "
                       f"keeps the merge exactly; --force writes the NF4 folder anyway") from None
    except OSError as e:
        err = disk_error(e)
        if err is None:
            raise
        raise err from None
    quant = f", {r['quantized']} weights quantized to NF4" if r["format"] == "nf4" else ""
    if r.get("experts_dense"):
        quant += f", {r['experts_dense']} expert and router weights dense (transformers 5 loads no 4-bit experts)"
    print(f"merged {what} into {r['base']}: {r['merged']} LoRA modules, r={r['rank']}, alpha={r['alpha']:g}, "
          f"scale={r['scale']:g}{quant} -> {r['out']} ({r['format']})")
    requant = r.get("requantization")
    if requant is not None:
        print(f"{_kept_line(requant, 'kept')}; --min-kept {requant['min_kept']:.0%}")
        if requant["below_min"]:
            print(f"jqlora export-merged: warning: {requant['kept']:.1%} kept is below --min-kept "
                  f"{requant['min_kept']:.0%}, written anyway (--force): {_consequence(requant['kept'], 'may')}; "
                  f"--format bf16 keeps the merge exactly", file=sys.stderr)
    return 0


def _kept_line(requant, verb: str) -> str:
    """"nf4 re-quantization kept 3.1% of the adapter's effect (...)" from a `requantization_report`."""
    return (f"nf4 re-quantization {verb} {requant['kept']:.1%} of the adapter's effect "
            f"({requant['codes_changed']} of the merged weights' {requant['codes']} 4-bit codes changed, "
            f"{100 * requant['changed_share']:.3g}%; "
            f"kept = 1 - relative error of the merged layers' outputs on fixed random inputs)")


def _consequence(kept: float, modal: str) -> str:
    if kept < 0.1:
        return f"the NF4 folder {modal} answer like the base model"
    return f"the NF4 folder {modal} lose much of the fine-tune"
