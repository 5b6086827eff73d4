"""Block-scaled 4-bit GEMV sweep (M = 1 and 4) against the split-K kernel and the bf16 GEMV.

    OUT=/tmp/out SWEEP_BUDGET=150 python -m benchmarks.gemv_sweep          # config grid
    python -m benchmarks.gemv_sweep rows    # M = 1..4, fma on/off, num_stages (best configs)

NF4, blocksize 64, double quant, de-nested in-kernel (as `qmatmul` calls the kernels). Stage 1
times the whole config grid at M = 1 on the first two shapes; stage 2 times the best configs of
stage 1 at every (shape, M). SWEEP_BUDGET/4 seconds cap stage 1 per shape. Each record is one JSON line on stdout (device time per product,
weight streamed from HBM, distinct x per product: benchmarks/timing.py) and all of them go to
$OUT/gemv_sweep.json. `max_abs_err` checks each timed output against the kernel's oracle.
The `rows` part prints one JSON line per (shape, M) with the split-K kernel beside the GEMV, which
is how the GEMV's M limit in `qmatmul`'s plan was chosen.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.sweep_setup import bf16_us, nf4_weight_copies
from benchmarks.timing import distinct_copies, us_per_product
from jqlora.ops.products import nested_kernel_operands_4bit
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv, matmul_4bit_gemv_reference
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
GRID = [dict(block_n=bn, block_k=bk, num_warps=nw, splits=sp)
        for bn, bk, nw, sp in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8),
                                                (None, 1))]
random.Random(0).shuffle(GRID)  # a budget cut then samples the whole grid


def _kernel_runner(kernel, cfg):
    def run(xs, qs):
        outs = []
        for x, q in zip(xs, qs):
            packed, codes, nested = nested_kernel_operands_4bit(q)
            outs.append(kernel(x, packed, codes, q.code, blocksize=64, nested=nested, **cfg))
        return outs
    return run


def _max_abs_err(x, q, cfg):
    packed, codes, nested = nested_kernel_operands_4bit(q)
    got = matmul_4bit_gemv(x, packed, codes, q.code, blocksize=64, nested=nested, **cfg)
    want = matmul_4bit_gemv_reference(x, packed, codes, q.code, blocksize=64, nested=nested)
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


# best stage-1 configs per shape (H200, results/..._gemv_sweep.json), for the `rows` part
_BEST = {(4096, 4096): dict(block_n=64, block_k=256, num_warps=8),
         (4096, 14336): dict(block_n=32, block_k=512, num_warps=4),
         (14336, 4096): dict(block_n=32, block_k=512, num_warps=4)}


def rows():
    """M = 1..4: bf16 GEMV, split-K kernel, GEMV with and without FMA; at M = 1 also pipelining
    depth and two other tilings. Ratios are against the bf16 time of the same (shape, M)."""
    for (k, n), best in _BEST.items():
        copies, dense, qs = nf4_weight_copies(k, n)
        for m in (1, 2, 3, 4):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            res = dict(k=k, n=n, m=m)
            res["bf16"] = bf16_us(x, dense, k, n)
            res["splitk"] = us_per_product(_kernel_runner(matmul_4bit_small_m, {}), (xs, qs), copies)
            cfgs = {"best": dict(best, fma=False), "best+fma": dict(best, fma=True)}
            if m == 1:
                for stages in (2, 4):
                    cfgs[f"best+fma s{stages}"] = dict(best, fma=True, num_stages=stages)
                cfgs["bn32 bk256 fma"] = dict(block_n=32, block_k=256, fma=True)
                cfgs["bn64 bk256 w8 fma"] = dict(block_n=64, block_k=256, num_warps=8, fma=True)
                cfgs["bn16 bk512 w4 fma"] = dict(block_n=16, block_k=512, num_warps=4, fma=True)
            for name, cfg in cfgs.items():
                res[name] = us_per_product(_kernel_runner(matmul_4bit_gemv, cfg), (xs, qs), copies)
            res["max_abs_err_fma"] = _max_abs_err(x, qs[0], dict(best, fma=True))
            base = res["bf16"]
            res["ratios"] = {key: round(v / base, 3) for key, v in res.items()
                             if isinstance(v, float) and key not in ("bf16", "max_abs_err_fma")}
            print(json.dumps(res), flush=True)


def main():
    if sys.argv[1:] == ["rows"]:
        return rows()
    out_dir = os.environ.get("OUT", "/tmp")
    budget = float(os.environ.get("SWEEP_BUDGET", "150"))
    records = []

    def record(**kw):
        records.append(kw)
        print(json.dumps(kw), flush=True)

    setups = {}
    for k, n in SHAPES_KN:
        setups[(k, n)] = nf4_weight_copies(k, n)

    def cell_baselines(k, n, m):
        copies, dense, qs = setups[(k, n)]
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        cell = dict(k=k, n=n, m=m)
        record(**cell, what="bf16 dot", us=bf16_us(x, dense, k, n))
        record(**cell, what="splitk_small_m", us=us_per_product(
            _kernel_runner(matmul_4bit_small_m, {}), (distinct_copies(x, copies), qs), copies))
        return cell, x, copies, qs

    stage1 = []
    for k, n in SHAPES_KN[:2]:
        t_shape = time.time()
        cell, x, copies, qs = cell_baselines(k, n, 1)
        for cfg in GRID:
            us = us_per_product(_kernel_runner(matmul_4bit_gemv, cfg), (distinct_copies(x, copies), qs),
                     copies)
            record(**cell, what="gemv", cfg=cfg, us=us)
            if isinstance(us, float):
                stage1.append((k, n, json.dumps(cfg, sort_keys=True), us))
            if time.time() - t_shape > budget / 4:
                break
    # best configs: lowest mean rank over the stage-1 shapes
    ranks: dict[str, list[int]] = {}
    for shape in SHAPES_KN[:2]:
        rows = sorted((us, c) for k, n, c, us in stage1 if (k, n) == shape)
        for i, (_, c) in enumerate(rows):
            ranks.setdefault(c, []).append(i)
    best = sorted(ranks, key=lambda c: sum(ranks[c]) / len(ranks[c]))[:6]
    default = json.dumps({}, sort_keys=True)
    for k, n in SHAPES_KN:
        for m in (1, 4):
            cell, x, copies, qs = cell_baselines(k, n, m)
            for c in [default, *best]:
                cfg = json.loads(c)
                record(**cell, what="gemv", cfg=cfg, stage=2, us=us_per_product(
                    _kernel_runner(matmul_4bit_gemv, cfg), (distinct_copies(x, copies), qs),
                    copies), max_abs_err=_max_abs_err(x, qs[0], cfg))
    with open(os.path.join(out_dir, "gemv_sweep.json"), "w") as f:
        json.dump(records, f, indent=1)
    _summary(records)


def _summary(records):
    """One line per (shape, M): bf16 GEMV, split-K kernel, default and best GEMV config."""
    cells = sorted({(r["k"], r["n"], r["m"]) for r in records})
    for cell in cells:
        rows = [r for r in records if (r["k"], r["n"], r["m"]) == cell and
                isinstance(r["us"], float)]
        base = next((r["us"] for r in rows if r["what"] == "bf16 dot"), float("nan"))
        splitk = next((r["us"] for r in rows if r["what"] == "splitk_small_m"), float("nan"))
        gemv = [r for r in rows if r["what"] == "gemv"]
        dflt = next((r["us"] for r in gemv if r["cfg"] == {} and r.get("stage") == 2),
                    float("nan"))
        best = min(gemv, key=lambda r: r["us"], default=None)
        line = (f"K={cell[0]} N={cell[1]} M={cell[2]}: bf16 {base:.2f} us; splitk "
                f"{splitk:.2f} ({splitk / base:.2f}); gemv default {dflt:.2f} ({dflt / base:.2f})")
        if best is not None:
            line += f"; best {best['us']:.2f} ({best['us'] / base:.2f}) {best['cfg']}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
