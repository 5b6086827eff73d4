"""INT8 (weight-only) sweep: the small-M kernels' configs at M = 1 and 16, then the large-M forms.

    OUT=/tmp/out SWEEP_BUDGET=150 python -m benchmarks.int8_sweep [--part small|large|both|stages|orient|xla]

Each record is one JSON line on stdout (device time per product, the weight streamed from HBM,
see benchmarks/timing.py); all go to $OUT/int8_sweep_<part>.json. small: `matmul_int8_splitk`
configs (and the `matmul_int8_gemv` default) on every shape, each config's output checked against
`matmul_int8_reference` on the first weight copy (max |err| / max |y|); SWEEP_BUDGET (seconds)
caps the configs tried after it is spent. large: at M = 128, 2048 and 8192, the forward (y = x @
W.T) and the backward product (dx = dy @ W) of the xla path, the fenced dequant + GEMM and the
tiled kernels, beside the bf16 GEMMs. stages: num_stages x num_warps around the default tiles.
orient: the weight-left tile product (`weight_left=True`: CB_tile . x_tile^T, the converted
weight as the MMA's register operand) against the default x-left one, split-K configs at M = 1
and 16, tiled configs at M = 128, 2048 and 8192 beside `int8_dequant_dot` and the bf16 GEMM.
xla (session 22): at M = 2048 and 8192, the dequant pass + GEMM against XLA's GEMM with the
int8 -> bf16 convert in its operand (`xla_scaled`, `xla_scaled_t`), each with its error.
"""
from __future__ import annotations

import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product
from jqlora import ops, quant
from pallas_kernels.triton.matmul_int8 import (
    INV127, matmul_int8, matmul_int8_dequant_dot, matmul_int8_dequant_dot_t,
    matmul_int8_reference, matmul_int8_splitk, matmul_int8_t, matmul_int8_t_reference)
from pallas_kernels.triton.matmul_int8_gemv import matmul_int8_gemv

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
GRID = [dict(block_n=bn, block_k=bk, splits=sp)
        for bn, bk, sp in itertools.product((16, 32, 64, 128), (128, 256, 512), (None, 1))]
# --part stages: pipelining depth and warps around the chosen 64 x 256 tiles (M = 1 and 16)
STAGES_GRID = [dict(block_n=bn, block_k=bk, num_stages=ns, num_warps=nw)
               for (bn, bk), ns, nw in itertools.product(((64, 256), (128, 256), (64, 512)),
                                                         (3, 4, 5, 6), (4, 8))]


# --part orient: (block_n, block_k, splits, num_warps) x weight_left at M = 1 (M = 16: ORIENT_16)
ORIENT_SMALL = [dict(block_n=bn, block_k=bk, splits=sp, num_warps=nw, weight_left=wl)
                for (bn, nw), bk, sp, wl in itertools.product(
                    ((64, 4), (128, 4), (128, 8)), (256, 512), (None, 1, 2), (False, True))]
ORIENT_16 = [c for c in ORIENT_SMALL if c["block_k"] == 256 and c["splits"] is None]
# (block_m, block_n, block_k, num_warps, num_stages) of the tiled kernel, each with both orientations
ORIENT_LARGE = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
                (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (256, 64, 64, 4, 3)]


def _rel_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
                 / jnp.maximum(jnp.max(jnp.abs(want.astype(jnp.float32))), 1e-30))


