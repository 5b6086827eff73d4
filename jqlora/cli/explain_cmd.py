"""`jqlora explain-kernel`: which kernel `auto` (or a given backend) picks for a product, and why."""
from __future__ import annotations

import json

from jqlora.cli._common import CLIError

WEIGHTS = ("nf4", "fp4", "int8", "llm_int8")
GROUPED_WEIGHTS = ("nf4", "fp4", "int8", "dense")  # with --experts
DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("current", "hopper", "gpu", "cpu")
BACKENDS = ("auto", "pallas", "interpret", "xla")

HELP = "which kernel variants a quantized product x (M, K) . W (N, K)^T runs, and why"
DESCRIPTION = f"""\
Explain the kernel choice of jqlora.ops.dispatch for one product y = x . W^T with x (M, K) in
--dtype and a quantized weight W (N, K): the plan (backend, forward and backward kernel
variant) and the candidates considered, one row each (product, variant, verdict: chosen, or
why it declined). Nothing is compiled or run, so --device can name a machine other than this one.

  --weight   {', '.join(WEIGHTS)} (llm_int8: int8 weights with LLM.int8 outlier numerics)
  --device   current (this machine), hopper (an sm90 GPU), gpu (a GPU without sm90), cpu
  --backend  auto (the dispatch table), pallas, interpret or xla (what that backend runs)
  --experts  E: the grouped product of a mixture-of-experts layer (qgmm) instead, x's M rows
             sorted over E stacked (N, K) experts (--weight may then be dense: a bf16 stack)

--json prints {{"backend", "fwd", "bwd", "rows": [{{"product", "variant", "verdict"}}, ...]}}.
Library: jqlora.ops.dispatch.explain (jqlora.ops.grouped_dispatch.explain_grouped with --experts).
Bad values exit with status 2 and one line."""


def add_arguments(p):
    p.add_argument("--weight", required=True, metavar="{" + ",".join(WEIGHTS) + "}", help="weight format")
    p.add_argument("--m", required=True, help="rows of x (tokens in the batch)")
    p.add_argument("--n", required=True, help="output features (rows of W)")
    p.add_argument("--k", required=True, help="input features (columns of W)")
    p.add_argument("--blocksize", default="64", help="4-bit quantization blocksize")
    p.add_argument("--dtype", default="bfloat16", metavar="{" + ",".join(DTYPES) + "}", help="compute dtype")
    p.add_argument("--device", default="current", metavar="{" + ",".join(DEVICES) + "}", help="target device")
    p.add_argument("--backend", default="auto", metavar="{" + ",".join(BACKENDS) + "}", help="qmatmul backend")
    p.add_argument("--experts", default=None, help="explain the grouped (MoE) product over this many experts")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")


def _choice(flag: str, value: str, allowed: tuple) -> str:
    if value not in allowed:
        raise CLIError(f"{flag}: {value!r} is not one of {', '.join(allowed)}")
    return value


def _positive(flag: str, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise CLIError(f"{flag}: expected a positive integer, got {text!r}") from None
    if v < 1:
        raise CLIError(f"{flag}: expected a positive integer, got {v}")
    return v


def _device(name: str):
    """--device -> a dispatch.Device, or None for the machine this runs on."""
    from jqlora.ops.dispatch import Device

    if name == "current":
        return None
    return {"hopper": Device(platform="gpu", sm90=True), "gpu": Device(platform="gpu", sm90=False),
            "cpu": Device(platform="cpu", sm90=False)}[name]


def run(args) -> int:
    experts = getattr(args, "experts", None)
    experts = None if experts is None else _positive("--experts", experts)
    weight = _choice("--weight", args.weight, WEIGHTS if experts is None else GROUPED_WEIGHTS)
    dtype = _choice("--dtype", args.dtype, DTYPES)
    device = _choice("--device", args.device, DEVICES)
    backend = _choice("--backend", args.backend, BACKENDS)
    m, n, k = (_positive(f"--{d}", getattr(args, d)) for d in ("m", "n", "k"))
    blocksize = _positive("--blocksize", args.blocksize)

    from jqlora._util import jnp_dtype
    from jqlora.ops.dispatch import explain
    from jqlora.ops.grouped_dispatch import explain_grouped

    if experts is None:
        e = explain(weight, m, n, k, blocksize=blocksize, dtype=jnp_dtype(dtype), device=_device(device),
                    backend=backend)
    else:
        e = explain_grouped(weight, m, n, k, experts, blocksize=blocksize, dtype=jnp_dtype(dtype),
                            device=_device(device), backend=backend)
    if args.json:
        p = e.plan
        print(json.dumps({"backend": p.backend, "fwd": p.fwd, "bwd": p.bwd,
                          "rows": [{"product": a, "variant": b, "verdict": c} for a, b, c in e.rows]},
                         indent=1, default=str))
    else:
        print(str(e))
    return 0
