"""Small-M NF4 sweep (M = 1 and 16): `qmatmul` as dispatched against `splitk_small_m` configs.

    OUT=/tmp/out SWEEP_BUDGET=100 python -m benchmarks.small_m_sweep

For researchers tuning the small-M kernel: the weights are double-quantized (NF4, bs 64) and the
kernel de-nests in-kernel, as `qmatmul` does. Each record is one JSON line on stdout (device time
per product, weight streamed from HBM; see benchmarks/timing.py); all of them also go to
$OUT/small_m_sweep.json. SWEEP_BUDGET (seconds) caps the configs tried per (shape, M) after the
budget is spent. Results from an H200: benchmarks/results/nvidia-h200-2026-11-21_small_m_sweep.json.
"""
from __future__ import annotations

import itertools
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.sweep_setup import bf16_us, nf4_weight_copies
from benchmarks.timing import distinct_copies, us_per_product
from jqlora import ops
from jqlora.ops.products import nested_kernel_operands_4bit
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m

SHAPES_KN = ((4096, 4096), (14336, 4096))


def _grid(m: int, k: int) -> list[dict]:
    if m == 1:
        grid = [dict(block_n=bn, block_k=bk, splits=sp, num_warps=nw, reduce_at_end=re)
                for bn, bk, sp, nw, re in itertools.product(
                    (8, 16, 32), (256, 1024), (None, 1), (2, 4, 8), (False, True))]
    else:
        grid = [dict(block_n=bn, block_k=bk, num_warps=nw)
                for bn, bk, nw in itertools.product((16, 32, 64), (128, 256), (4, 8))]
    return grid if k == 4096 else grid[::4]


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    budget = float(os.environ.get("SWEEP_BUDGET", "100"))
    records = []

    def record(**kw):
        records.append(kw)
        print(json.dumps(kw), flush=True)

    t0 = time.time()
    for k, n in SHAPES_KN:
        copies, dense, qs = nf4_weight_copies(k, n)
        for m in (1, 16):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            cell = dict(k=k, n=n, m=m)
            record(**cell, what="bf16 dot", us=bf16_us(x, dense, k, n))
            for backend in ("pallas", "xla"):
                record(**cell, what=f"qmatmul {backend}", us=us_per_product(
                    lambda xs, qs, b=backend: [ops.qmatmul(a, q, backend=b) for a, q in zip(xs, qs)],
                    (distinct_copies(x, copies), qs), copies))
            for cfg in _grid(m, k):
                def run(x, qs, cfg=cfg):
                    outs = []
                    for q in qs:
                        packed, codes, nested = nested_kernel_operands_4bit(q)
                        outs.append(matmul_4bit_small_m(x, packed, codes, q.code, blocksize=64,
                                                        nested=nested, **cfg))
                    return outs
                record(**cell, what="nested kernel", cfg=cfg, us=us_per_product(run, (x, qs), copies))
                if time.time() - t0 > budget:
                    break
    with open(os.path.join(out_dir, "small_m_sweep.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
