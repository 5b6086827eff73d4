"""Byte-pair code tables (one table load per packed byte) against the 16-entry table in the
GEMV (M <= 4) and the block-scaled tensor-core kernel (M = 8, 16), same run, same weights.

    python -m benchmarks.byte_pair_probe        # one JSON line per (shape, M); $OUT/byte_pair_probe.json

NF4 blocksize 64 with double quant, de-nested in-kernel, as `qmatmul` calls the kernels; device
time per product with the weight streamed from HBM and distinct x per product
(benchmarks/timing.py). `ratios` divide by the bf16 GEMM in the same cell; `max_abs_err` is each
kernel against its oracle. `table_build` times `byte_pair_table` alone (the per-call XLA op
the pair tables add).
"""
from __future__ import annotations

import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.sweep_setup import bf16_us, nf4_weight_copies
from benchmarks.timing import distinct_copies, jax_device_ms, us_per_product
from jqlora.ops.products import nested_kernel_operands_4bit
from pallas_kernels.dequantize_4bit import byte_pair_table
from pallas_kernels.matmul_4bit_block_dot import (
    matmul_4bit_block_dot, matmul_4bit_block_dot_reference)
from pallas_kernels.matmul_4bit_gemv import matmul_4bit_gemv
from pallas_kernels.matmul_4bit_small_m import matmul_4bit_small_m

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
_GEMV_TILES = ((32, 512, 4), (64, 256, 8), (64, 512, 8), (128, 256, 8), (32, 1024, 4))


def _contenders(m: int) -> dict:
    """name -> (kernel, kwargs, exact_codes of its oracle)."""
    c = {}
    if m <= 4:
        for table in ("nibble", "byte_pairs", "byte_pairs_rounded"):
            c[f"gemv {table}"] = (matmul_4bit_gemv, dict(table=table),
                                  table != "byte_pairs_rounded")
        if m == 1:
            for bn, bk, nw in _GEMV_TILES:
                c[f"gemv byte_pairs_rounded {bn}x{bk} w{nw}"] = (
                    matmul_4bit_gemv, dict(table="byte_pairs_rounded", block_n=bn, block_k=bk,
                                           num_warps=nw), False)
    if m >= 3:
        c["splitk_small_m"] = (matmul_4bit_small_m, {}, None)
    if m >= 8:
        for exact, pairs in itertools.product((False, True), (False, True)):
            c[f"block_dot exact={exact} pairs={pairs}"] = (
                matmul_4bit_block_dot, dict(exact_codes=exact, byte_pairs=pairs), exact)
    return c


def _run(kernel, kw):
    def run(xs, qs):
        outs = []
        for x, q in zip(xs, qs):
            packed, codes, nested = nested_kernel_operands_4bit(q)
            outs.append(kernel(x, packed, codes, q.code, blocksize=64, nested=nested, **kw))
        return outs
    return run


def _err(kernel, kw, exact, x, q):
    packed, codes, nested = nested_kernel_operands_4bit(q)
    got = kernel(x, packed, codes, q.code, blocksize=64, nested=nested, **kw)
    want = matmul_4bit_block_dot_reference(x, packed, codes, q.code, blocksize=64,
                                           nested=nested, exact_codes=exact)
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    records = []
    code = jax.random.normal(jax.random.key(3), (16,), jnp.float32)
    table_ms = jax_device_ms(lambda c: byte_pair_table(c, jnp.bfloat16), code, iterations=20)
    records.append(dict(what="table_build", us=table_ms * 1e3))
    print(json.dumps(records[-1]), flush=True)
    for (k, n), m in itertools.product(SHAPES_KN, (1, 2, 4, 8, 16)):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
        errs = {}
        for name, (kernel, kw, exact) in _contenders(m).items():
            res[name] = us_per_product(_run(kernel, kw), (xs, qs), copies)
            if exact is not None and isinstance(res[name], float):
                errs[name] = _err(kernel, kw, exact, x, qs[0])
        res["ratios"] = {key: round(v / res["bf16"], 3) for key, v in res.items()
                         if isinstance(v, float) and key != "bf16"}
        res["max_abs_err"] = errs
        records.append(res)
        print(json.dumps(res), flush=True)
    with open(os.path.join(out_dir, "byte_pair_probe.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
