"""Code lookup by table gather against byte permutes in registers (`lookup="prmt"`,
pallas_kernels/nibble_lookup.py) in the small-M kernels, against the bf16 GEMM, same run.

    python -m benchmarks.lookup_probe [--ms 1,2,4,8,16]   # one JSON line per (shape, M);
                                                          # $OUT/lookup_probe.json

M = 1, 2: the GEMV (fp32 gather, and prmt on the bf16-rounded table); M = 3, 4: the split-K
kernel (the `auto` choice at M = 3 before prmt); M = 1..16: the block-scaled tensor-core kernel
with rounded codes (gather, prmt, and prmt at the gather's tile config, since a cheaper decode
may move the best tile); M > 16 (up to the kernel's 128): the block-scaled dot against
dequant_dot, the `auto` choice there. Each line also records the largest difference between the prmt and gather outputs on one product (0 expected for the block-scaled
dot: the same code tiles). NF4 blocksize 64 with double quant, de-nested in-kernel; device
time per product, weight streamed from HBM, distinct x per product (benchmarks/timing.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp

from benchmarks.block_dot_sweep import SHAPES_KN, _runner
from benchmarks.sweep_setup import bf16_us, nf4_weight_copies, record_row, write_rows
from benchmarks.timing import distinct_copies, us_per_product
from pallas_kernels.triton.matmul_4bit import matmul_4bit_dequant_dot
from pallas_kernels.triton.matmul_4bit_block_dot import matmul_4bit_block_dot
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m

MS = (1, 2, 4, 8, 16)
_ROUNDED = dict(exact_codes=False)
_PRMT = dict(_ROUNDED, lookup="prmt")
GEMV = {"gemv gather": dict(), "gemv prmt": dict(lookup="prmt")}
BLOCK_DOT = {"block_dot gather": dict(_ROUNDED), "block_dot prmt": dict(_PRMT),
             # the gather form's tile config (DEFAULT_CONFIG), with the prmt lookup
             "block_dot prmt bn128 w8": dict(_PRMT, block_n=128, num_warps=8)}
# History (H200): s8-1 had block_k 1024 and 4 warps at block_n 128: slower than 128x512 with
# 8 warps everywhere; block_n 64 with 4 warps was faster at 4096x4096 (one K tile per program
# there) and 2.6-3.2x bf16 at the 14336 shapes (a K loop of 2 tiles per program). s8-2, s8-4:
# its one-tile form beat 128x512 / 8 warps at M = 16 and 64, so it became PRMT_CONFIG (the
# "block_dot prmt" row since); s8-4 also had the table words or'ed with `%laneid >> 5` to keep
# them out of uniform registers: the same instruction count and time, dropped.


def _max_diff(kernel, a_kw, b_kw, x, q):
    """max |a - b| of two configurations on one product (pre-rounded table for the GEMV)."""
    outs = []
    for kw in (a_kw, b_kw):
        kw = dict(kw)
        if kernel is matmul_4bit_gemv and kw.get("lookup") != "prmt":
            q = dataclasses.replace(q, code=q.code.astype(x.dtype).astype(jnp.float32))
        outs.append(_runner(kernel, kw)([x], [q])[0].astype(jnp.float32))
    return float(jnp.max(jnp.abs(outs[0] - outs[1])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ms = [int(v) for v in ap.parse_args().ms.split(",")]
    out = []
    for (k, n), m in itertools.product(SHAPES_KN, ms):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
        jobs = [(matmul_4bit_block_dot, name, kw) for name, kw in BLOCK_DOT.items()]
        if m <= 2:
            jobs += [(matmul_4bit_gemv, name, kw) for name, kw in GEMV.items()]
        if m in (3, 4):
            jobs.append((matmul_4bit_small_m, "splitk_small_m", {}))
        if m > 16:  # beyond the block-scaled dot's registered range: against dequant + GEMM
            jobs.append((matmul_4bit_dequant_dot, "dequant_dot", {}))
        for kernel, name, kw in jobs:  # dequant_dot takes fp32 scales (de-nested by XLA)
            run = _runner(kernel, kw, nested_in_kernel=kernel is not matmul_4bit_dequant_dot)
            res[name] = us_per_product(run, (xs, qs), copies)
        res["max_diff"] = {"block_dot": _max_diff(matmul_4bit_block_dot, BLOCK_DOT["block_dot gather"],
                                                  BLOCK_DOT["block_dot prmt"], x, qs[0])}
        if m <= 2:
            res["max_diff"]["gemv"] = _max_diff(matmul_4bit_gemv, GEMV["gemv gather"],
                                                GEMV["gemv prmt"], x, qs[0])
        record_row(res, out)
    write_rows(out, "lookup_probe.json")

if __name__ == "__main__":
    main()
