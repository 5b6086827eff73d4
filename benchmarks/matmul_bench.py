"""Quantized matmul contenders over the protocol's shapes (docs/benchmarks.md): forward and forward+backward(dx).

Ratios are device time / device time of `jnp.dot` bf16 on the same shape in the same run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, jax_device_ms, l2_defeating_copies
from jqlora import ops, quant

SHAPES_KN = ((4096, 4096), (4096, 14336), (14336, 4096))
MS = (1, 16, 128, 2048, 8192)


def _rand_weights(n, k, copies, seed=0):
    keys = jax.random.split(jax.random.key(seed), copies)
    return [jax.random.normal(kk, (n, k), jnp.bfloat16) * 0.02 for kk in keys]


def _fwd(op):
    return lambda xs, ws: [op(x, w) for x, w in zip(xs, ws)]


def _fwd_bwd(op):
    def f(xs, ws, dys):
        out = []
        for x, w, dy in zip(xs, ws, dys):
            y, vjp = jax.vjp(lambda xx: op(xx, w), x)
            out.append((y, vjp(dy)[0]))  # keep y: an unused forward would be dead code
        return out
    return f


def jax_contenders(variants: list[str]):
    """name -> op(x, w) for each JAX contender; w is the dense or quantized weight it needs."""
    dense = lambda x, w: x @ w.T  # bf16 in, bf16 out: what users call
    c = {"jnp.dot bf16": ("dense", dense),
         "jnp dequant + dot (xla)": ("nf4", lambda x, q: ops.qmatmul(x, q, backend="xla")),
         "qmatmul pallas (auto plan)": ("nf4", lambda x, q: ops.qmatmul(x, q, backend="pallas"))}
    from pallas_kernels import registry

    for name in variants:  # matmul_4bit variants run on the NF4 weight, matmul_int8 ones on INT8
        kind = "int8" if registry.get(name).op == "matmul_int8" else "nf4"
        c[f"variant {name}"] = (kind, lambda x, q, name=name: ops.qmatmul(x, q, backend="pallas", variant=name))
    c["int8 jnp dequant + dot (xla)"] = ("int8", lambda x, q: ops.qmatmul(x, q, backend="xla"))
    c["int8 qmatmul pallas"] = ("int8", lambda x, q: ops.qmatmul(x, q, backend="pallas"))
    return c


def bench_shape(k, n, m, variants, *, iterations=10, with_torch=True, log=print):
    """All contenders on one (M, K, N); returns {name: {"fwd_ms", "fwd_bwd_ms"}} per product."""
    from pallas_kernels import registry

    dense_w = _rand_weights(n, k, l2_defeating_copies(n * k * 2))
    nq = l2_defeating_copies(n * k // 2)
    weights = {
        "dense": dense_w,
        "nf4": [quant.quantize_4bit(w, "nf4", 64, True) for w in (dense_w * nq)[:nq]],
        "int8": [quant.quantize_int8(w) for w in (dense_w * nq)[: l2_defeating_copies(n * k)]],
    }
    most = max(len(v) for v in weights.values())
    xs = distinct_copies(jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16), most)
    dys = distinct_copies(jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16), most)
    rows = {}
    for name, (kind, op) in jax_contenders(variants).items():
        if name.startswith("variant "):
            v = registry.get(name.removeprefix("variant "))
            if not v.supports(m, n, k, 64):
                continue
        ws = weights[kind]
        row = {}
        try:
            r = len(ws)
            row["fwd_ms"] = jax_device_ms(_fwd(op), xs[:r], ws, iterations=iterations) / r
            if not name.startswith("variant "):
                row["fwd_bwd_ms"] = jax_device_ms(_fwd_bwd(op), xs[:r], ws, dys[:r],
                                                  iterations=iterations) / r
        except Exception as e:  # keep the table going; the failure is recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows[name] = row
        log(f"  M={m} K={k} N={n} {name}: {row}")
    if with_torch:  # same process: only for a quick look (see benchmarks/torch_bench.py)
        from benchmarks.torch_bench import torch_rows

        rows.update(torch_rows(k, n, m, iterations, log))
    return rows


def ratios(rows: dict) -> dict:
    """Each contender's time / jnp.dot bf16 time (same shape, same run)."""
    base = rows.get("jnp.dot bf16", {})
    out = {}
    for name, r in rows.items():
        out[name] = {key: (r[key] / base[key] if key in r and base.get(key) else None)
                     for key in ("fwd_ms", "fwd_bwd_ms")}
    return out


def dequant_throughput(n=14336, k=4096, iterations=20):
    """Standalone dequant (4-bit -> bf16) bytes/s against a measured device copy bandwidth."""
    from pallas_kernels import registry
    from jqlora.ops.products import kernel_operands_4bit

    w = jax.random.normal(jax.random.key(0), (n, k), jnp.bfloat16) * 0.02
    q = quant.quantize_4bit(w, "nf4", 64, True)
    packed, absmax = kernel_operands_4bit(q)
    absmax = jax.block_until_ready(absmax)
    big = jnp.ones((n * k,), jnp.bfloat16)
    copy_ms = jax_device_ms(lambda a, s: a * s, big, jnp.bfloat16(1.5), iterations=iterations)
    copy_bw = 2 * big.nbytes / (copy_ms * 1e-3)
    out = {"shape": [n, k], "copy_tb_s": copy_bw / 1e12, "variants": {}}
    moved = packed.nbytes + absmax.nbytes + n * k * 2
    for v in registry.for_op("dequantize_4bit"):
        try:
            ms = jax_device_ms(lambda p, a, c: v.fn(p, a, c, blocksize=64, out_dtype=jnp.bfloat16),
                               packed, absmax, q.code, iterations=iterations)
            bw = moved / (ms * 1e-3)
            out["variants"][v.name] = {"ms": ms, "tb_s": bw / 1e12, "fraction_of_copy": bw / copy_bw}
        except Exception as e:  # noqa: BLE001
            out["variants"][v.name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    ms = jax_device_ms(lambda qq: quant.dequantize(qq, jnp.bfloat16), q, iterations=iterations)
    moved_ref = q.packed.nbytes + q.absmax.nbytes + n * k * 2
    out["variants"]["jnp reference (xla)"] = {"ms": ms, "tb_s": moved_ref / (ms * 1e-3) / 1e12,
                                             "fraction_of_copy": moved_ref / (ms * 1e-3) / copy_bw}
    return out
