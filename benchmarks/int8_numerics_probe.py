"""INT8 weights, both numerics, every M of the protocol: weight-only (`qmatmul` default: bf16 x
times the int8 weight dequantized per row) against LLM.int8 (`numerics="llm_int8"`:
bitsandbytes' inference numerics, x quantized per row to int8, an int8 GEMM, outlier columns in
16 bit when the weight's threshold is > 0), through XLA and through the Pallas kernel.

    python -m benchmarks.int8_numerics_probe     # one JSON line per (shape, M); $OUT/int8_numerics_probe.json

Device time per product, distinct x per product, weights streamed from HBM (benchmarks/timing.py);
`ratios` divide by the bf16 GEMM of the same cell. threshold 0 (no outlier columns) and 6.0
(bitsandbytes' default). The XLA path at 6.0 gathers the outlier columns into a fixed capacity
(`llm_int8_matmul_reference`, default min(K, 256) slots; more columns fall back to the dense
masked product); the Pallas kernel keeps its dense mask. Two activations per cell, their outlier
column counts in `outlier_cols`:
- "gaussian": random normal bf16 x; |x| >= 6 is rare at these sizes (usually 0 columns), so the
  "t6" rows show the cost of the outlier pass itself;
- "planted": the same x with PLANTED_COLS fixed columns pushed to |x| >= 7 in every row (the few
  systematic outlier features of LLM activations), for the "t6 planted" rows. "t6 planted xla
  dense" forces the dense fallback (outlier_capacity=1), the product the XLA path computed before
  the gather.
`wall_us` (the XLA LLM.int8 rows): wall clock per product of blocked calls, dispatch included. On
GPU, XLA's `lax.cond` (the fallback test) copies its predicate to the host and waits for it,
which the device time does not show; compare "t6" against "t0" there.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product
from jqlora import ops, quant
from pallas_kernels.triton.matmul_llm_int8 import llm_int8_matmul_reference, quantize_activations_llm_int8

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
MS = (1, 16, 128, 2048, 8192)
THRESHOLD = 6.0
PLANTED_COLS = 8


def planted_outliers(x, n_cols: int = PLANTED_COLS):
    """x with n_cols fixed, evenly spread columns at sign(x) * (|x| + 7): every row of those
    columns exceeds THRESHOLD, the rest of x is untouched."""
    k = x.shape[1]
    cols = (np.arange(n_cols) * k) // n_cols + k // (2 * n_cols)
    xc = x[:, cols]
    return x.at[:, cols].set(jnp.where(xc < 0, -1, 1).astype(x.dtype) * (jnp.abs(xc) + 7))


def outlier_columns(x, threshold: float = THRESHOLD) -> int:
    """How many columns of x hold an outlier (bnb's criterion: |x.f16| >= threshold)."""
    return int(quantize_activations_llm_int8(x, threshold)[2].sum())


def wall_us_per_product(fn, args, copies: int, iterations: int = 10):
    """Median wall-clock µs per product of blocked jitted calls (dispatch and host syncs
    included), or the error text."""
    try:
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            samples.append((time.perf_counter() - t0) * 1e6 / copies)
        return float(statistics.median(samples))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def measure_cell(k: int, n: int, m: int) -> dict:
    """One (K, N, M) cell: bf16 baseline, weight-only, LLM.int8 t0 / t6 / t6 planted."""
    copies = l2_defeating_copies(n * k)
    dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
             for i in range(max(copies, l2_defeating_copies(2 * n * k)))]
    q0 = [quant.quantize_int8(w) for w in dense[:copies]]
    q6 = [dataclasses.replace(q, threshold=THRESHOLD) for q in q0]
    x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
    xp = planted_outliers(x)
    xs = distinct_copies(x, len(dense))
    xps = distinct_copies(xp, copies)
    res = dict(k=k, n=n, m=m, outlier_cols=dict(gaussian=outlier_columns(x),
                                                planted=outlier_columns(xp)))
    dc = l2_defeating_copies(2 * n * k)
    res["bf16"] = us_per_product(lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)],
                                 (xs[:dc], dense[:dc]), dc)

    def qm(kw):
        return lambda xs, qs: [ops.qmatmul(a, q, **kw) for a, q in zip(xs, qs)]

    def dense_fallback(xs, qs):  # one slot for 8 columns: the lax.cond takes the dense product
        return [llm_int8_matmul_reference(a, q.cb, q.scb, threshold=q.threshold,
                                          outlier_capacity=1) for a, q in zip(xs, qs)]

    xla = dict(numerics="llm_int8", backend="xla")
    pallas = dict(numerics="llm_int8", backend="pallas")
    rows = {"weight_only auto": (qm({}), xs, q0),
            "llm_int8 t0 xla": (qm(xla), xs, q0),
            "llm_int8 t0 pallas": (qm(pallas), xs, q0),
            "llm_int8 t6 xla": (qm(xla), xs, q6),
            "llm_int8 t6 pallas": (qm(pallas), xs, q6),
            "llm_int8 t6 planted xla": (qm(xla), xps, q6),
            "llm_int8 t6 planted pallas": (qm(pallas), xps, q6),
            "llm_int8 t6 planted xla dense": (dense_fallback, xps, q6)}
    res["wall_us"] = {}
    for name, (fn, xin, qs) in rows.items():
        res[name] = us_per_product(fn, (xin[:copies], qs), copies)
        if "xla" in name:
            res["wall_us"][name] = wall_us_per_product(fn, (xin[:copies], qs), copies)
    res["ratios"] = {key: round(v / res["bf16"], 3) for key, v in res.items()
                     if isinstance(v, float) and key != "bf16"}
    return res


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    records = []
    for (k, n), m in itertools.product(SHAPES_KN, MS):
        res = measure_cell(k, n, m)
        records.append(res)
        print(json.dumps(res), flush=True)
        with open(os.path.join(out_dir, "int8_numerics_probe.json"), "w") as f:
            json.dump(records, f, indent=1)  # after every cell: a time limit keeps what ran


if __name__ == "__main__":
    main()
