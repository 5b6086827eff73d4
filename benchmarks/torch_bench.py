"""torch contenders (bf16 x @ W.T, bitsandbytes.matmul_4bit), timed in their OWN process.

torch.profiler (Kineto) and JAX's CUPTI-based `measure` both subscribe to CUPTI; once Kineto has
run in a process, later JAX measurements in it come out several times too slow (a bf16 copy at
a third of its bandwidth; benchmarks/results/JOURNAL.md). So `benchmarks.run` measures every JAX contender first
and then calls this module in a subprocess:
    python -m benchmarks.torch_bench --cells 1x4096x4096,16x4096x4096 --iterations 10
It prints one JSON object {"MxKxN": {contender: {"fwd_ms", "fwd_bwd_ms"}}}.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.timing import l2_defeating_copies, torch_device_ms


def torch_rows(k, n, m, iterations, log):
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    rows = {}
    dev = "cuda"
    copies = l2_defeating_copies(n * k * 2)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def fwd():
        for w in ws:
            x @ w.T

    def fwd_bwd():
        for w in ws:
            xx = x.detach().requires_grad_(True)
            (xx @ w.T).backward(dy)

    rows["torch bf16 x @ W.T"] = {"fwd_ms": torch_device_ms(fwd, iterations) / copies,
                                  "fwd_bwd_ms": torch_device_ms(fwd_bwd, iterations) / copies}
    log(f"  M={m} K={k} N={n} torch bf16: {rows['torch bf16 x @ W.T']}")
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
    except Exception as e:  # noqa: BLE001
        rows["bitsandbytes matmul_4bit"] = {"error": f"not importable: {e}"[:200]}
        return rows
    nq = l2_defeating_copies(n * k // 2)
    qs = [F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True) for w in (ws * nq)[:nq]]

    def bfwd():
        for p, st in qs:
            bnb.matmul_4bit(x, p.t(), st)

    def bfwd_bwd():
        for p, st in qs:
            xx = x.detach().requires_grad_(True)
            bnb.matmul_4bit(xx, p.t(), st).backward(dy)

    rows["bitsandbytes matmul_4bit"] = {"fwd_ms": torch_device_ms(bfwd, iterations) / nq,
                                        "fwd_bwd_ms": torch_device_ms(bfwd_bwd, iterations) / nq}
    log(f"  M={m} K={k} N={n} bnb: {rows['bitsandbytes matmul_4bit']}")
    return rows



def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True, help="comma list of MxKxN")
    p.add_argument("--iterations", type=int, default=10)
    a = p.parse_args(argv)
    out = {}
    for cell in a.cells.split(","):
        m, k, n = (int(v) for v in cell.split("x"))
        out[cell] = torch_rows(k, n, m, a.iterations, lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
