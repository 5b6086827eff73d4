"""`jqlora inspect PATH`: what a (bitsandbytes-quantized or plain) HF checkpoint holds."""
from __future__ import annotations

import json

from jqlora._util import fmt_bytes
from jqlora.cli._common import model_dir

HELP = "per-tensor format, shapes and bytes of a bitsandbytes checkpoint, with totals"
DESCRIPTION = """\
Read a Hugging Face checkpoint directory (config.json + model.safetensors or a sharded index)
through interop.load_bnb_checkpoint, which validates every tensor, and list per entry
(library: interop.inspect.inspect_checkpoint):

  name      module name for a quantized linear layer (model.layers.0.self_attn.q_proj),
            the full tensor key for everything else (model.norm.weight)
  kind      nf4 | fp4 (bitsandbytes 4-bit), int8 (LLM.int8), plain (unquantized)
  block     4-bit blocksize (- otherwise)
  nested    4-bit double quantization (absmax stored as 8-bit codes)
  dtype     the weight's dtype when it was quantized (quant_state metadata), or the stored dtype
  shape     logical shape ((out_features, in_features) for a linear layer)
  bytes     bytes of all its tensors (packed codes + scales + tables for quantized weights)

Totals: quantized bytes, plain bytes, parameters (logical elements) and effective bits per
parameter (8 * bytes / parameters), overall and over the quantized weights alone.

Every tensor is read (on the CPU) so that it is validated: this takes as long as loading the
checkpoint. Exit status 2 with a message naming the file and tensor when it is malformed."""


def add_arguments(p):
    p.add_argument("path", help="checkpoint directory (or a single .safetensors file with config.json beside it), "
                                "or a Hugging Face model id org/name[@revision]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--limit", type=int, default=None,
                   help="show at most this many rows in the table (totals always cover everything)")


def _table(info: dict, limit=None) -> str:
    rows = info["tensors"]
    shown = rows if limit is None else rows[:limit]
    head = ("name", "kind", "block", "nested", "dtype", "shape", "bytes")
    body = [(r["name"], r["kind"], str(r["blocksize"] or "-"), "yes" if r["nested"] else "-", r["dtype"],
             "x".join(map(str, r["shape"])) or "()", str(r["bytes"])) for r in shown]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i == 6 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    lines = [f"checkpoint: {info['path']} (model_type {info['model_type']})", fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more rows (--limit)")
    t = info["totals"]
    bpp = f"{t['bits_per_param']:.3f}" if t["bits_per_param"] is not None else "-"
    bpq = f"{t['bits_per_quantized_param']:.3f}" if t["bits_per_quantized_param"] is not None else "-"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(t["by_kind"].items()))
    lines += [
        "",
        f"entries:          {t['entries']} ({kinds})",
        f"quantized bytes:  {t['quantized_bytes']} ({fmt_bytes(t['quantized_bytes'])}) over {t['quantized_params']} params"
        f" = {bpq} bits/param",
        f"plain bytes:      {t['plain_bytes']} ({fmt_bytes(t['plain_bytes'])}) over {t['plain_params']} params",
        f"parameters:       {t['params']}",
        f"total bytes:      {t['total_bytes']} ({fmt_bytes(t['total_bytes'])}); files on disk {t['file_bytes']}",
        f"effective bits/param: {bpp}",
    ]
    return "\n".join(lines)


def run(args) -> int:
    from interop.inspect import inspect_checkpoint

    from pathlib import Path

    path = args.path if Path(args.path).is_file() else str(model_dir(args.path, "PATH"))
    info = inspect_checkpoint(path)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(_table(info, args.limit))
    return 0
