"""M = 2 to 5: the GEMV, the split-K kernel and the block-scaled tensor-core kernel (rounded and
exact codes) against the bf16 GEMM, same run: where `qmatmul` auto should hand over.

    python -m benchmarks.small_m_rows     # one JSON line per (shape, M); $OUT/m2_5_rows.json

NF4 blocksize 64 with double quant, de-nested in-kernel; device time per product, weight streamed
from HBM, distinct x per product (benchmarks/timing.py).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from benchmarks.block_dot_sweep import SHAPES_KN, _runner
from benchmarks.sweep_setup import bf16_us, nf4_weight_copies, record_row, write_rows
from benchmarks.timing import distinct_copies, us_per_product
from pallas_kernels.triton.matmul_4bit_block_dot import matmul_4bit_block_dot
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m

KERNELS = {"gemv": (matmul_4bit_gemv, {}), "splitk_small_m": (matmul_4bit_small_m, {}),
           "block_dot rounded": (matmul_4bit_block_dot, dict(exact_codes=False)),
           "block_dot exact": (matmul_4bit_block_dot, dict(exact_codes=True))}


def main():
    out = []
    for (k, n), m in itertools.product(SHAPES_KN, (2, 3, 4, 5)):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
        kernels = dict(KERNELS)
        if m <= 4:  # the split-K kernel's row-wise path with one 256-column K tile per program
            kernels["splitk_small_m one tile"] = (matmul_4bit_small_m, dict(splits=k // 256))
        for name, (kernel, kw) in kernels.items():
            res[name] = us_per_product(_runner(kernel, kw), (xs, qs), copies)
        record_row(res, out)
    write_rows(out, "m2_5_rows.json")

if __name__ == "__main__":
    main()
