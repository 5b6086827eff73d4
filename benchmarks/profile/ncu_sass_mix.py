"""Instruction mix and stall reasons per SASS opcode from an Nsight Compute source export:

    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.profile.ncu_sass_mix sass.csv WEIGHTS

Prints, per opcode: warp instructions executed, their share, thread instructions per weight
(WEIGHTS = N x K of the profiled product), warp-stall samples, and shared-memory and global (L1)
traffic where the export has it.
"""
from __future__ import annotations

import collections
import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def mix(path: str, weights: float) -> list[str]:
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr = rows[start]
    col = {name: i for i, name in enumerate(hdr)}
    stall_cols = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
    per_op = collections.defaultdict(lambda: collections.Counter())
    for r in rows[start + 1:]:
        if len(r) != len(hdr) or not r[col["Source"]].strip():
            continue
        op = r[col["Source"]].split()[0]
        if op.startswith("@"):  # predicate guard
            op = r[col["Source"]].split()[1]
        op = op.split(".")[0]
        c = per_op[op]
        c["warp"] += _num(r[col["Instructions Executed"]])
        c["thread"] += _num(r[col["Thread Instructions Executed"]])
        c["samples"] += _num(r[col["Warp Stall Sampling (All Samples)"]])
        c["smem_wavefronts"] += _num(r[col.get("L1 Wavefronts Shared", 0)])
        c["smem_ideal"] += _num(r[col.get("L1 Wavefronts Shared Ideal", 0)])
        c["l1_tag_global"] += _num(r[col.get("L1 Tag Requests Global", 0)])
        for s in stall_cols:
            c[s] += _num(r[col[s]])
    total = sum(c["warp"] for c in per_op.values())
    samples = sum(c["samples"] for c in per_op.values())
    out = [f"total {total:.0f} warp instructions = {32 * total / weights:.2f} thread "
           f"instructions per weight; {samples:.0f} stall samples"]
    for op, c in sorted(per_op.items(), key=lambda kv: -kv[1]["warp"])[:24]:
        top = sorted(((c[s], s) for s in stall_cols), reverse=True)[:2]
        stalls = ", ".join(f"{s.removeprefix('stall_')} {v:.0f}" for v, s in top if v)
        extra = ""
        if c["smem_wavefronts"]:
            extra += f" smem wavefronts {c['smem_wavefronts']:.0f} (ideal {c['smem_ideal']:.0f})"
        if c["l1_tag_global"]:
            extra += f" L1 tag requests {c['l1_tag_global']:.0f}"
        out.append(f"{op:8s} {c['warp']:10.0f} {100 * c['warp'] / total:5.1f}% "
                   f"{32 * c['warp'] / weights:5.2f}/weight  samples {c['samples']:6.0f} "
                   f"({100 * c['samples'] / max(samples, 1):4.1f}%: {stalls}){extra}")
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stdout if args[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    print("\n".join(mix(args[0], float(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
