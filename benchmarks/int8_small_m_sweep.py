"""Small-M INT8 (weight-only) sweep: the int8 kernels and `matmul_int8_gemv` configs at M <= 16.

    OUT=/tmp/out SWEEP_BUDGET=150 python -m benchmarks.int8_small_m_sweep

Each record is one JSON line on stdout (device time per product, the weight streamed from HBM,
see benchmarks/timing.py); all go to $OUT/int8_small_m_sweep.json. The full config grid runs on
the first shape; the other shapes get the six fastest configs of the first. Every gemv config's
output is checked against `matmul_int8_reference` on the first weight copy (max |err| / max |y|).
"""
from __future__ import annotations

import itertools
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.timing import jax_device_ms, l2_defeating_copies
from jqlora import ops, quant
from pallas_kernels.matmul_int8 import matmul_int8, matmul_int8_reference, matmul_int8_splitk
from pallas_kernels.matmul_int8_gemv import matmul_int8_gemv

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
GRID = [dict(block_n=bn, block_k=bk, num_warps=nw, reduce_at_end=re)
        for bn, bk, nw, re in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (False, True))]


def _us(fn, args, copies):
    try:
        return round(jax_device_ms(fn, *args, iterations=10) / copies * 1e3, 2)
    except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
        return f"{type(e).__name__}: {str(e)[:300]}"


def _rel_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
                 / jnp.maximum(jnp.max(jnp.abs(want.astype(jnp.float32))), 1e-30))


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    budget = float(os.environ.get("SWEEP_BUDGET", "150"))
    records = []

    def record(**kw):
        records.append(kw)
        print(json.dumps(kw), flush=True)

    t0 = time.time()
    ranked = None
    for si, (k, n) in enumerate(SHAPES_KN):
        dense_copies = l2_defeating_copies(n * k * 2)
        copies = l2_defeating_copies(n * k)
        dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
                 for i in range(max(copies, dense_copies))]
        qs = [quant.quantize_int8(w) for w in dense[:copies]]
        for m in (1, 4, 16):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            cell = dict(k=k, n=n, m=m)
            record(**cell, what="bf16 dot", us=_us(
                lambda x, ws: [x @ w.T for w in ws], (x, dense[:dense_copies]), dense_copies))
            record(**cell, what="qmatmul xla", us=_us(
                lambda x, qs: [ops.qmatmul(x, q, backend="xla") for q in qs], (x, qs), copies))
            record(**cell, what="int8_weight_only", us=_us(
                lambda x, qs: [matmul_int8(x, q.cb, q.scb) for q in qs], (x, qs), copies))
            record(**cell, what="int8_weight_only_splitk", us=_us(
                lambda x, qs: [matmul_int8_splitk(x, q.cb, q.scb) for q in qs], (x, qs), copies))
            if m > 4:
                continue
            want = matmul_int8_reference(x, qs[0].cb, qs[0].scb)
            grid = [{}] + (GRID if si == 0 and m == 1 else (ranked or [])[:6])
            results = []
            for cfg in grid:
                if time.time() - t0 > budget and cfg:
                    break
                us = _us(lambda x, qs, cfg=cfg: [matmul_int8_gemv(x, q.cb, q.scb, **cfg) for q in qs],
                         (x, qs), copies)
                err = None if isinstance(us, str) else _rel_err(
                    matmul_int8_gemv(x, qs[0].cb, qs[0].scb, **cfg), want)
                record(**cell, what="gemv", cfg=cfg, us=us, rel_err=err)
                if cfg and not isinstance(us, str):
                    results.append((us, cfg))
            if si == 0 and m == 1:
                ranked = [c for _, c in sorted(results, key=lambda r: r[0])]
    with open(os.path.join(out_dir, "int8_small_m_sweep.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