def small(record, budget, grid=None):
    t0 = time.time()
    for k, n in SHAPES_KN:
        dense_copies = l2_defeating_copies(n * k * 2)
        copies = l2_defeating_copies(n * k)
        dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
                 for i in range(max(copies, dense_copies))]
        qs = [quant.quantize_int8(w) for w in dense[:copies]]
        for m in (1, 16):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, max(copies, dense_copies))
            cell = dict(k=k, n=n, m=m)
            record(**cell, what="bf16 dot", us=us_per_product(
                lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)], (xs[:dense_copies], dense[:dense_copies]),
                dense_copies))
            record(**cell, what="qmatmul xla", us=us_per_product(
                lambda xs, qs: [ops.qmatmul(a, q, backend="xla") for a, q in zip(xs, qs)], (xs[:copies], qs),
                copies))
            want = matmul_int8_reference(x, qs[0].cb, qs[0].scb)
            kernels = [("gemv", matmul_int8_gemv, {})] if m == 1 and grid is None else []
            kernels += [("splitk", matmul_int8_splitk, cfg) for cfg in [{}] + (grid or GRID)]
            for what, fn, cfg in kernels:
                if time.time() - t0 > budget and cfg:
                    break
                us = us_per_product(lambda xs, qs, fn=fn, cfg=cfg: [fn(a, q.cb, q.scb, **cfg) for a, q in zip(xs, qs)],
                         (xs[:copies], qs), copies)
                err = None if isinstance(us, str) else _rel_err(fn(x, qs[0].cb, qs[0].scb, **cfg), want)
                record(**cell, what=what, cfg=cfg, us=us, rel_err=err)


def large(record):
    for k, n in SHAPES_KN:
        copies = l2_defeating_copies(n * k * 2)  # the dense weights' count; int8 uses as many
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [quant.quantize_int8(w) for w in ws]
        for m in (128, 2048, 8192):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(8), (m, n), jnp.bfloat16)
            cell = dict(k=k, n=n, m=m)
            progs = {
                "fwd bf16 dot": (lambda x, w, q: x @ w.T, x),
                "fwd qmatmul xla": (lambda x, w, q: ops.qmatmul(x, q, backend="xla"), x),
                "fwd int8_dequant_dot": (lambda x, w, q: matmul_int8_dequant_dot(x, q.cb, q.scb), x),
                "fwd int8_weight_only": (lambda x, w, q: matmul_int8(x, q.cb, q.scb), x),
                "bwd bf16 dot": (lambda d, w, q: d @ w, dy),
                "bwd xla": (lambda d, w, q: d @ quant.dequantize(q, d.dtype), dy),
                "bwd int8_dequant_dot_t": (lambda d, w, q: matmul_int8_dequant_dot_t(d, q.cb, q.scb), dy),
                "bwd int8_weight_only_t": (lambda d, w, q: matmul_int8_t(d, q.cb, q.scb), dy),
            }
            for what, (fn, a) in progs.items():
                record(**cell, what=what, us=us_per_product(
                    lambda avs, ws, qs, fn=fn: [fn(a, w, q) for a, w, q in zip(avs, ws, qs)],
                    (distinct_copies(a, copies), ws, qs), copies))


