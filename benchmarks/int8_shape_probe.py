"""INT8 kernels on real checkpoint shapes: the defaults (split-K at small M, the dequant kernel +
GEMM at large M) beside the bf16 GEMM, optionally against another copy of the module.

    OUT=/tmp/out python -m benchmarks.int8_shape_probe [--against PATH/TO/matmul_int8.py]

Shapes: the three protocol shapes and in/out features of Llama-2 7B / 13B MLPs and Qwen2.5-7B,
where K (in features) has an odd number of 256-column tiles. `--against` loads a second copy of
`pallas_kernels/triton/matmul_int8.py` (for example the previous commit's, from `git show`) and times
its kernels in the same process. Records: one JSON line each, all in $OUT/int8_shape_probe.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product
from jqlora import quant
from pallas_kernels.triton import matmul_int8 as current

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (11008, 4096), (4096, 11008),
             (13824, 5120), (18944, 3584), (3584, 3584))


def _load(path: str):
    spec = importlib.util.spec_from_file_location("matmul_int8_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", help="another matmul_int8.py to time beside the current one")
    ap.add_argument("--ms", default="1,16,2048")
    args = ap.parse_args()
    modules = {"current": current}
    if args.against:
        modules["against"] = _load(args.against)
    records = []

    def record(**kw):
        records.append(kw)
        print(json.dumps(kw), flush=True)

    for k, n in SHAPES_KN:
        copies = l2_defeating_copies(n * k * 2)
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [quant.quantize_int8(w) for w in ws]
        for m in (int(v) for v in args.ms.split(",")):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            cell = dict(k=k, n=n, m=m)
            record(**cell, what="bf16 dot", us=us_per_product(
                lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)], (xs, ws), copies))
            want = current.matmul_int8_reference(x, qs[0].cb, qs[0].scb).astype(jnp.float32)
            for label, mod in modules.items():
                fn = mod.matmul_int8_splitk if m <= 64 else mod.matmul_int8_dequant_dot
                us = us_per_product(lambda xs, qs, fn=fn: [fn(a, q.cb, q.scb) for a, q in zip(xs, qs)],
                                    (xs, qs), copies)
                got = fn(x, qs[0].cb, qs[0].scb).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                record(**cell, what=f"{label} {fn.__name__}", us=us, rel_err=err)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "int8_shape_probe.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
