"""How fast the Hopper pair-table kernels' TMA pipeline streams the packed weight with (almost)
no compute: the question session 18 left open.

Both pair-table kernels (`matmul_4bit_mgpu_gemv`, `matmul_4bit_mgpu_mma`) take about 2.5 us
per 32 KiB weight step per SM at the large protocol shapes, whatever their decode costs (H100,
s18). This probe runs the same warp-specialized pipeline (`mgpu_pipeline.warp_specialized`,
a memory warpgroup streaming (rows, tile_k / 256, 128)-byte tiles by TMA, two compute
warpgroups, the same K splits) with a step that only reads the tile: `--read word` one 16-byte
load per thread (the barrier wait and nothing else), `--read all` every byte of the tile once
(128 bytes a thread). If it streams at about the kernels' rate, the pipeline is the limit
(stages, tile shape, one CTA per SM); if it streams near the copy bandwidth, their compute is.
Answer (H200, s19-1): 3.3 TB/s at 4096x14336 and 14336x4096 with 2 stages of 256 rows, about
twice the kernels; more stages, 128-row tiles and two CTAs an SM were no faster.

    python -m benchmarks.mgpu_stream_probe --stages 2,3,4 --rows 256,128 --read word,all

One JSON row per (shape, config) to stdout and $OUT/mgpu_stream_probe.json: us per call, the
packed bytes per second, and the kernels' own times from the same run for comparison.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.mosaic.mgpu_decode import mosaic_modules
from pallas_kernels.mosaic.mgpu_pair_table import LOAD_V4_PTX, asm, smem_address
from pallas_kernels.mosaic.mgpu_pipeline import SMS, sm_count, warp_specialized

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
STEP_BYTES = 32 * 1024  # a weight tile, as in both kernels


def default_splits(n_tiles: int, k_iters: int, ctas: int = 1) -> int:
    """The kernels' rule: the most K splits dividing the steps with the CTAs within one wave
    (of `ctas` CTAs per SM)."""
    splits = 1
    for d in range(1, k_iters + 1):
        if k_iters % d == 0 and n_tiles * d <= SMS * ctas:
            splits = d
    return splits


def stream(packed, *, rows: int, stages: int, read: str, splits: int | None = None,
           ctas: int = 1):
    """Stream packed (N, K / 2) uint8 through the pipeline in (rows, 32 KiB / rows) tiles; each
    compute thread xors what it reads into one word, stored per thread: (CTAs' tiles, 256).
    `ctas`: CTAs launched per SM (the kernels run one: their 64 KiB table leaves no room for a
    second); with 2, two independent pipelines share an SM where shared memory allows."""
    _, pl, plgpu, ir, arith, _, fa, mu = mosaic_modules()
    from jax._src.lib.mlir.dialects import vector

    n, half_k = packed.shape
    row_bytes = STEP_BYTES // rows
    chunks = row_bytes // 128
    k_iters = half_k // row_bytes
    n_tiles = n // rows
    splits = splits or default_splits(n_tiles, k_iters, ctas)
    per = k_iters // splits
    shape = (128,)
    layout = fa.WGStridedFragLayout(shape, 1)
    acc_arg = plgpu.Layout.WG_STRIDED(shape, vec_size=1)
    acc_type = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=acc_arg)
    i32 = lambda: ir.IntegerType.get_signless(32)  # inside the kernel's MLIR context
    loads = 1 if read == "word" else STEP_BYTES // (256 * 16)

    def zeros(ctx):
        del ctx
        return fa.FragmentedArray.splat(arith.constant(ir.F32Type.get(), 0.0), shape, layout)

    def step(ctx, w_ref, acc):
        del ctx
        tid = mu.thread_idx()  # 0..255 over both compute warpgroups
        base = arith.addi(smem_address(w_ref), arith.muli(tid, arith.constant(i32(), 16)))
        (vec,) = acc.registers.flat
        word = arith.bitcast(i32(), vector.extract(vec, [], [0]))
        for j in range(loads):  # thread t reads bytes 16 t + 4096 j: a warp 512 contiguous
            addr = arith.addi(base, arith.constant(i32(), 4096 * j))
            for w in asm(LOAD_V4_PTX, [addr], "rrrr", side_effects=True):
                word = arith.xori(word, w)
        new = vector.from_elements(ir.VectorType.get((1,), ir.F32Type.get()),
                                   [arith.bitcast(ir.F32Type.get(), word)])
        return fa.FragmentedArray(_registers=np.asarray([new], dtype=object), _layout=layout,
                                  _is_signed=None)

    def finish(ctx, acc, out_ref):
        del ctx
        from jax._src.lib.mlir.dialects import memref
        (vec,) = acc.registers.flat
        tid = arith.remui(mu.thread_idx(), arith.constant(i32(), 128))
        memref.store(vector.extract(vec, [], [0]), out_ref,
                     [arith.index_cast(ir.IndexType.get(), tid)])

    ref = plgpu.RefType()
    f_zeros = plgpu.inline_mgpu(arg_types=(), return_type=acc_type)(zeros)
    f_step = plgpu.inline_mgpu(arg_types=(ref, acc_arg), return_type=acc_type)(step)
    f_finish = plgpu.inline_mgpu(arg_types=(acc_arg, ref), return_type=None)(finish)
    pipeline, allocate = warp_specialized(
        plgpu, pl, grid=(per,), num_compute_wgs=2, depth=stages,
        in_specs=[plgpu.BlockSpec((rows, chunks, 128), lambda kk: (0, kk, 0))])

    def mgpu_stream_probe_kernel(w_gmem, out_gmem):
        @functools.partial(pl.run_scoped, allocs=allocate(w_gmem), collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_tiles * splits,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                split, ni = lin % splits, lin // splits

                def ctx(run):
                    f_finish(run(f_zeros()), out_gmem.at[lin, pl.ds(wg * 128, 128)])

                def body(indices, w_smem, acc):
                    del indices
                    return f_step(w_smem, acc)

                pipeline(body, ctx)(
                    w_gmem.at[pl.ds(ni * rows, rows), pl.ds(split * per * chunks, per * chunks)],
                    allocations=allocs)

    kernel = plgpu.kernel(
        mgpu_stream_probe_kernel,
        out_type=jax.ShapeDtypeStruct((n_tiles * splits, 256), jnp.float32),
        grid=(sm_count() * ctas,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(packed.reshape(n, half_k // 128, 128))


def main():
    import json

    from benchmarks.sweep_setup import bf16_us, nf4_weight_copies, write_rows
    from benchmarks.timing import distinct_copies, us_per_product
    from jqlora import ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--rows", default="256,128")
    ap.add_argument("--read", default="word,all")
    ap.add_argument("--ctas", default="1", help="CTAs per SM, e.g. 1,2")
    ap.add_argument("--shapes", default=",".join(f"{k}:{n}" for k, n in SHAPES))
    a = ap.parse_args()
    out = []
    try:
        for spec in a.shapes.split(","):
            k, n = (int(v) for v in spec.split(":"))
            copies, dense, qs = nf4_weight_copies(k, n)
            packed = [q.packed.reshape(n, k // 2) for q in qs]
            x = jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            bytes_moved = n * k // 2
            base = dict(k=k, n=n, packed_mb=bytes_moved / 1e6, bf16_m1=bf16_us(x, dense, k, n))
            for name in ("mgpu_gemv_pair_table", "mgpu_mma_pair_table"):
                base[f"{name} M=1"] = us_per_product(
                    lambda xs, qs, name=name: [ops.qmatmul(v, q, backend="pallas", variant=name)
                                               for v, q in zip(xs, qs)], (xs, qs), copies)
            for stages, rows, read, ctas in itertools.product(
                    [int(v) for v in a.stages.split(",")], [int(v) for v in a.rows.split(",")],
                    a.read.split(","), [int(v) for v in a.ctas.split(",")]):
                us = us_per_product(
                    lambda ps, stages=stages, rows=rows, read=read, ctas=ctas: [
                        stream(p, rows=rows, stages=stages, read=read, ctas=ctas) for p in ps],
                    (packed,), copies)
                row = dict(base, stages=stages, rows=rows, read=read, ctas=ctas, us=us)
                if isinstance(us, float):
                    row["packed_tb_s"] = bytes_moved / us / 1e6
                print(json.dumps(row), flush=True)
                out.append(row)
    finally:
        write_rows(out, "mgpu_stream_probe.json")


if __name__ == "__main__":
    main()
