"""`jqlora export-merged`: a training run or a PEFT adapter merged into its base model, as a folder
that plain transformers (bf16, float32) or transformers + bitsandbytes (nf4) loads."""
from __future__ import annotations

from jqlora.cli._common import CLIError, disk_error

FORMATS = ("bf16", "float32", "nf4")  # jqlora.merge.FORMATS, repeated so --help imports no jax

HELP = "a training run or PEFT adapter merged into its base model (bf16, float32 or NF4 folder)"
DESCRIPTION = """\
Merge LoRA weights into the base model and write a Hugging Face folder that needs no peft:

  --format bf16     dense bfloat16 weights; AutoModelForCausalLM.from_pretrained(OUT) loads it
                    with plain transformers (no bitsandbytes)
  --format float32  the same in float32 (exact merged values, for checks)
  --format nf4      the merged weights quantized again to bitsandbytes NF4 (the base weight's
                    blocksize and double quantization) with a quantization_config: loads in
                    transformers + bitsandbytes and in jqlora; NF4 weights without LoRA keep their bytes

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
Library: jqlora.merge.merge_run, jqlora.merge.merge_adapter."""


def add_arguments(p):
    p.add_argument("source", help="training out_dir (or its checkpoints/ or a step_XXXXXXXX dir); with --adapter, "
                                  "the base model folder")
    p.add_argument("out", help="folder to write (must not exist)")
    p.add_argument("--format", choices=FORMATS, default="bf16", help="what the merged weights are stored as")
    p.add_argument("--adapter", default=None, metavar="DIR", help="merge this PEFT adapter into SOURCE (a base model)")
    p.add_argument("--model", default=None, help="base checkpoint of a run (None: the one in jqlora_run.json)")
    p.add_argument("--step", type=int, default=None, help="merge this step's checkpoint of a run (None: the newest)")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="split the weights into shards of at most this many GB (10^9 bytes)")


def run(args) -> int:
    if args.adapter is not None and (args.model is not None or args.step is not None):
        raise CLIError("--model and --step choose a run's checkpoint and base; with --adapter, SOURCE is the base "
                       "model and there is no step")
    if not args.max_shard_gb > 0:
        raise CLIError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    from jqlora._util import quiet_third_party

    quiet_third_party()
    from jqlora import merge

    shard = int(args.max_shard_gb * 10**9)
    try:
        if args.adapter is not None:
            r = merge.merge_adapter(args.source, args.adapter, args.out, format=args.format, max_shard_bytes=shard)
            what = f"adapter {r['adapter']}"
        else:
            r = merge.merge_run(args.source, args.out, format=args.format, step=args.step, model_path=args.model,
                                max_shard_bytes=shard)
            what = f"step {r['step']} ({r['checkpoint']})"
    except OSError as e:
        err = disk_error(e)
        if err is None:
            raise
        raise err from None
    quant = f", {r['quantized']} weights quantized to NF4" if r["format"] == "nf4" else ""
    print(f"merged {what} into {r['base']}: {r['merged']} LoRA modules, r={r['rank']}, alpha={r['alpha']:g}, "
          f"scale={r['scale']:g}{quant} -> {r['out']} ({r['format']})")
    return 0
