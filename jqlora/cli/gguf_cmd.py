"""`jqlora export-gguf`: a training run or a PEFT adapter merged into its base model and written as
one GGUF file for llama.cpp (or the adapter alone, in llama.cpp's LoRA adapter format)."""
from __future__ import annotations

from jqlora.cli._common import CLIError, disk_error, model_dir

TYPES = ("bf16", "q8_0")  # jqlora.gguf_export.TYPES, repeated so --help imports no jax

HELP = "a training run or PEFT adapter merged into its base model, as one GGUF file for llama.cpp"
DESCRIPTION = """\
Merge LoRA weights into the base model and write one GGUF file that llama.cpp loads (and
transformers with gguf_file=, and gguf.GGUFReader):

  --type bf16   2-D tensors in BF16 (the numbers of `jqlora export-merged --format bf16`)
  --type q8_0   2-D tensors in Q8_0, embeddings too (rows not a multiple of 32: F16)

Norms and biases are F32 either way. SOURCE is a training output directory (its checkpoints/ or
one step_XXXXXXXX directory; the newest checkpoint, or --step's, merged into the base model of
jqlora_run.json, or --model), or with --adapter the base model folder and DIR a PEFT LoRA adapter.

The file follows llama.cpp's convert_hf_to_gguf.py: architecture llama (model_type llama and
mistral), qwen2 or qwen3; llama's Q/K rows permuted for its rope; hyperparameters; the base
folder's tokenizer embedded (byte-level BPE: tokens, types, merges, the pre-tokenizer's llama.cpp
name, special ids, chat template). Other model types, sliding-window attention, non-SiLU
activations and other tokenizers are errors (exit 2). --lora-only writes the adapter alone
(general.type adapter, adapter.lora.alpha, blk.N.attn_q.weight.lora_a/.lora_b) for llama.cpp's
--lora. An existing OUT is refused unless --force; the file appears only once complete.
Library: jqlora.gguf_export.export_gguf."""


def add_arguments(p):
    p.add_argument("source", help="training out_dir (or its checkpoints/ or a step_XXXXXXXX dir); with --adapter, "
                                  "the base model folder")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", choices=TYPES, default="bf16", help="the type of the 2-D tensors")
    p.add_argument("--adapter", default=None, metavar="DIR", help="merge this PEFT adapter into SOURCE (a base model)")
    p.add_argument("--model", default=None, help="base checkpoint of a run, a folder or a Hugging Face model id "
                                                 "(None: the one in jqlora_run.json)")
    p.add_argument("--step", type=int, default=None, help="export this step's checkpoint of a run (None: the newest)")
    p.add_argument("--lora-only", action="store_true",
                   help="write the LoRA adapter alone (llama.cpp's adapter GGUF), not the merged model")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def _progress(done: int, total: int, name: str) -> None:
    """A line on a terminal's stderr every tenth of the tensors (nothing when stderr is a file)."""
    import sys

    if sys.stderr.isatty() and (done == total or done % max(1, total // 10) == 0):
        print(f"  {done}/{total} tensors written ({name})", file=sys.stderr, flush=True)


def run(args) -> int:
    if args.adapter is not None and (args.model is not None or args.step is not None):
        raise CLIError("--model and --step choose a run's checkpoint and base; with --adapter, SOURCE is the base "
                       "model and there is no step")
    model = None if args.model is None else str(model_dir(args.model))
    source = str(model_dir(args.source, "SOURCE")) if args.adapter is not None else args.source
    from jqlora._util import fmt_bytes, quiet_third_party

    quiet_third_party()
    from jqlora.gguf_export import export_gguf

    try:
        r = export_gguf(source, args.out, type=args.type, adapter=args.adapter, step=args.step,
                        model_path=model, lora_only=args.lora_only, force=args.force,
                        progress=_progress)
    except OSError as e:
        err = disk_error(e)
        if err is None:
            raise
        raise err from None
    what = f"adapter {r['adapter']}" if "adapter" in r else f"step {r['step']} ({r['checkpoint']})"
    if r["lora_only"]:
        head = f"wrote the LoRA weights of {what} (base {r['base']})"
    else:
        head = f"merged {what} into {r['base']}"
    print(f"{head}: {r['merged']} LoRA modules, r={r['rank']}, alpha={r['alpha']:g}, "
          f"scale={r['scale']:g} -> {r['out']} (GGUF {r['arch']}, {r['type']}, {r['tensors']} tensors, "
          f"{fmt_bytes(r['bytes'])})")
    return 0
