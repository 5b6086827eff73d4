"""`jqlora crosscheck PATH`: JAX vs transformers + bitsandbytes (+ PEFT) in torch, layer by layer."""
from __future__ import annotations

import json

from jqlora.cli._common import CLIError, model_dir, quantize_experts

HELP = "compare JAX with transformers+bitsandbytes(+PEFT) in torch: per-layer and logits errors"
# --quantize-experts' default: experts as stored, as transformers holds them (build_parser adds the flag)
QUANTIZE_EXPERTS = "none"
DESCRIPTION = """\
Run the same token ids through (a) transformers AutoModelForCausalLM.from_pretrained(PATH) on CPU
with bitsandbytes (and peft.PeftModel with --adapter) and (b) jqlora.models.load_causal_lm (+ the
same adapter) in JAX.

Stage 1, weights: every quantized weight is dequantized by jqlora, by bitsandbytes and by an
independent float64 decode (code table x absmax); a bitsandbytes weight that disagrees is reported
as a bitsandbytes problem (tensor and shape; the torch reference then uses the independent decode),
a jqlora weight that disagrees fails the check.

Stage 2, layers: for the embeddings, every decoder layer's output, the final norm and the logits,
max absolute error and relative error (max abs error / max |torch float32 value|), each jqlora run
against torch float32 with the same numerics: "own" (jqlora's production numerics: 4-bit weights
dequantized into the compute dtype, 8-bit weight-only), "stored-rounded" (4-bit checkpoints: each
weight rounded to its stored dtype first, as older bitsandbytes forwards do) and, for 8-bit
checkpoints, "LLM.int8" (bitsandbytes' inference numerics, int8 activations + 16-bit outliers,
against torch float32 LLM.int8).

Stage 3, LLM.int8 products (8-bit checkpoints): every 8-bit linear recomputed by jqlora on the
inputs torch's run in --dtype gave it must equal bitsandbytes' output to one ulp. End to end,
int8 activation codes that fall differently after tiny upstream differences make LLM.int8 runs
differ by whole int8 steps, so the products are where a wrong LLM.int8 computation shows.

Verdict (exit status 0 PASS, 2 FAIL): float32: the verdict run's logits relative error <=
--tolerance (default 1e-3; the verdict run is the one this bitsandbytes computes, weight-only for
8-bit checkpoints) and every LLM.int8 product agrees. bfloat16: torch runs in float32 and
bfloat16 with the same numerics (LLM.int8 for 8-bit checkpoints); PASS when jqlora's bfloat16
logits error (vs torch float32) is at most --bf16-ratio (2) times torch's own bfloat16 error and
every LLM.int8 product agrees; an explicit --tolerance bounds that error instead. The torch side
uses bitsandbytes' reference path (exact dequantize + linear); --bnb-cpu-kernel keeps its
eval-mode 4-bit CPU kernel, which rounds to bf16 internally on AVX512-BF16 CPUs (expect ~1e-2).
--int8-numerics weight_only leaves the LLM.int8 run and products out. --base-matmul fp8 adds a run
with FP8 (E4M3) base products for the 4-bit weights, its error reported beside the others and
never judged (E4M3 keeps 3 mantissa bits: a few percent per product). A mixture-of-experts
model's dense experts stay as stored (--quantize-experts none, the default here); quantized
(--quantize-experts nf4, or auto), the torch side multiplies the same dequantized experts, so the
check covers jqlora's grouped 4-bit product. --perturb X deliberately
scales layer 0's input norm of the JAX model by (1 + X): a self-test showing that the check fails
and where.
See docs/numerics.md ("Cross-checking against torch") and jqlora/crosscheck/."""


def add_arguments(p):
    p.add_argument("path", help="checkpoint directory (bitsandbytes 4/8-bit or plain), or a Hugging Face model id")
    p.add_argument("--adapter", help="PEFT adapter directory, applied on both sides")
    p.add_argument("--tokens", type=int, default=16, help="tokens per row")
    p.add_argument("--batch", type=int, default=2, help="rows")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype, both sides")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max allowed relative error of the logits (default: by dtype, see above)")
    p.add_argument("--bf16-ratio", type=float, default=2.0,
                   help="bfloat16 verdict: jqlora's error may be this many times torch's own (default 2)")
    p.add_argument("--int8-numerics", choices=("llm_int8", "weight_only"), default="llm_int8",
                   help="8-bit checkpoints: also compare bitsandbytes' LLM.int8 inference numerics and products "
                        "(llm_int8, the default), or the weight-only path only")
    p.add_argument("--base-matmul", choices=("compute", "fp8"), default="compute",
                   help="fp8: also run the JAX model with FP8 (E4M3) base products for its 4-bit weights and "
                        "report its error against torch float32 beside the others (not judged; needs "
                        "--batch x --tokens >= 256)")
    p.add_argument("--bnb-cpu-kernel", action="store_true",
                   help="torch side: keep bitsandbytes' eval-mode fused CPU 4-bit kernel")
    p.add_argument("--perturb", type=float, default=0.0, help="self-test: perturb the JAX model (see above)")
    p.add_argument("--json", action="store_true", help="print a JSON report")


def run(args) -> int:
    from jqlora._util import quiet_third_party

    if args.tokens < 1 or args.batch < 1:
        raise CLIError("--tokens and --batch must be >= 1")
    if not args.bf16_ratio > 0:
        raise CLIError("--bf16-ratio must be > 0")
    from jqlora.ops.fp8 import FP8_MIN_ROWS

    if args.base_matmul == "fp8" and args.batch * args.tokens < FP8_MIN_ROWS:
        raise CLIError(f"--base-matmul fp8: the FP8 products run from {FP8_MIN_ROWS} rows; --batch x --tokens "
                       f"is {args.batch * args.tokens} (try --tokens {-(-FP8_MIN_ROWS // args.batch)})")
    path = model_dir(args.path, "PATH")
    quiet_third_party()
    from jqlora.crosscheck import crosscheck

    res = crosscheck(str(path), adapter=args.adapter, tokens=args.tokens, batch=args.batch, seed=args.seed,
                     dtype=args.dtype, tolerance=args.tolerance, bnb_cpu_kernel=args.bnb_cpu_kernel,
                     int8_numerics=args.int8_numerics, perturb=args.perturb,
                     bf16_ratio=args.bf16_ratio, quantize_experts=quantize_experts(args, QUANTIZE_EXPERTS),
                     base_matmul=args.base_matmul)
    print(json.dumps(res.to_dict(), indent=1) if args.json else res.format())
    return 0 if res.passed else 2
