"""The decoded-weight tensor-core kernel (`matmul_4bit_decoded_dot`) over tile configs, against
the bf16 GEMM, dequant_dot (`auto` above M = 64) and, at M <= 64, the block-scaled prmt
kernel, same run.

    python -m benchmarks.decoded_dot_probe [--ms 32,48,64] [--only NAME,...] [--shapes 4096:4096]
        # one JSON line per (shape, M); $OUT/decoded_dot_probe.json

NF4 blocksize 64 with double quant: the kernel de-nests in-kernel, dequant_dot gets the scales
de-nested by XLA (as `qmatmul` runs it). Device time per product, weight streamed from HBM,
distinct x per product (benchmarks/timing.py). Each line also records the largest difference
to dequant_dot's output on one product (gather: the same weight, so only the fp32 sum order
differs; prmt: also the rounded codes).
"""
from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from benchmarks.block_dot_sweep import SHAPES_KN, _runner
from benchmarks.sweep_setup import bf16_us, nf4_weight_copies, record_row, write_rows
from benchmarks.timing import distinct_copies, us_per_product
from pallas_kernels.triton.matmul_4bit import matmul_4bit_dequant_dot
from pallas_kernels.triton.matmul_4bit_block_dot import matmul_4bit_block_dot
from pallas_kernels.triton.matmul_4bit_decoded_dot import matmul_4bit_decoded_dot

MS = (32, 48, 64)


def _cfg(lookup, bn, bm, bk, warps, stages, splits=1):
    return dict(lookup=lookup, block_n=bn, block_m=bm, block_k=bk, num_warps=warps,
                num_stages=stages, splits=splits)


def _name(c: dict) -> str:
    """e.g. "prmt 64x64x128 w4 s3 k4": lookup, block_n x block_m x block_k, warps, stages,
    K splits."""
    return (f"{c['lookup']} {c['block_n']}x{c['block_m']}x{c['block_k']} w{c['num_warps']} "
            f"s{c['num_stages']}" + (f" k{c['splits']}" if c["splits"] > 1 else ""))


def _configs(*cfgs) -> dict:
    return {_name(c): c for c in cfgs}


# History (H200, session 9): s9-1/s9-2 ran the large-M family at M = 128 and 2048; every one
# was 2.4x bf16 or slower (dequant_dot 1.15-1.21 at 2048), the gather lookup 7-30x, and a form
# that split x's tile into even/odd columns in registers for two dots (removed) 12-56x (a 26x
# bank-conflicted shared-memory shuffle, ncu). s9-3/s9-4: 64x64 tiles with 4 K splits beat
# block_dot prmt at M = 64 (now DEFAULT_CONFIG, the "default" row).
CONFIGS = _configs(
    _cfg("gather", 128, 128, 128, 8, 3), _cfg("gather", 128, 256, 64, 8, 3),
    _cfg("gather", 128, 128, 64, 4, 4), _cfg("gather", 64, 128, 128, 4, 3),
    _cfg("prmt", 128, 128, 128, 8, 3), _cfg("prmt", 128, 256, 64, 8, 3),
    _cfg("prmt", 64, 128, 128, 4, 3),
    _cfg("prmt", 128, 128, 64, 4, 3),
    _cfg("prmt", 128, 128, 64, 8, 3), _cfg("prmt", 128, 128, 64, 8, 2),
)
SMALL_M_CONFIGS = _configs(  # M <= 256: K splits for more programs
    _cfg("gather", 64, 128, 128, 4, 3, splits=4), _cfg("prmt", 64, 128, 128, 4, 3, splits=4),
    *[_cfg("prmt", 64, bm, bk, 4, st, splits=sp)
      for bm in (16, 32, 64) for bk, st, sp in ((128, 3, 4), (256, 3, 2), (128, 3, 2),
                                                (128, 3, 8), (64, 3, 4), (128, 2, 4))],
    _cfg("prmt", 128, 64, 128, 8, 3, splits=4), _cfg("prmt", 128, 64, 128, 4, 3, splits=4),
    _cfg("prmt", 64, 16, 512, 4, 3),
)


def _diff(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--shapes", default="", help="K:N pairs, comma-separated (default: all 3)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    only = [s for s in args.only.split(",") if s]
    out = []
    shapes = ([tuple(map(int, p.split(":"))) for p in args.shapes.split(",")] if args.shapes
              else SHAPES_KN)
    for (k, n), m in itertools.product(shapes, ms):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
        base = _runner(matmul_4bit_dequant_dot, {}, nested_in_kernel=False)
        res["dequant_dot"] = us_per_product(base, (xs, qs), copies)
        want = base([x], qs[:1])[0]
        if m <= 64:  # `auto` up to M = 32, and at 33..64 before decoded_dot
            res["block_dot prmt"] = us_per_product(
                _runner(matmul_4bit_block_dot, dict(exact_codes=False, lookup="prmt")),
                (xs, qs), copies)
        configs = dict(CONFIGS, **(SMALL_M_CONFIGS if m <= 256 else {}), default={})
        res["max_diff_vs_dequant_dot"] = {}
        for name, kw in configs.items():
            if only and name not in only:
                continue
            run = _runner(matmul_4bit_decoded_dot, kw)
            res[name] = us_per_product(run, (xs, qs), copies)
            if isinstance(res[name], float):
                res["max_diff_vs_dequant_dot"][name] = _diff(run([x], qs[:1])[0], want)
        record_row(res, out)
    write_rows(out, "decoded_dot_probe.json")


if __name__ == "__main__":
    main()
