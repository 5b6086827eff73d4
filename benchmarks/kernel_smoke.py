"""GPU smoke test for the 4-bit Pallas kernels: compile, check against the jnp references, time.

    PYTHONPATH=$PWD python3 benchmarks/kernel_smoke.py [--part correctness,timing,sweep]

Correctness runs every kernel with interpret=False (both decode methods) on ragged and realistic
shapes. Timing: device time per call from `jax.experimental.mosaic.gpu.profiler.measure` (CUPTI;
sum of kernel times) when available, else wall-clock of a jitted batch; each timed call runs the
op over R distinct weight copies so the weight is not served from L2, and reports time / R.
This is a rough smoke check, not the benchmark protocol of benchmarks/ (see GPU.md).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.triton.dequantize_4bit import dequantize_4bit, dequantize_4bit_reference
from pallas_kernels.triton.matmul_4bit import matmul_4bit, matmul_4bit_dequant_dot, matmul_4bit_reference
from pallas_kernels.triton.matmul_4bit_small_m import matmul_4bit_small_m
from pallas_kernels.triton.matmul_4bit_t import (matmul_4bit_t, matmul_4bit_t_dequant_dot,
                                         matmul_4bit_t_reference)

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)

try:
    from jax.experimental.mosaic.gpu import profiler as _profiler
except Exception:  # noqa: BLE001
    _profiler = None


def make_weight(rng, n, k, bs):
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    absmax = jnp.asarray(rng.uniform(0.05, 1.0, (n, k // bs)).astype(np.float32))
    return packed, absmax


def log(*a):
    print(*a, flush=True)


def check(name, got, want, scale=None, exact=False):
    got32 = np.asarray(got.astype(jnp.float32))
    want32 = np.asarray(want.astype(jnp.float32))
    if exact:
        ok = got.dtype == want.dtype and np.array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
        log(f"  {'OK ' if ok else 'BAD'} {name}: bit-exact={ok}")
        return ok
    eps = float(jnp.finfo(got.dtype).eps)
    tol = 1e-5 * scale + 2 * eps * np.abs(want32) + 1e-30
    err = np.abs(got32 - want32)
    ok = bool(np.all(err <= tol)) and bool(np.all(np.isfinite(got32)))
    log(f"  {'OK ' if ok else 'BAD'} {name}: max|err|/scale={float(np.max(err / scale)):.2e} "
        f"worst err/tol={float(np.max(err / tol)):.2f}")
    return ok


def correctness():
    log("== correctness (interpret=False) ==")
    rng = np.random.default_rng(0)
    code = jnp.asarray(NF4)
    all_ok = True
    cases = [(3, 72, 192, 64, jnp.bfloat16), (130, 40, 96, 32, jnp.float32),
             (17, 72, 8192, 4096, jnp.float16), (16, 4096, 4096, 64, jnp.bfloat16),
             (1, 4096, 4096, 64, jnp.bfloat16), (300, 1024, 2048, 128, jnp.bfloat16)]
    for (m, n, k, bs, dt) in cases:
        packed, absmax = make_weight(rng, n, k, bs)
        x = jnp.asarray(rng.standard_normal((m, k)), dt)
        dy = jnp.asarray(rng.standard_normal((m, n)), dt)
        w = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=jnp.float32)
        wabs = jnp.abs(w.astype(dt).astype(jnp.float32))
        scale_f = np.asarray(jnp.dot(jnp.abs(x.astype(jnp.float32)), wabs.T,
                                     precision=jax.lax.Precision.HIGHEST)) + 1e-30
        scale_t = np.asarray(jnp.dot(jnp.abs(dy.astype(jnp.float32)), wabs,
                                     precision=jax.lax.Precision.HIGHEST)) + 1e-30
        ref_f = matmul_4bit_reference(x, packed, absmax, code, blocksize=bs)
        ref_t = matmul_4bit_t_reference(dy, packed, absmax, code, blocksize=bs)
        tag = f"M={m} N={n} K={k} bs={bs} {jnp.dtype(dt).name}"
        def run(label, fn, *args, **kw):
            nonlocal all_ok
            try:
                return fn(*args, **kw)
            except Exception as e:  # noqa: BLE001
                all_ok = False
                log(f"  ERR {label} [{tag} {kw}]: {type(e).__name__}: {str(e)[:1500]}")
                traceback.print_exc(limit=3)
                return None

        for method in ("select", "gather"):
            d = run("dequant", dequantize_4bit, packed, absmax, code, blocksize=bs, out_dtype=dt,
                    method=method)
            if d is not None:
                all_ok &= check(f"dequant {tag} {method}", d, dequantize_4bit_reference(
                    packed, absmax, code, blocksize=bs, out_dtype=dt), exact=True)
            y = run("fused", matmul_4bit, x, packed, absmax, code, blocksize=bs, method=method)
            if y is not None:
                all_ok &= check(f"fused_tiled {tag} {method}", y, ref_f, scale_f)
            if m <= 64:
                y = run("splitk", matmul_4bit_small_m, x, packed, absmax, code, blocksize=bs,
                        method=method)
                if y is not None:
                    all_ok &= check(f"splitk {tag} {method}", y, ref_f, scale_f)
            t = run("t", matmul_4bit_t, dy, packed, absmax, code, blocksize=bs, method=method)
            if t is not None:
                all_ok &= check(f"fused_tiled_t {tag} {method}", t, ref_t, scale_t)
            if 1 < m <= 64:
                y = run("splitk rowwise", matmul_4bit_small_m, x, packed, absmax, code,
                        blocksize=bs, method=method, rowwise_max_m=64)
                if y is not None:
                    all_ok &= check(f"splitk rowwise {tag} {method}", y, ref_f, scale_f)
            if m <= 64:
                for kw in (dict(split_x="kernel", splits=1), dict(split_x="wrapper", splits=1),
                           dict(split_x="kernel", rowwise_max_m=0)):
                    y = run("splitk", matmul_4bit_small_m, x, packed, absmax, code,
                            blocksize=bs, method=method, **kw)
                    if y is not None:
                        all_ok &= check(f"splitk {kw} {tag} {method}", y, ref_f, scale_f)
        y = run("dequant_dot", matmul_4bit_dequant_dot, x, packed, absmax, code, blocksize=bs)
        if y is not None:
            all_ok &= check(f"dequant_dot {tag}", y, ref_f, scale_f)
        t = run("dequant_dot_t", matmul_4bit_t_dequant_dot, dy, packed, absmax, code, blocksize=bs)
        if t is not None:
            all_ok &= check(f"dequant_dot_t {tag}", t, ref_t, scale_t)
    log(f"correctness: {'ALL OK' if all_ok else 'FAILURES'}")
    return all_ok


def device_time_us(f, args, reps):
    """Median device time (us) of one call of f(*args) (which performs `reps` ops)."""
    if _profiler is not None:
        try:
            _, times = _profiler.measure(f, iterations=10)(*args)
            if times:
                return statistics.median(times) * 1e3 / reps
        except Exception as e:  # noqa: BLE001
            log(f"  (profiler failed: {type(e).__name__}: {str(e)[:200]}; using wall clock)")
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6 / reps


KERNELS = {
    "fused": lambda x, p, a, code, bs, **cfg: matmul_4bit(x, p, a, code, blocksize=bs, **cfg),
    "splitk": lambda x, p, a, code, bs, **cfg: matmul_4bit_small_m(x, p, a, code, blocksize=bs, **cfg),
    "t": lambda dy, p, a, code, bs, **cfg: matmul_4bit_t(dy, p, a, code, blocksize=bs, **cfg),
    "dequant_dot": lambda x, p, a, code, bs, **cfg: matmul_4bit_dequant_dot(x, p, a, code, blocksize=bs, **cfg),
    "dequant_dot_t": lambda dy, p, a, code, bs, **cfg: matmul_4bit_t_dequant_dot(dy, p, a, code, blocksize=bs, **cfg),
    "naive": lambda x, p, a, code, bs: jnp.dot(x, dequantize_4bit_reference(
        p, a, code, blocksize=bs, out_dtype=x.dtype).T),
}


def timing(plan, n=4096, k=4096, bs=64, reps=8, dequant_cfgs=((32, 512),)):
    """plan: {M: [(kind, cfg), ...]}; kinds in KERNELS; 't'/'dequant_dot_t' take dy (M, N)."""
    log(f"== timing N={n} K={k} bs={bs} bf16, {reps} weight copies per call, "
        f"device={jax.devices()[0].device_kind} ==")
    rng = np.random.default_rng(1)
    code = jnp.asarray(NF4)
    ws = [make_weight(rng, n, k, bs) for _ in range(reps)]
    wd = [jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16) for _ in range(reps)]
    for bn, bk in dequant_cfgs:
        for method in ("gather", "select"):
            try:
                f = jax.jit(lambda ws, method=method, bn=bn, bk=bk: [
                    dequantize_4bit(p, a, code, blocksize=bs, out_dtype=jnp.bfloat16,
                                    method=method, block_n=bn, block_k=bk) for (p, a) in ws])
                us = device_time_us(f, (ws,), reps)
                gbs = (n * k // 2 + n * k * 2 + n * k // bs * 4) / us / 1e3
                log(f"  dequant {method} bn={bn} bk={bk}: {us:8.1f} us  {gbs:7.0f} GB/s")
            except Exception as e:  # noqa: BLE001
                log(f"  ERR dequant {method} bn={bn} bk={bk}: {type(e).__name__}: {str(e)[:300]}")
    try:
        f = jax.jit(lambda ws: [w * 2 for w in ws])
        us = device_time_us(f, (wd,), reps)
        log(f"  bf16 x*2 over (N,K) (read+write): {us:8.1f} us  {n * k * 4 / us / 1e3:7.0f} GB/s")
    except Exception as e:  # noqa: BLE001
        log(f"  ERR copy: {e}")
    for m, entries in plan.items():
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        rows = [("jnp.dot bf16 x@W.T", jax.jit(lambda x, ws: [jnp.dot(x, w.T) for w in ws]), (x, wd)),
                ("jnp.dot bf16 dy@W", jax.jit(lambda dy, ws: [jnp.dot(dy, w) for w in ws]), (dy, wd))]
        for kind, cfg in entries:
            op = functools.partial(KERNELS[kind], code=code, bs=bs, **cfg)
            f = jax.jit(lambda a0, ws, op=op: [op(a0, p, a) for (p, a) in ws])
            rows.append((f"{kind} {cfg}", f, (dy if kind in ("t", "dequant_dot_t") else x, ws)))
        base = None
        for name, f, args in rows:
            try:
                us = device_time_us(f, args, reps)
                base = base or us
                log(f"  M={m:5d} {name:72s} {us:9.1f} us {us / base:5.2f}x")
            except Exception as e:  # noqa: BLE001
                log(f"  M={m:5d} ERR {name}: {type(e).__name__}: {str(e)[:400]}")


BASIC = {
    1: [("splitk", {}), ("fused", {})],
    16: [("splitk", {}), ("fused", {}), ("t", {})],
    2048: [("naive", {}), ("fused", {}), ("dequant_dot", {}), ("t", {}), ("dequant_dot_t", {})],
}

SWEEP = {
    1: [("splitk", {}), ("splitk", dict(block_n=64, block_k=256, num_warps=8)),
        ("splitk", dict(block_n=32, block_k=512)), ("splitk", dict(block_n=16, block_k=512)),
        ("splitk", dict(block_n=64, block_k=512, num_warps=8)), ("splitk", dict(splits=4)),
        ("splitk", dict(splits=16)), ("splitk", dict(num_stages=1)), ("splitk", dict(num_stages=4)),
        ("splitk", dict(block_n=16, block_k=256, num_warps=2)), ("splitk", dict(method="select")),
        ("dequant_dot", {})],
    16: [("splitk", {}), ("splitk", dict(rowwise_max_m=16)), ("splitk", dict(block_n=32)),
         ("splitk", dict(block_n=128, num_warps=8)), ("splitk", dict(block_k=128)),
         ("splitk", dict(block_k=512, num_warps=8)), ("splitk", dict(splits=2)),
         ("splitk", dict(splits=8)), ("splitk", dict(num_stages=1)),
         ("fused", dict(block_m=16, block_n=32, block_k=256)), ("dequant_dot", {})],
    64: [("splitk", {}), ("splitk", dict(block_n=32)), ("splitk", dict(block_n=128, num_warps=8)),
         ("fused", dict(block_m=64, block_n=64)), ("dequant_dot", {}), ("t", {}), ("dequant_dot_t", {})],
    2048: [("dequant_dot", {}), ("fused", {}),
           ("fused", dict(block_m=256, block_n=128, block_k=64, num_warps=8)),
           ("fused", dict(block_m=128, block_n=256, block_k=64, num_warps=8)),
           ("fused", dict(block_m=256, block_n=128, block_k=128, num_warps=8, num_stages=2)),
           ("fused", dict(block_m=128, block_n=128, block_k=64, num_stages=4)),
           ("fused", dict(block_m=128, block_n=128, block_k=128, num_warps=8)),
           ("dequant_dot_t", {}), ("t", {}),
           ("t", dict(block_m=256, block_n=64, block_k=128, num_warps=8)),
           ("t", dict(block_m=128, block_n=32, block_k=256, num_warps=8)),
           ("t", dict(block_m=128, block_n=64, block_k=128, num_warps=8))],
}


FINAL = {
    1: [("splitk", {}), ("splitk", dict(split_x="wrapper")), ("splitk", dict(splits=1, block_n=16)),
        ("splitk", dict(splits=1, block_n=8)), ("splitk", dict(splits=2, block_n=16)),
        ("splitk", dict(splits=4)), ("splitk", dict(block_n=16, block_k=512)),
        ("splitk", dict(block_n=16, block_k=512, splits=2))],
    16: [("splitk", {}), ("splitk", dict(split_x="kernel")), ("splitk", dict(block_k=64)),
         ("splitk", dict(split_x="kernel", block_k=64))],
    64: [("splitk", {}), ("splitk", dict(split_x="kernel")), ("dequant_dot", {}),
         ("dequant_dot_t", {})],
    2048: [("dequant_dot", {}), ("fused", {}), ("dequant_dot_t", {}), ("t", {})],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="correctness,timing")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    log(f"jax {jax.__version__}, devices {jax.devices()}")
    parts = args.part.split(",")
    ok = True
    if "correctness" in parts:
        ok = correctness()
    if "timing" in parts:
        timing(BASIC, reps=args.reps)
    if "sweep" in parts:
        timing(SWEEP, reps=args.reps,
               dequant_cfgs=((32, 512), (16, 1024), (64, 256), (32, 1024), (64, 512)))
    if "final" in parts:
        timing(FINAL, reps=args.reps, dequant_cfgs=((32, 512), (16, 512)))
    if "shapes" in parts:
        for (k, n) in ((4096, 14336), (14336, 4096)):
            timing({1: [("splitk", {}), ("splitk", dict(split_x="wrapper"))],
                    16: [("splitk", {}), ("splitk", dict(split_x="kernel"))],
                    2048: [("dequant_dot", {}), ("dequant_dot_t", {})]},
                   n=n, k=k, reps=4, dequant_cfgs=((32, 512),))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
