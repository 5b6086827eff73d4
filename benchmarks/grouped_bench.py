"""The grouped (mixture-of-experts) matmul at a Qwen3-30B-A3B training step's shapes.

    python -m benchmarks.grouped_bench [--out DIR] [--tag _x]   # a GPU: device times
    python -m benchmarks.grouped_bench --tiny                    # CPU smoke run (wall times)

2048 tokens x top-8 = 16384 sorted rows over 128 experts (random routing, seeded), hidden 2048,
moe_intermediate 768: gate/up (N=768, K=2048) and down (N=2048, K=768). Contenders, forward
(y) and forward + backward (y and dx) each:
- `qgmm nf4 <backend>`: jqlora's qgmm on an NF4 stack (double-quantized, blocksize 64), for
  `auto` (its plan printed) and `xla` (dequantize + jax.lax.ragged_dot);
- `qgmm bf16 auto`: qgmm on the bf16 stack (the grouped kernel alone, no dequant pass);
- `lax.ragged_dot bf16`: jax.lax.ragged_dot on the bf16 stack (XLA's lowering);
- `upstream ragged_dot_mgpu bf16` (Hopper): JAX's Pallas example kernel, block 128/128/64,
  4 stages, grid_block_n 2 (docs: MODEL_FAMILIES A5), forward only;
- `mosaic mgpu_grouped_dot_4bit[_t] nf4` (Hopper): the Mosaic kernels decoding the NF4 stack
  themselves, the forward and (`_t`) dx alone;
- `triton grouped_dot_4bit nf4` / `triton grouped_dot bf16` (any GPU): the Triton grouped
  kernels (the 4-bit one decoding tiles in registers), forward only; with `--triton-configs
  "block_m=128,num_warps=8;method=select"` also the 4-bit forward and its backward kernel
  (`grouped_dot_4bit_t`, dx = dy @ W_e: `dx_ms`) at each of those keyword overrides; with
  `--mosaic-configs "compute_wgs=2"` the Mosaic 4-bit kernels at those `Grouped4bitConfig` settings.
Ratios are over `qgmm bf16 auto` (the bf16 grouped matmul; issue target: NF4 <= 1.3x), timed
first at each projection. `--budget-s S` starts no contender after S seconds (listed as skipped).
Device times come from `benchmarks.timing.jax_device_ms` (CUPTI kernel sums); `--tiny` uses
wall time. Writes <out>/<gpu>-<date><tag>_grouped.json with device, date, commit and versions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jqlora import ops, quant

TOKENS, TOP_K, EXPERTS, HIDDEN, MOE_INTER = 2048, 8, 128, 2048, 768
PROJECTIONS = (("gate_up", MOE_INTER, HIDDEN), ("down", HIDDEN, MOE_INTER))  # (name, N, K)
TINY = dict(tokens=16, top_k=2, experts=4, projections=(("gate_up", 64, 128), ("down", 128, 64)))


def routing(tokens: int, top_k: int, experts: int, seed: int = 0) -> np.ndarray:
    """Group sizes of random top-k routing: each token picks top_k distinct experts."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def parse_configs(spec: str | None, flag: str = "--triton-configs") -> list[dict]:
    """ "block_m=128,num_warps=8;method=select" -> [{"block_m": 128, "num_warps": 8}, {"method": "select"}]."""
    out = []
    for part in (spec or "").split(";"):
        if not part.strip():
            continue
        cfg = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{flag}: {item!r} is not key=value")
            value = value.strip()
            cfg[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
        out.append(cfg)
    return out


def _config_text(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def contenders(on_hopper: bool, triton_configs=(), mosaic_configs=()):
    """name -> (weight kind, fn(x, group_sizes, w) -> y); a name with "_t " takes dy (the dx product)."""
    c = {  # the ratios' base first, then what it is compared with, the slow jnp path last of these
        "qgmm bf16 auto": ("bf16", lambda x, g, w: ops.qgmm(x, g, w)),
        "qgmm nf4 auto": ("nf4", lambda x, g, w: ops.qgmm(x, g, w)),
        "qgmm nf4 xla": ("nf4", lambda x, g, w: ops.qgmm(x, g, w, backend="xla")),
        "lax.ragged_dot bf16": ("bf16_raw", lambda x, g, w: jax.lax.ragged_dot_general(
            x, w, g, _NT, preferred_element_type=jnp.float32).astype(x.dtype)),
    }
    if on_hopper:
        c["upstream ragged_dot_mgpu bf16"] = ("bf16_raw", _upstream)
        # the Mosaic kernels decoding the 4-bit stack themselves: forward, and dx alone
        c["mosaic mgpu_grouped_dot_4bit nf4"] = ("nf4", _registered("mgpu_grouped_dot_4bit"))
        c["mosaic mgpu_grouped_dot_4bit_t nf4"] = ("nf4", _registered("mgpu_grouped_dot_4bit_t"))
        from pallas_kernels.mosaic.grouped_mgpu_4bit import Grouped4bitConfig

        for cfg in mosaic_configs:
            for name in ("mgpu_grouped_dot_4bit", "mgpu_grouped_dot_4bit_t"):
                c[f"mosaic {name} nf4 {_config_text(cfg)}"] = ("nf4", _registered(name, {"config": Grouped4bitConfig(**cfg)}))
    if jax.default_backend() == "gpu":  # the Triton grouped kernels, forward alone
        c["triton grouped_dot_4bit nf4"] = ("nf4", _registered("grouped_dot_4bit"))
        c["triton grouped_dot bf16"] = ("bf16_raw", _registered("grouped_dot"))
        for cfg in triton_configs:
            c[f"triton grouped_dot_4bit nf4 {_config_text(cfg)}"] = ("nf4", _registered("grouped_dot_4bit", cfg))
            c[f"triton grouped_dot_4bit_t nf4 {_config_text(cfg)}"] = ("nf4", _registered("grouped_dot_4bit_t", cfg))
    return c


def _registered(name, cfg=None):
    """A registered grouped kernel called directly: on the dense stack, or on the 4-bit stack's
    kernel operands."""
    from jqlora.ops.qgmm import kernel_operands
    from pallas_kernels import registry

    fn = registry.get(name).fn
    cfg = cfg or {}
    if name == "grouped_dot":
        return lambda x, g, w: fn(x, g, w, **cfg)
    return lambda x, g, ex: fn(x, g, *kernel_operands(ex), blocksize=ex.blocksize, **cfg)


_NT = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _upstream(x, g, w):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    n = w.shape[1]
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=g, block_m=128, block_n=128, block_k=64,
                                      max_concurrent_steps=4, grid_block_n=2 if n % 256 == 0 else 1,
                                      transpose_rhs=True)


def _forward(fn, g, w):
    return lambda x: fn(x, g, w)


def _forward_backward(fn, g, w):
    def f(x, dy):
        y, vjp = jax.vjp(lambda xx: fn(xx, g, w), x)
        return y, vjp(dy)[0]
    return f


def _time(f, args, tiny: bool, iterations: int) -> float:
    if not tiny:
        from benchmarks.timing import jax_device_ms

        return jax_device_ms(f, *args, iterations=iterations)
    jf = jax.jit(f)
    jax.block_until_ready(jf(*args))
    t0 = time.perf_counter()
    for _ in range(iterations):
        jax.block_until_ready(jf(*args))
    return (time.perf_counter() - t0) / iterations * 1e3


def bench(tiny: bool = False, iterations: int = 10, only: str | None = None, log=print, triton_configs=(),
          mosaic_configs=(), budget_s: float | None = None, projection: str | None = None) -> dict:
    """Every contender at both projections; once `budget_s` seconds have passed, the contenders
    not started are listed under "skipped" (a device call's time limit then still gets a file)."""
    from jqlora.ops import dispatch, grouped_dispatch

    shape = TINY if tiny else dict(tokens=TOKENS, top_k=TOP_K, experts=EXPERTS, projections=PROJECTIONS)
    e = shape["experts"]
    m = shape["tokens"] * shape["top_k"]
    gs = jnp.asarray(routing(shape["tokens"], shape["top_k"], e))
    hopper = jax.default_backend() == "gpu" and dispatch.mgpu_available()
    rows, skipped, t0 = [], [], time.perf_counter()
    for i, (name, n, k) in enumerate(shape["projections"]):
        if projection and name != projection:
            continue
        key = jax.random.key(10 + i)
        w = (jax.random.normal(key, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        weights = {"bf16_raw": w, "bf16": quant.ExpertWeights.from_dense(w),
                   "nf4": quant.quantize_experts(w, "nf4", 64, double_quant=True)}
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
        flops = 2 * m * n * k
        for cname, (kind, fn) in contenders(hopper, triton_configs, mosaic_configs).items():
            if only and only not in cname:
                continue
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                skipped.append(f"{name}: {cname}")
                continue
            wt = weights[kind]
            row = {"projection": name, "m": m, "n": n, "k": k, "experts": e, "contender": cname}
            if isinstance(wt, quant.ExpertWeights):
                backend = cname.split()[-1] if "qgmm" in cname else "auto"
                row["plan"] = str(grouped_dispatch.choose_grouped_plan(wt, m, backend, dtype="bfloat16"))
            if "_t " in cname:  # the backward kernel alone: dx = dy @ W_e
                timings = (("dx", _forward(fn, gs, wt), (dy,)),)
            else:
                timings = (("fwd", _forward(fn, gs, wt), (x,)), ("fwd_bwd", _forward_backward(fn, gs, wt), (x, dy)))
            for label, f, args in timings:
                if label == "fwd_bwd" and cname.startswith(("upstream", "triton", "mosaic")):
                    continue
                try:
                    ms = _time(f, args, tiny, iterations)
                    row[f"{label}_ms"] = round(ms, 4)
                    row[f"{label}_tflops"] = round(flops * (2 if label == "fwd_bwd" else 1) / ms / 1e9, 1)
                except Exception as err:  # noqa: BLE001 - a contender that fails is a result too
                    row[f"{label}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(json.dumps(row))
            rows.append(row)
    for r in rows:  # ratios over the bf16 grouped matmul (qgmm bf16 auto) of the same projection
        base = next((b for b in rows if b["projection"] == r["projection"] and b["contender"] == "qgmm bf16 auto"), None)
        for label in ("fwd", "fwd_bwd"):
            if base and f"{label}_ms" in r and f"{label}_ms" in base:
                r[f"{label}_ratio"] = round(r[f"{label}_ms"] / base[f"{label}_ms"], 3)
    return {"rows": rows, "skipped": skipped, "tiny": tiny, "routing_seed": 0}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes, wall time: a CPU smoke run")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--only", default=None, help="run the contenders whose name contains this")
    p.add_argument("--projection", default=None, choices=[name for name, _, _ in PROJECTIONS],
                   help="time this projection alone (default: both)")
    p.add_argument("--out", default=None, help="folder for the JSON result (none: print only)")
    p.add_argument("--tag", default="")
    p.add_argument("--triton-configs", default=None,
                   help='keyword overrides of the Triton 4-bit grouped kernels, ";"-separated, e.g. '
                        '"block_m=128,num_warps=8;method=select" (a GPU: forward and dx kernels at each)')
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no contender after this many seconds; those left are listed as skipped")
    p.add_argument("--mosaic-configs", default=None,
                   help='Grouped4bitConfig settings of the Mosaic 4-bit grouped kernels, ";"-separated, e.g. '
                        '"compute_wgs=2;max_concurrent_steps=4" (Hopper: forward and dx kernels at each)')
    a = p.parse_args(argv)
    from benchmarks.run import device_name, versions

    try:
        configs, mosaic = parse_configs(a.triton_configs), parse_configs(a.mosaic_configs, "--mosaic-configs")
    except ValueError as err:
        p.error(str(err))
    res = bench(tiny=a.tiny, iterations=a.iterations, only=a.only, triton_configs=configs, mosaic_configs=mosaic,
                budget_s=a.budget_s, projection=a.projection)
    res.update(device=device_name(), date=datetime.date.today().isoformat(), commit=_commit(),
               versions=versions(), argv=sys.argv[1:])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        name = f"{res['device'].lower().replace(' ', '-')}-{res['date']}{a.tag}_grouped.json"
        path = os.path.join(a.out, name)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
