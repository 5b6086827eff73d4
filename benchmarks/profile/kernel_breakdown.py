"""Per-kernel device times of one `qmatmul` call: where the time of a cell goes.

    OUT=/tmp/out python -m benchmarks.profile.kernel_breakdown [--ms 1,2048]

For NF4 (bs 64, double quant) and INT8 weights at each (M, K, N) of the protocol's shapes, runs
`qmatmul(backend="pallas")` (the auto plan's kernels) over L2-defeating weight copies and reports
each kernel's median device time per call (CUPTI, `profiler.measure(aggregate=False)`), with the
bf16 `x @ w.T` time of the same cell. Output: JSON lines + $OUT/kernel_breakdown.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, l2_defeating_copies
from jqlora import ops, quant

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))


def per_kernel_us(fn, args, copies: int, iterations: int = 10) -> dict:
    """{kernel name: median us per call}; kernels of one name within a call are summed."""
    from jax.experimental.mosaic.gpu import profiler

    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    _, timings = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    per_iter = []
    for it in timings:
        acc = collections.defaultdict(float)
        for name, ms in it:
            acc[name] += ms * 1e3 / copies
        per_iter.append(acc)
    return {name: round(statistics.median(d[name] for d in per_iter), 2) for name in per_iter[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,2048")
    a = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    records = []
    for k, n in SHAPES_KN:
        # copies per weight kind, each sweep at least twice the L2: the bf16 count for all kinds
        # would leave NF4's smaller sweeps partly in L2 and time them too fast
        copies = {kind: l2_defeating_copies(size)
                  for kind, size in (("bf16", n * k * 2), ("nf4", n * k // 2), ("int8", n * k))}
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
              for i in range(max(copies.values()))]
        weights = {"bf16": ws[:copies["bf16"]],
                   "nf4": [quant.quantize_4bit(w, "nf4", 64, True) for w in ws[:copies["nf4"]]],
                   "int8": [quant.quantize_int8(w) for w in ws[:copies["int8"]]]}
        for m in (int(v) for v in a.ms.split(",")):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            for kind, wl in weights.items():
                if kind == "bf16":
                    fn = lambda xs, wl: [x @ w.T for x, w in zip(xs, wl)]
                else:
                    fn = lambda xs, wl: [ops.qmatmul(x, q, backend="pallas") for x, q in zip(xs, wl)]
                kernels = per_kernel_us(fn, (distinct_copies(x, len(wl)), wl), len(wl))
                rec = dict(k=k, n=n, m=m, weight=kind, total_us=round(sum(kernels.values()), 2),
                           kernels=kernels)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    with open(os.path.join(out_dir, "kernel_breakdown.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
