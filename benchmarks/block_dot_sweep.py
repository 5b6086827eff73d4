"""Block-scaled tensor-core 4-bit kernel sweep (M <= 16) against the paths `qmatmul` used there
before (`dequant_dot`, `splitk_small_m`) and the bf16 GEMM.

    OUT=/tmp/out SWEEP_BUDGET=200 python -m benchmarks.block_dot_sweep
    python -m benchmarks.block_dot_sweep rows   # M = 8, 16: the best family and its options
    python -m benchmarks.block_dot_sweep waves  # M = 16: every K split count (programs per wave)

NF4, blocksize 64, double quant, de-nested in-kernel (as `qmatmul` calls the kernels). Stage 1
times a shuffled config grid at M = 16 on the first two shapes (SWEEP_BUDGET/4 seconds per shape);
stage 2 times the default and the best stage-1 configs, exact and rounded code tables, at every
shape and M in (8, 16). The session-6 results (benchmarks/results) were taken when the kernel
still took M <= 128, with stage 1 also at M = 128 and stage 2 and the rows at M = 16, 64, 128;
they are why it now stops at 16. Each record is one JSON line on stdout
(device time per product, weight streamed from HBM, distinct x per product:
benchmarks/timing.py); all go to $OUT/block_dot_sweep.json. `max_abs_err` checks the timed
kernel against its oracle.
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
from pallas_kernels import _compat
from pallas_kernels.triton.dequantize_4bit import denest_absmax_reference, scale_block_chunks
from pallas_kernels.triton.matmul_4bit import matmul_4bit_dequant_dot
from pallas_kernels.triton.matmul_4bit_block_dot import (
    DEFAULT_CONFIG, default_splits, matmul_4bit_block_dot)
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv_reference
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
GRID = [dict(block_n=bn, block_k=bk, num_warps=nw, programs=pr)
        for bn, bk, nw, pr in itertools.product((32, 64, 128), (128, 256, 512), (4, 8),
                                                (128, 256, 512, 1024))]
random.Random(0).shuffle(GRID)  # a budget cut then samples the whole grid


def _kernel_cfg(cfg, n, k):
    """Sweep config -> kernel kwargs (`programs` becomes the split count it implies)."""
    cfg = dict(cfg)
    programs = cfg.pop("programs", None)
    if programs is not None:
        bn, bk, _ = DEFAULT_CONFIG
        nk = scale_block_chunks(k, 64, cfg.get("block_k", bk))[4]
        cfg["splits"] = default_splits(_compat.cdiv(n, cfg.get("block_n", bn)), nk,
                                       programs)
    return cfg


def _runner(kernel, cfg, nested_in_kernel=True):
    def run(xs, qs):
        outs = []
        for x, q in zip(xs, qs):
            packed, codes, nested = nested_kernel_operands_4bit(q)
            if nested_in_kernel:
                outs.append(kernel(x, packed, codes, q.code, blocksize=64, nested=nested, **cfg))
            else:
                absmax = denest_absmax_reference(codes, *nested)
                outs.append(kernel(x, packed, absmax, q.code, blocksize=64, **cfg))
        return outs
    return run


def _max_abs_err(x, q, cfg):
    packed, codes, nested = nested_kernel_operands_4bit(q)
    got = matmul_4bit_block_dot(x, packed, codes, q.code, blocksize=64, nested=nested, **cfg)
    want = matmul_4bit_gemv_reference(x, packed, codes, q.code, blocksize=64, nested=nested)
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


# rows part: the best stage-1 family (H200, s6-1), the rounded code table, pipelining depth,
# and the next tile sizes
_ROW_CFGS = {
    "bn128 bk512 w8": dict(block_n=128, block_k=512, num_warps=8, programs=1024),
    "bn128 bk512 w8 rounded": dict(block_n=128, block_k=512, num_warps=8, programs=1024,
                                   exact_codes=False),
    "bn128 bk512 w8 s2": dict(block_n=128, block_k=512, num_warps=8, programs=1024,
                              num_stages=2),
    "bn128 bk1024 w8": dict(block_n=128, block_k=1024, num_warps=8, programs=1024),
    "bn64 bk512 w4": dict(block_n=64, block_k=512, num_warps=4, programs=1024),
}


def rows():
    """One JSON line per (shape, M): bf16, dequant_dot, and the `_ROW_CFGS` kernels."""
    for (k, n), m in itertools.product(SHAPES_KN, (8, 16)):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        res = dict(k=k, n=n, m=m)
        res["bf16"] = bf16_us(x, dense, k, n)
        res["dequant_dot"] = us_per_product(
            _runner(matmul_4bit_dequant_dot, {}, nested_in_kernel=False), (xs, qs), copies)
        errs = {}
        for name, cfg in _ROW_CFGS.items():
            kcfg = _kernel_cfg(cfg, n, k)
            res[name] = us_per_product(_runner(matmul_4bit_block_dot, kcfg), (xs, qs), copies)
            if isinstance(res[name], float):
                errs[name] = _max_abs_err(x, qs[0], kcfg)
        base = res["bf16"]
        res["ratios"] = {key: round(v / base, 3) for key, v in res.items()
                         if isinstance(v, float) and key != "bf16"}
        res["max_abs_err"] = errs
        print(json.dumps(res), flush=True)


def waves():
    """M = 16, every split count that divides the K tiles (block 128x512 with 4 and 8 warps,
    128x256 with 8, 64x512 with 4): the ncu profile (s7-3) showed 896 programs at 4 resident per SM, 1.7
    waves, and warned of the partial wave. One JSON line per (shape, config, splits)."""
    for k, n in SHAPES_KN:
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (16, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        base = bf16_us(x, dense, k, n)
        for bn, bk, nw in ((128, 512, 8), (128, 512, 4), (128, 256, 8), (64, 512, 4)):
            nk = scale_block_chunks(k, 64, bk)[4]
            for splits in (d for d in range(1, nk + 1) if nk % d == 0):
                programs = _compat.cdiv(n, bn) * splits
                if not 100 <= programs <= 4000:
                    continue
                cfg = dict(block_n=bn, block_k=bk, num_warps=nw, splits=splits,
                           exact_codes=False)
                us = us_per_product(_runner(matmul_4bit_block_dot, cfg), (xs, qs), copies)
                print(json.dumps(dict(k=k, n=n, m=16, bf16=base, programs=programs, **cfg,
                                      us=us, ratio=round(us / base, 3)
                                      if isinstance(us, float) else None)), flush=True)


def main():
    if sys.argv[1:] == ["rows"]:
        return rows()
    if sys.argv[1:] == ["waves"]:
        return waves()
    out_dir = os.environ.get("OUT", "/tmp")
    budget = float(os.environ.get("SWEEP_BUDGET", "200"))
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
        xs = distinct_copies(x, copies)
        record(**cell, what="dequant_dot", us=us_per_product(
            _runner(matmul_4bit_dequant_dot, {}, nested_in_kernel=False), (xs, qs), copies))
        record(**cell, what="splitk_small_m", us=us_per_product(
            _runner(matmul_4bit_small_m, {}), (xs, qs), copies))
        return cell, x, xs, copies, qs

    stage1 = []
    for (k, n), m in itertools.product(SHAPES_KN[:2], (16,)):
        t_cell = time.time()
        cell, x, xs, copies, qs = cell_baselines(k, n, m)
        for cfg in GRID:
            us = us_per_product(_runner(matmul_4bit_block_dot, _kernel_cfg(cfg, n, k)), (xs, qs),
                                copies)
            record(**cell, what="block_dot", cfg=cfg, us=us)
            if isinstance(us, float):
                stage1.append((k, n, m, json.dumps(cfg, sort_keys=True), us))
            if time.time() - t_cell > budget / 4:
                break
    ranks: dict[str, list[int]] = {}
    for cell in {(k, n, m) for k, n, m, _, _ in stage1}:
        ranked = sorted((us, c) for k, n, m, c, us in stage1 if (k, n, m) == cell)
        for i, (_, c) in enumerate(ranked):
            ranks.setdefault(c, []).append(i)
    best = sorted(ranks, key=lambda c: sum(ranks[c]) / len(ranks[c]))[:4]
    default = json.dumps({}, sort_keys=True)
    for (k, n), m in itertools.product(SHAPES_KN, (8, 16)):
        cell, x, xs, copies, qs = cell_baselines(k, n, m)
        for c in [default, *best]:
            for exact in (True, False):
                if not exact and c != default and c != best[0]:
                    continue
                cfg = dict(_kernel_cfg(json.loads(c), n, k), exact_codes=exact)
                us = us_per_product(_runner(matmul_4bit_block_dot, cfg), (xs, qs), copies)
                record(**cell, what="block_dot", cfg=json.loads(c), exact_codes=exact, stage=2,
                       us=us, max_abs_err=_max_abs_err(x, qs[0], cfg)
                       if isinstance(us, float) else None)
    with open(os.path.join(out_dir, "block_dot_sweep.json"), "w") as f:
        json.dump(records, f, indent=1)
    _summary(records)


def _summary(records):
    """One line per (shape, M): bf16, dequant_dot, split-K, default and best block_dot."""
    cells = sorted({(r["k"], r["n"], r["m"]) for r in records})
    for cell in cells:
        rows = [r for r in records if (r["k"], r["n"], r["m"]) == cell and
                isinstance(r["us"], float)]

        def first(what):
            return next((r["us"] for r in rows if r["what"] == what), float("nan"))

        base = first("bf16 dot")
        parts = [f"K={cell[0]} N={cell[1]} M={cell[2]}: bf16 {base:.2f} us"]
        for what in ("dequant_dot", "splitk_small_m"):
            parts.append(f"{what} {first(what) / base:.2f}")
        bd = [r for r in rows if r["what"] == "block_dot"]
        dflt = next((r["us"] for r in bd if r["cfg"] == {} and r.get("exact_codes")),
                    float("nan"))
        parts.append(f"block_dot default {dflt / base:.2f}")
        best = min(bd, key=lambda r: r["us"], default=None)
        if best is not None:
            parts.append(f"best {best['us'] / base:.2f} {best['cfg']} "
                         f"exact={best.get('exact_codes', True)}")
        print("; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
