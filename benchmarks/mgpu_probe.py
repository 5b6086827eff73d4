"""The Mosaic GPU 4-bit kernel (`matmul_4bit_mgpu`) over tile configs, against the bf16 GEMM and
`qmatmul`'s default (dequant_dot above M = 64), same run; plus its correctness checks.

    python -m benchmarks.mgpu_probe check                  # errors vs the reference, int4 view
    python -m benchmarks.mgpu_probe time --ms 128,2048     # one JSON line per (shape, M, config)
        [--shapes 4096:4096,...] [--configs "tile_m=128;tile_m=256,k_splits=2"]

NF4 blocksize 64 with double quant; device time per product with the weight streamed from HBM
and distinct x per product (benchmarks/timing.py). Rows go to $OUT/mgpu_probe_<part>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

from benchmarks.sweep_setup import (
    bf16_us, nf4_weight_copies, record_row, time_configs_into, write_rows)
from benchmarks.timing import distinct_copies, us_per_product
from jqlora import ops, quant
from pallas_kernels.mosaic import matmul_4bit_mgpu as mm
from pallas_kernels.mosaic import matmul_4bit_mgpu_t as mt
from pallas_kernels.triton.matmul_4bit import matmul_4bit_reference

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
CONFIGS = ("default", "tile_m=128,k_splits=4", "tile_m=256")


def _config(text: str, shape=None) -> mm.Config | None:
    """"tile_m=128,k_splits=2" -> Config; "default" -> None (the kernel's default_config);
    "default,k_wgs=2" -> the default config of shape (m, n, k) with those fields replaced
    (pipeline depth lowered until it fits shared memory)."""
    if text == "default":
        return None
    items = [kv.split("=") for kv in text.split(",") if kv and kv != "default"]
    fields = {k: int(v) for k, v in items}
    if not text.startswith("default"):
        return mm.Config(**fields)
    cfg = dataclasses.replace(mm.default_config(*shape, 64), **fields)
    while cfg.max_concurrent_steps > 2 and mm.smem_bytes(cfg, 64) > mm.SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
    return cfg


def previous_default(m: int) -> str:
    """The 4-bit forward variant `auto` ran before this kernel (jqlora.ops.backends)."""
    from jqlora.ops import backends as b
    if m <= b.GEMV_MAX_M_4BIT:
        return b.DEFAULT_4BIT_FWD_GEMV
    if m <= b.BLOCK_DOT_MAX_M_4BIT:
        return b.DEFAULT_4BIT_FWD_BLOCK_DOT
    if m <= b.DECODED_DOT_MAX_M_4BIT:
        return b.DEFAULT_4BIT_FWD_DECODED_DOT
    return b.DEFAULT_4BIT_FWD_LARGE


def _operands(q):
    n, k = q.shape
    return (q.packed.reshape(n, k // 2), q.absmax.reshape(n, k // q.blocksize), q.code,
            (q.nested_absmax, q.nested_code, q.offset))


def _mgpu(x, q, cfg):
    packed, codes, code, nested = _operands(q)
    return mm.matmul_4bit_mgpu(x, packed, codes, code, blocksize=q.blocksize, nested=nested,
                               config=cfg)


def check(out: list) -> None:
    """Errors against the float32 reference and against dequant_dot (the same bf16 weights, so
    only the fp32 summation order differs); whether the int4 view of the packed bytes copies."""
    packed = jnp.zeros((256, 128), jnp.uint8)
    view = jax.jit(lambda p: jax.lax.bitcast_convert_type(p, jnp.int4).reshape(256, 256))
    hlo = view.lower(packed).compile().as_text()
    rec = dict(part="int4_view", hlo=[ln.strip() for ln in hlo.splitlines()
                                      if " = " in ln or "ENTRY" in ln][:12])
    print(json.dumps(rec), flush=True)
    out.append(rec)
    for (m, k, n, bs, qt, dt, cfg_text) in (
            (128, 512, 256, 64, "nf4", jnp.bfloat16, "tile_m=128"),
            (256, 1024, 512, 64, "nf4", jnp.bfloat16, "tile_m=256"),
            (200, 1024, 256, 64, "nf4", jnp.bfloat16, "tile_m=128,k_splits=2"),
            (128, 4096, 4096, 64, "nf4", jnp.bfloat16, "tile_m=128,tile_k=128"),
            (64, 512, 256, 64, "fp4", jnp.float16, "tile_m=64,wg_rows=128"),
            (256, 1024, 512, 128, "nf4", jnp.bfloat16,
             "tile_m=256,tile_k=128,max_concurrent_steps=2"),
            (128, 1024, 256, 256, "nf4", jnp.float16, "tile_m=128"),
            (64, 1024, 512, 64, "nf4", jnp.bfloat16, "tile_m=64,wg_rows=128,tile_k=256,"
             "max_concurrent_steps=3"),
            # four compute warpgroups (hung in s15-2 and s16-1 when 3 warpgroups were launched):
            # last, so that a hang leaves the rows above printed
            (16, 1024, 256, 64, "nf4", jnp.bfloat16, "tile_m=16,tile_k=128,k_wgs=2"),
            (40, 1024, 256, 128, "fp4", jnp.float16, "tile_m=64,tile_k=256,k_wgs=2,"
             "max_concurrent_steps=3")):
        kx, kw = jax.random.split(jax.random.key(m + k + n))
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
        q = quant.quantize_4bit(w, qt, bs, True)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dt)
        rec = dict(part="check", m=m, k=k, n=n, blocksize=bs, quant_type=qt,
                   dtype=jnp.dtype(dt).name, config=cfg_text)
        try:
            got = jax.jit(lambda x, q: _mgpu(x, q, _config(cfg_text)))(x, q).astype(jnp.float32)
            packed, codes, code, nested = _operands(q)
            absmax = quant.absmax_f32(q).reshape(n, k // bs)
            ref = matmul_4bit_reference(x.astype(jnp.float32), packed, absmax, code,
                                        blocksize=bs).astype(jnp.float32)
            dd = ops.qmatmul(x, q, backend="pallas", variant="dequant_dot").astype(jnp.float32)
            rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            rec.update(rel_vs_f32_ref=rel(got, ref), rel_dequant_dot_vs_f32_ref=rel(dd, ref),
                       max_abs_vs_dequant_dot=float(jnp.max(jnp.abs(got - dd))),
                       finite=bool(jnp.all(jnp.isfinite(got))))
        except Exception as e:  # noqa: BLE001 - a failing config is a result
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        print(json.dumps(rec), flush=True)
        out.append(rec)


def _config_t(text: str, shape=None) -> mt.ConfigT | None:
    """"tile_n=128,n_splits=2" -> ConfigT; "default" -> None (`default_config_t`);
    "default,tile_n=128" -> the default config of shape (m, n, k) with those fields replaced."""
    if text == "default":
        return None
    items = (kv.split("=") for kv in text.split(",") if kv and kv != "default")
    fields = {k: int(v) for k, v in items}
    if text.startswith("default"):
        return dataclasses.replace(mt.default_config_t(*shape, 64), **fields)
    return mt.ConfigT(**fields)


def _mgpu_t(dy, q, cfg):
    n, k = q.shape
    absmax = quant.absmax_f32(q).reshape(n, k // q.blocksize)
    return mt.matmul_4bit_mgpu_t(dy, q.packed.reshape(n, k // 2), absmax, q.code,
                                 blocksize=q.blocksize, config=cfg)


def check_t(out: list) -> None:
    """The backward kernel: dy = I gives dequant(W) itself (each output one product 1 * w, so
    bit for bit bitsandbytes' weight); random dy against the float32 reference."""
    from pallas_kernels.triton.matmul_4bit_t import matmul_4bit_t_reference
    for (m, n, k, bs, dt, cfg_text) in ((256, 256, 512, 64, jnp.bfloat16, "default"),
                                        (256, 256, 512, 64, jnp.float16, "tile_n=128"),
                                        (256, 256, 512, 128, jnp.bfloat16, "n_splits=2")):
        w = jax.random.normal(jax.random.key(n + k), (n, k), jnp.float32) * 0.05
        q = quant.quantize_4bit(w, "nf4", bs, True)
        rec = dict(part="check_t", m=m, n=n, k=k, blocksize=bs, dtype=jnp.dtype(dt).name,
                   config=cfg_text)
        try:
            eye = jnp.eye(n, dtype=dt)
            got = jax.jit(lambda d, q: _mgpu_t(d, q, _config_t(cfg_text)))(eye, q)
            want = quant.dequantize(q, dt)
            rec["identity_bit_exact"] = bool(jnp.all(got.view(jnp.uint16) == want.view(jnp.uint16)))
            for mm_ in (1, 100, 1000):
                dy = jax.random.normal(jax.random.key(mm_), (mm_, n), jnp.float32).astype(dt)
                got = jax.jit(lambda d, q: _mgpu_t(d, q, _config_t(cfg_text)))(dy, q)
                absmax = quant.absmax_f32(q).reshape(n, k // bs)
                ref = matmul_4bit_t_reference(dy.astype(jnp.float32), q.packed.reshape(n, k // 2),
                                              absmax, q.code, blocksize=bs)
                rec[f"rel_m{mm_}"] = float(jnp.linalg.norm(got.astype(jnp.float32) - ref)
                                           / jnp.linalg.norm(ref))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        print(json.dumps(rec), flush=True)
        out.append(rec)


def time_backward(out: list, ms, shapes, configs) -> None:
    """dx = dy @ W: the dense bf16 product, dequant_dot_t (the default before) and the Mosaic
    backward kernel's configs."""
    for k, n in shapes:
        copies, dense, qs = nf4_weight_copies(k, n)
        for m in ms:
            dy = jax.random.normal(jax.random.key(m), (m, n), jnp.bfloat16)
            dys = distinct_copies(dy, copies)
            res = dict(k=k, n=n, m=m, part="bwd")
            res["bf16"] = us_per_product(lambda ds, ws: [d @ w for d, w in zip(ds, ws)],
                                         (dys, dense), copies)
            res["dequant_dot_t"] = us_per_product(
                lambda ds, qs: [_dd_t(d, q) for d, q in zip(ds, qs)], (dys, qs), copies)
            for text in configs:
                cfg = _config_t(text, (m, n, k))
                res[f"mgpu_t {text}"] = us_per_product(
                    lambda ds, qs, cfg=cfg: [_mgpu_t(d, q, cfg) for d, q in zip(ds, qs)],
                    (dys, qs), copies)
            record_row(res, out)


def _dd_t(dy, q):
    """dequant_dot_t as `qmatmul`'s backward runs it (scales de-nested by XLA)."""
    from pallas_kernels.triton.matmul_4bit_t import matmul_4bit_t_dequant_dot
    n, k = q.shape
    absmax = quant.absmax_f32(q).reshape(n, k // q.blocksize)
    return matmul_4bit_t_dequant_dot(dy, q.packed.reshape(n, k // 2), absmax, q.code,
                                     blocksize=q.blocksize)


def time_configs(out: list, ms, shapes, configs, baselines: bool = True) -> None:
    for k, n in shapes:
        copies, dense, qs = nf4_weight_copies(k, n)
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
            if baselines:  # `auto` and the variant it ran before the Mosaic kernel
                res["auto"] = us_per_product(
                    lambda xs, qs: [ops.qmatmul(a, q) for a, q in zip(xs, qs)], (xs, qs), copies)
                prev = previous_default(m)
                res[f"previous {prev}"] = us_per_product(
                    lambda xs, qs: [ops.qmatmul(a, q, backend="pallas", variant=prev)
                                    for a, q in zip(xs, qs)], (xs, qs), copies)
            time_configs_into(res, "mgpu", configs, lambda t: _config(t, (m, n, k)), _mgpu,
                              xs, qs, copies)
            record_row(res, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("check", "time", "check_t", "bwd"))
    ap.add_argument("--ms", default="128,2048,8192")
    ap.add_argument("--shapes", default=",".join(f"{k}:{n}" for k, n in SHAPES))
    ap.add_argument("--configs", default=None,
                    help="';'-separated configs (default: CONFIGS; for bwd, the backward default)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="time: only bf16 and the configs (not auto / the previous default)")
    a = ap.parse_args()
    out: list = []
    try:
        if a.part == "check":
            check(out)
        elif a.part == "check_t":
            check_t(out)
        elif a.part == "bwd":
            shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
            time_backward(out, [int(v) for v in a.ms.split(",")], shapes,
                          (a.configs or "default").split(";"))
        else:
            shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
            time_configs(out, [int(v) for v in a.ms.split(",")], shapes,
                         (a.configs or ";".join(CONFIGS)).split(";"),
                         baselines=not a.no_baselines)
    finally:
        write_rows(out, f"mgpu_probe_{a.part}.json")


if __name__ == "__main__":
    main()
