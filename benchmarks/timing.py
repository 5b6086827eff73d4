"""Device-time measurement: kernel time summed per call, launch and Python overhead left out;
and the wall-clock loop the step benchmarks share.

JAX: CUPTI through `jax.experimental.mosaic.gpu.profiler.measure` (per-iteration sums of kernel
times). torch: `torch.profiler` kernel times. Both sides get the same treatment: each call runs
R independent products over R weight copies (so the weight streams from HBM, not L2), and the
time per product is the call's kernel time / R; the median over iterations is reported.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def distinct_copies(x, n: int) -> list:
    """n device copies of x, one per product of a timed call. Products that share one x are merged
    by XLA's dot merger into one wide GEMM plus concatenate/slice copies, which no single user call
    runs, and which time differently from the products apart. An optimization barrier per product
    does not prevent it (identical barriers are CSE'd). Evidence: benchmarks/results/JOURNAL.md."""
    return [x] + [jnp.array(x, copy=True) for _ in range(n - 1)]


def l2_defeating_copies(weight_bytes: int, l2_bytes: int = 60 * 2**20, cap: int = 8) -> int:
    """How many weight copies make one sweep at least twice the L2 size."""
    return max(1, min(cap, -(-2 * l2_bytes // max(1, weight_bytes))))


def _spin_up(call, seconds: float = 0.15) -> None:
    """Run `call` back to back for a while first: an idle GPU sits at low clocks, and a
    measurement taken right after a compile would time the clock ramp, not the kernel."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        call()


def jax_device_ms(fn, *args, iterations: int = 20) -> float:
    """Median per-call kernel time (ms) of jitted `fn(*args)` over `iterations` calls."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    _spin_up(lambda: jax.block_until_ready(f(*args)))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(f, iterations=iterations)(*args)
        if times is None:
            raise RuntimeError("no kernel timings")
        times = times if isinstance(times, list) else [times]
        return float(statistics.median(times))
    except Exception:  # CUPTI missing: wall clock of blocked calls (includes dispatch; flagged)
        jax.block_until_ready(f(*args))
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            samples.append((time.perf_counter() - t0) * 1e3)
        return float(statistics.median(samples))


def timed_us(fn, *args) -> dict:
    """{"us": device microseconds of fn(*args)} (`jax_device_ms`), or {"error": ...} where the call
    fails: a kernel setting that does not compile or run is a result of a sweep too."""
    try:
        return {"us": round(jax_device_ms(fn, *args) * 1e3, 2)}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {str(err)[:200]}"}


def timed_rows(contenders, args, base: dict, log=print) -> list[dict]:
    """One row per (label, fn) contender: `base`, the label and `timed_us(fn, *args)`, each logged
    as a JSON line as it is measured (the sweeps' rows)."""
    import json

    rows = []
    for label, fn in contenders:
        rows.append({**base, "contender": label, **timed_us(fn, *args)})
        log(json.dumps(rows[-1]))
    return rows


def us_per_product(fn, args, copies: int, iterations: int = 10):
    """Device µs per product of a call that runs `copies` products, or the error text when the
    config does not compile (for sweeps, a failing config is a result too)."""
    try:
        return jax_device_ms(fn, *args, iterations=iterations) / copies * 1e3
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def torch_device_ms(fn, iterations: int = 20) -> float:
    """Mean per-call CUDA kernel time (ms) of `fn()` from torch.profiler (the protocol's torch reference, docs/benchmarks.md)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    _spin_up(lambda: (fn(), torch.cuda.synchronize()))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total_us += evt.time_range.elapsed_us()
    return total_us / 1e3 / iterations


def time_steps(step: Callable[[], float], steps: int) -> tuple[float, float, float]:
    """Wall clock of a training step: `step()` runs one step and returns its loss as a Python float
    (so it waits for the device). Returns (the first call's seconds, which include the compile;
    the median seconds of `steps` further calls; the last loss)."""
    t = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    return first, float(statistics.median(times)), loss
