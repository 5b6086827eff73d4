"""The Hopper pair-table GEMV (`matmul_4bit_mgpu_gemv`) over configs, against the bf16 GEMV and
the Triton GEMV `auto` runs at M <= 2, same run; plus its correctness checks.

    python -m benchmarks.mgpu_gemv_probe check            # errors vs the fp32 reference
    python -m benchmarks.mgpu_gemv_probe check --extra interleave=1   # those fields on each case
    python -m benchmarks.mgpu_gemv_probe time --ms 1,2    # one JSON line per (shape, M)
        [--shapes 4096:4096,...] [--configs "default;k_splits=4;stages=3" or none] [--tag _b]
    python -m benchmarks.mgpu_gemv_probe time --ms 1,16 --configs default --mma-configs default
                                                          # with the MMA kernel (M <= 16)
    python -m benchmarks.mgpu_gemv_probe smem-base [--pad 62464]  # where the pair table starts

NF4 blocksize 64 with double quant, bf16 x; device time per product with the weight streamed
from HBM and distinct x per product (benchmarks/timing.py). Rows go to
$OUT/mgpu_gemv_probe_<part>.json.
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
from pallas_kernels.mosaic import matmul_4bit_mgpu_gemv as mg
from pallas_kernels.mosaic import matmul_4bit_mgpu_mma as mm
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv_reference

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
CONFIGS = ("default", "stages=3")


def _config(text: str, m: int, n: int, k: int) -> mg.GemvConfig:
    """"default" -> default_config; "k_splits=4,stages=3" -> the default with those fields
    (stages lowered until it fits shared memory, unless given)."""
    fields = {a: int(b) for a, b in (kv.split("=") for kv in text.split(",")
                                      if kv and kv != "default")}
    cfg = dataclasses.replace(mg.default_config(m, n, k, 64), **fields)
    while ("stages" not in fields and cfg.stages > 2
           and mg.smem_bytes(m, k, 64, cfg) > mg.SMEM_LIMIT):
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def _operands(q):
    n, k = q.shape
    return (q.packed.reshape(n, k // 2), q.absmax.reshape(n, k // q.blocksize), q.code,
            (q.nested_absmax, q.nested_code, q.offset))


def _gemv(x, q, cfg, out_dtype=None):
    packed, codes, code, nested = _operands(q)
    return mg.matmul_4bit_mgpu_gemv(x, packed, codes, code, blocksize=q.blocksize,
                                    nested=nested, config=cfg, out_dtype=out_dtype)


def smem_base(out: list, pad: int = 0) -> None:
    """The shared-window address of a kernel's first scratch buffer, where the GEMV's pair
    table sits (a one-prmt table address would need it 64 KiB-aligned: `word_ptx`); with `pad`,
    of a table after a pad of that many bytes (s20: a 62464-byte pad puts it at 65536)."""
    from pallas_kernels.mosaic.mgpu_pair_table import smem_address
    _, _, plgpu, _, arith, memref, _, _ = mg.mosaic_modules()
    from jax._src.lib.mlir import ir

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=None)
    def store_address(ctx, table_ref, out_ref):
        del ctx
        memref.store(smem_address(table_ref), out_ref,
                     [arith.constant(ir.IndexType.get(), 0)])

    def body(out_gmem, *, table_smem, scale_smem, pad_smem=None):
        del pad_smem
        store_address(table_smem, out_gmem)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(1,), grid_names=("x",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(**({"pad_smem": plgpu.SMEM((pad,), jnp.uint8)} if pad else {}),
                           table_smem=plgpu.SMEM((mg.TABLE_FLOATS,), jnp.float32),
                           scale_smem=plgpu.SMEM((2, 256), jnp.float32)))
    address = int(jax.jit(kernel)()[0])
    rec = dict(part="smem-base", pad=pad, table_address=address,
               aligned_64k=address % 65536 == 0)
    print(json.dumps(rec), flush=True)
    out.append(rec)


def check(out: list, extra: str = "") -> None:
    """fp32 outputs against the fp32 reference (the same sums in another order: ~1e-6), and
    the bf16 output against the Triton GEMV's. `extra`: config fields added to every case."""
    for (m, n, k, bs, qt, nested, dt, cfg_text) in (
            (1, 256, 512, 64, "nf4", True, jnp.bfloat16, "default"),
            (2, 512, 1024, 64, "fp4", False, jnp.float16, "default"),
            (1, 256, 1024, 128, "nf4", True, jnp.bfloat16, "k_splits=2"),
            (2, 256, 2048, 512, "nf4", True, jnp.bfloat16, "k_splits=4,stages=2"),
            (1, 4096, 4096, 64, "nf4", True, jnp.bfloat16, "default"),
            (2, 14336, 4096, 64, "nf4", True, jnp.bfloat16, "default"),
            (1, 4096, 14336, 64, "nf4", True, jnp.float16, "stages=3"),
            (2, 4096, 4096, 64, "fp4", True, jnp.bfloat16, "staged_scales=1"),
            (1, 512, 3584, 64, "nf4", True, jnp.bfloat16, "k_splits=2,staged_scales=1"),
            (1, 14336, 4096, 64, "nf4", True, jnp.float16, "wgs=4")):
        kx, kw = jax.random.split(jax.random.key(m + k + n))
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.05
        q = quant.quantize_4bit(w, qt, bs, nested)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dt)
        rec = dict(part="check", m=m, k=k, n=n, blocksize=bs, quant_type=qt, nested=nested,
                   dtype=jnp.dtype(dt).name, config=",".join(t for t in (cfg_text, extra) if t))
        try:
            cfg = _config(",".join(t for t in (cfg_text, extra) if t), m, n, k)
            packed, codes, code, nest = _operands(q)
            nest = nest if nested else None
            absmax = quant.absmax_f32(q).reshape(n, k // bs)
            got = jax.jit(lambda x: mg.matmul_4bit_mgpu_gemv(
                x, packed, codes if nested else absmax, code, blocksize=bs, nested=nest,
                config=cfg, out_dtype=jnp.float32))(x)
            ref = matmul_4bit_gemv_reference(x, packed, absmax, code, blocksize=bs,
                                             out_dtype=jnp.float32)
            rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            rec.update(rel_fp32_vs_ref=rel(got, ref), max_abs=float(jnp.max(jnp.abs(got - ref))),
                       finite=bool(jnp.all(jnp.isfinite(got))))
            y16 = jax.jit(lambda x: mg.matmul_4bit_mgpu_gemv(
                x, packed, codes if nested else absmax, code, blocksize=bs, nested=nest,
                config=cfg))(x)
            tri = ops.qmatmul(x, q, backend="pallas", variant="gemv_block_scaled")
            rec["rel_16bit_vs_triton_gemv"] = rel(y16.astype(jnp.float32), tri.astype(jnp.float32))
            rec["out_dtype"] = str(y16.dtype)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            rec["error"] = f"{type(e).__name__}: {str(e)[:3000]}"
        print(json.dumps(rec), flush=True)
        out.append(rec)


def _mma(x, q, cfg):
    packed, codes, code, nested = _operands(q)
    return mm.matmul_4bit_mgpu_mma(x, packed, codes, code, blocksize=q.blocksize, nested=nested,
                                   config=cfg)


def _mma_config(text: str, m: int, n: int, k: int) -> mm.MmaConfig:
    fields = {a: int(b) for a, b in (kv.split("=") for kv in text.split(",")
                                      if kv and kv != "default")}
    base = mm.default_config(m, n, k, 64, tile_k=fields.get("tile_k"))
    return dataclasses.replace(base, **fields)


def time_configs(out: list, ms, shapes, configs, mma_configs=()) -> None:
    """Per (shape, M): bf16, the kernel `auto` ran before this one at that M (the Triton GEMV
    at M <= 2, the wgmma kernel above), the GEMV's configs (M <= 2) and the MMA kernel's."""
    for k, n in shapes:
        copies, dense, qs = nf4_weight_copies(k, n)
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            res = dict(k=k, n=n, m=m, bf16=bf16_us(x, dense, k, n))
            for name in (("gemv_block_scaled",) if m <= 2 else ("mgpu_decoded_wgmma",)):
                res[f"pallas {name}"] = us_per_product(
                    lambda xs, qs, name=name: [ops.qmatmul(a, q, backend="pallas", variant=name)
                                               for a, q in zip(xs, qs)], (xs, qs), copies)
            if m <= mg.MAX_M:
                time_configs_into(res, "mgpu_gemv", configs, lambda t: _config(t, m, n, k),
                                  _gemv, xs, qs, copies)
            time_configs_into(res, "mgpu_mma", mma_configs, lambda t: _mma_config(t, m, n, k),
                              _mma, xs, qs, copies)
            record_row(res, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("check", "time", "smem-base"))
    ap.add_argument("--extra", default="", help="check: config fields added to every case")
    ap.add_argument("--pad", type=int, default=0, help="smem-base: also with this pad first")
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--shapes", default=",".join(f"{k}:{n}" for k, n in SHAPES))
    ap.add_argument("--configs", default=";".join(CONFIGS))
    ap.add_argument("--mma-configs", default="", help='MmaConfig texts, e.g. "default;stages=3"')
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name (several runs "
                                              "in one call)")
    a = ap.parse_args()
    out: list = []
    try:
        if a.part == "check":
            check(out, a.extra)
        elif a.part == "smem-base":
            smem_base(out)
            if a.pad:
                smem_base(out, a.pad)
        else:
            shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
            time_configs(out, [int(v) for v in a.ms.split(",")], shapes,
                         [t for t in a.configs.split(";") if t and t != "none"],
                         [t for t in a.mma_configs.split(";") if t])
    finally:
        write_rows(out, f"mgpu_gemv_probe_{a.part.replace('-', '_')}{a.tag}.json")


if __name__ == "__main__":
    main()
