"""The issue's performance targets checked against one benchmark run, cell by cell.

    python -m benchmarks.targets benchmarks/results/<gpu>-<date>[_tag].json

Every ratio comes from that one run (device time / `jnp.dot` bf16 device time, same shape), as
the protocol asks. `benchmarks.run` appends the same table to the markdown it writes. A cell is
met when the ratio is at or below the target on all three protocol shapes; a shape the run did not
measure shows as "-" and leaves its target unmet (not assumed).
"""
from __future__ import annotations

import json
import sys

BASELINE = "jnp.dot bf16"
NF4 = "qmatmul pallas (auto plan)"
INT8 = "int8 qmatmul pallas"
BNB, TORCH = "bitsandbytes matmul_4bit", "torch bf16 x @ W.T"
SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
# (label, contender, M, pass: "fwd" or "fwd_bwd", target ratio), from the issue
TARGETS = (
    [("NF4", NF4, m, "fwd", t) for m, t in ((1, 0.33), (16, 0.40), (128, 0.80), (2048, 1.05),
                                            (8192, 1.02))]
    + [("NF4", NF4, m, "fwd_bwd", t) for m, t in ((128, 1.0), (2048, 1.05), (8192, 1.03))]
    + [("INT8", INT8, m, "fwd", t) for m, t in ((1, 0.6), (2048, 1.05), (8192, 1.05))]
)
DEQUANT_TARGET = 0.80  # of the measured copy bandwidth
MEMORY_TARGET_LAYERS = 1.0  # peak growth over packed weights + activations, in dense layers


def _ratio(rows: dict, name: str, ref: str, key: str):
    try:
        return rows[name][f"{key}_ms"] / rows[ref][f"{key}_ms"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _cells(res: dict) -> dict:
    return {(c["m"], c["k"], c["n"]): c["rows"] for c in res.get("matmul", [])}


def _fmt(values) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def status_rows(res: dict) -> list[dict]:
    """One dict per target: the three shapes' ratios, bitsandbytes' own ratios, and `met`."""
    cells = _cells(res)
    out = []
    for label, name, m, key, target in TARGETS:
        rows = [cells.get((m, k, n), {}) for k, n in SHAPES_KN]
        ours = [_ratio(r, name, BASELINE, key) for r in rows]
        bnb = [_ratio(r, BNB, TORCH, key) for r in rows] if label == "NF4" else None
        out.append(dict(weights=label, m=m, pass_=key, target=target, ratios=ours,
                        bitsandbytes=bnb,
                        met=all(v is not None and v <= target for v in ours)))
    return out


def markdown(res: dict) -> str:
    lines = ["## targets (ratios of this run; 4096x4096 / 4096x14336 / 14336x4096)", "",
             "| weights | M | pass | target | jqlora | met | bitsandbytes (vs torch bf16) |",
             "|---|---|---|---|---|---|---|"]
    for r in status_rows(res):
        bnb = "" if r["bitsandbytes"] is None else _fmt(r["bitsandbytes"])
        lines.append(f"| {r['weights']} | {r['m']} | {r['pass_'].replace('_', '+')} | "
                     f"<= {r['target']:g} | {_fmt(r['ratios'])} | "
                     f"{'yes' if r['met'] else 'no'} | {bnb} |")
    d = res.get("dequant") or {}
    best = max((v.get("fraction_of_copy", 0.0) for v in d.get("variants", {}).values()),
               default=None)
    if best is not None:
        lines.append(f"| NF4 dequant | - | - | >= {DEQUANT_TARGET:g} of copy | {best:.2f} | "
                     f"{'yes' if best >= DEQUANT_TARGET else 'no'} | |")
    mem = (res.get("memory") or {}).get("qmatmul") or {}
    layers = mem.get("growth_minus_activations_in_dense_layers")
    if layers is not None:
        lines.append(f"| NF4 memory, 32 layers | 2048 | fwd+bwd | <= {MEMORY_TARGET_LAYERS:g} "
                     f"dense layer | {layers:+.2f} layers | "
                     f"{'yes' if layers <= MEMORY_TARGET_LAYERS else 'no'} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(markdown(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
