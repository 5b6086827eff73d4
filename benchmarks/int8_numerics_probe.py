"""INT8 weights, both numerics, every M of the protocol: weight-only (`qmatmul` default: bf16 x
times the int8 weight dequantized per row) against LLM.int8 (`numerics="llm_int8"`:
bitsandbytes' inference numerics, x quantized per row to int8, an int8 GEMM, outlier columns in
16 bit when the weight's threshold is > 0), through XLA and through the Pallas kernel.

    python -m benchmarks.int8_numerics_probe     # one JSON line per (shape, M); $OUT/int8_numerics_probe.json

Device time per product, distinct x per product, weights streamed from HBM (benchmarks/timing.py);
`ratios` divide by the bf16 GEMM of the same cell. threshold 0 (no outlier columns) and 6.0
(bitsandbytes' default; random normal x at that scale has none either, so the row shows the cost of
the outlier pass itself).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product
from jqlora import ops, quant

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
MS = (1, 16, 128, 2048, 8192)


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    records = []
    for (k, n), m in itertools.product(SHAPES_KN, MS):
        copies = l2_defeating_copies(n * k)
        dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
                 for i in range(max(copies, l2_defeating_copies(2 * n * k)))]
        q0 = [quant.quantize_int8(w) for w in dense[:copies]]
        q6 = [dataclasses.replace(q, threshold=6.0) for q in q0]
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, len(dense))
        res = dict(k=k, n=n, m=m)
        dc = l2_defeating_copies(2 * n * k)
        res["bf16"] = us_per_product(lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)],
                                     (xs[:dc], dense[:dc]), dc)
        rows = {"weight_only auto": (q0, dict()),
                "llm_int8 t0 xla": (q0, dict(numerics="llm_int8", backend="xla")),
                "llm_int8 t0 pallas": (q0, dict(numerics="llm_int8", backend="pallas")),
                "llm_int8 t6 xla": (q6, dict(numerics="llm_int8", backend="xla")),
                "llm_int8 t6 pallas": (q6, dict(numerics="llm_int8", backend="pallas"))}
        for name, (qs, kw) in rows.items():
            res[name] = us_per_product(
                lambda xs, qs, kw=kw: [ops.qmatmul(a, q, **kw) for a, q in zip(xs, qs)],
                (xs[:copies], qs), copies)
        res["ratios"] = {key: round(v / res["bf16"], 3) for key, v in res.items()
                         if isinstance(v, float) and key != "bf16"}
        records.append(res)
        print(json.dumps(res), flush=True)
        with open(os.path.join(out_dir, "int8_numerics_probe.json"), "w") as f:
            json.dump(records, f, indent=1)  # after every cell: a time limit keeps what ran


if __name__ == "__main__":
    main()