def xla_scaled(x, cb, scb):
    """y = (x @ CB.T) * SCB / 127 with CB converted to x's dtype inside the dot (exact), so
    that XLA can fuse the int8 -> 16-bit convert into its GEMM and read 1-byte weights; the
    scale is applied to the fp32 result once per output (`dequant="epilogue"` numerics)."""
    y = lax.dot_general(x, cb.astype(x.dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return (y * (scb.astype(jnp.float32) * INV127)[None, :]).astype(x.dtype)


def xla_scaled_t(dy, cb, scb):
    """dx = (dy * SCB / 127, rounded to dy's dtype) @ CB: `matmul_int8_t`'s numerics, the
    convert of CB left for XLA to fuse into its GEMM."""
    ds = (dy.astype(jnp.float32) * (scb.astype(jnp.float32) * INV127)[None, :]).astype(dy.dtype)
    return lax.dot_general(ds, cb.astype(dy.dtype), (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dy.dtype)


def xla(record):
    """Large M: the dequant pass + GEMM against XLA's own GEMM with the int8 -> bf16 convert in
    its operand (`xla_scaled`, `xla_scaled_t`), and each output's error against the
    reference."""
    for k, n in SHAPES_KN:
        copies = l2_defeating_copies(n * k * 2)
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [quant.quantize_int8(w) for w in ws]
        for m in (2048, 8192):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(8), (m, n), jnp.bfloat16)
            cell = dict(k=k, n=n, m=m)
            progs = {
                "fwd bf16 dot": (lambda x, w, q: x @ w.T, x),
                "fwd int8_dequant_dot": (lambda x, w, q: matmul_int8_dequant_dot(x, q.cb, q.scb), x),
                "fwd xla_scaled": (lambda x, w, q: xla_scaled(x, q.cb, q.scb), x),
                "bwd bf16 dot": (lambda d, w, q: d @ w, dy),
                "bwd int8_dequant_dot_t": (lambda d, w, q: matmul_int8_dequant_dot_t(d, q.cb, q.scb), dy),
                "bwd xla_scaled_t": (lambda d, w, q: xla_scaled_t(d, q.cb, q.scb), dy),
            }
            want = {"fwd": matmul_int8_reference(x, qs[0].cb, qs[0].scb, out_dtype=jnp.float32),
                    "bwd": matmul_int8_t_reference(dy, qs[0].cb, qs[0].scb, out_dtype=jnp.float32)}
            for what, (fn, a) in progs.items():
                err = _rel_err(jax.jit(fn)(a, ws[0], qs[0]), want[what[:3]])
                record(**cell, what=what, rel_err=err, us=us_per_product(
                    lambda avs, ws, qs, fn=fn: [fn(a, w, q) for a, w, q in zip(avs, ws, qs)],
                    (distinct_copies(a, copies), ws, qs), copies))


def orient(record, budget):
    """Weight-left against x-left tile products (module doc)."""
    t0 = time.time()
    for k, n in SHAPES_KN:
        copies = l2_defeating_copies(n * k * 2)
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        qs = [quant.quantize_int8(w) for w in ws]
        for m in (1, 16, 128, 2048, 8192):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            cell = dict(k=k, n=n, m=m)
            want = matmul_int8_reference(x, qs[0].cb, qs[0].scb)
            record(**cell, what="bf16 dot", us=us_per_product(
                lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)], (xs, ws), copies))
            if m <= 16:
                kernels = [("splitk", matmul_int8_splitk, c)
                           for c in [{}] + (ORIENT_SMALL if m == 1 else ORIENT_16)]
            else:
                kernels = [("int8_dequant_dot", matmul_int8_dequant_dot, {})]
                for (bm, bn, bk, nw, ns), wl in itertools.product(ORIENT_LARGE, (False, True)):
                    kernels.append(("tiled", matmul_int8, dict(
                        block_m=min(bm, m), block_n=bn, block_k=bk, num_warps=nw,
                        num_stages=ns, weight_left=wl)))
            for i, (what, fn, cfg) in enumerate(kernels):
                if time.time() - t0 > budget and cfg:
                    record(**cell, what="budget spent", skipped=len(kernels) - i)
                    break
                us = us_per_product(lambda xs, qs, fn=fn, cfg=cfg: [fn(a, q.cb, q.scb, **cfg) for a, q in zip(xs, qs)],
                                    (xs, qs), copies)
                err = None if isinstance(us, str) else _rel_err(fn(x, qs[0].cb, qs[0].scb, **cfg), want)
                record(**cell, what=what, cfg=cfg, us=us, rel_err=err)


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("small", "large", "both", "stages", "orient", "xla"),
                    default="both")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    budget = float(os.environ.get("SWEEP_BUDGET", "150"))
    records = []

    def record(**kw):
        records.append(kw)
        print(json.dumps(kw), flush=True)

    if args.part in ("small", "both"):
        small(record, budget)
    if args.part == "stages":
        small(record, budget, STAGES_GRID)
    if args.part in ("large", "both"):
        large(record)
    if args.part == "orient":
        orient(record, budget)
    if args.part == "xla":
        xla(record)
    with open(os.path.join(out_dir, f"int8_sweep_{args.part}.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
