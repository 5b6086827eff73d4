"""Grouped (mixture-of-experts) matmul on Hopper with the 4-bit expert stack decoded inside the
kernel: no dense expert stack is written or read.

`mgpu_grouped_dot_4bit`:   y[rows of e] = x[rows of e] @ dequant(W_e).T   (the forward)
`mgpu_grouped_dot_4bit_t`: y[rows of e] = dy[rows of e] @ dequant(W_e)    (the backward dx)

The schedule is the dense grouped kernel's (`reference.grouped_tiles`: each tile one expert's
rows inside one block of `block_m` rows, stored with a ladder of power-of-two TMA stores). Each
pipeline step decodes a (block_n, 64) tile of W_e from its packed codes and fp32 scales in
registers, with the per-row tables and byte-permute lookup of `mgpu_decode` (bit-exact with
bitsandbytes' dequantization rounded to x's dtype), stores it to shared memory and multiplies:

    forward:  acc (block_m, block_n) += x (block_m, 64) . W_tile (block_n, 64).T
    backward: acc (block_m, 64)      += dy (block_m, block_n) . W_tile (block_n, 64)

compute warpgroups fed by a TMA memory warpgroup (`mgpu_pipeline.warp_specialized`), as
`mgpu_decoded_wgmma_t` does for a dense layer. With two (the default where N and K are multiples of
256), a work item is one tile's rows against two weight tiles, one a warpgroup: x's tile is read
once for both, and one warpgroup decodes while the other's wgmma runs. Why here and not there: in a dense layer at
large M each weight tile is decoded once per 128-row block of x (16 times at M = 2048), which
costs more than one dequantization pass; in a mixture-of-experts layer each expert has about
M k / E rows (128 in a Qwen3-30B-A3B step), so each weight tile is decoded once or twice, and the
pass's write and read of the dense stack (0.75 GiB a product there) is what the kernel saves.
Hopper only, no interpret mode (the Triton `grouped_dot_4bit` is the interpretable 4-bit twin).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic.grouped_mgpu import store_tile_rows
from pallas_kernels.mosaic.mgpu_decode import code_loader, codes_layout, decode_fn, mosaic_modules
from pallas_kernels.mosaic.mgpu_pipeline import SMEM_LIMIT, load_tile, sm_count, warp_specialized
from pallas_kernels.reference.grouped import (
    check_grouped_4bit_operands,
    grouped_matmul_4bit_reference,
    grouped_matmul_4bit_t_reference,
    grouped_tiles,
    zero_rows_past_groups,
)
from pallas_kernels.registry import Variant

reference = grouped_matmul_4bit_reference
reference_t = grouped_matmul_4bit_t_reference


@dataclasses.dataclass(frozen=True)
class Grouped4bitConfig:
    """Tile shape and pipeline depth of the decoding grouped kernel."""

    block_m: int = 128  # rows of the sorted activation per tile (the wgmma M side: 64 or 128)
    block_n: int = 128  # weight rows per decoded tile: forward output columns, backward reduction (64 or 128)
    max_concurrent_steps: int = 3  # TMA pipeline depth
    compute_wgs: int = 1  # compute warpgroups a CTA, each its own weight tile against the shared x tile


def default_config(m: int, n: int, k: int, blocksize: int = 64) -> Grouped4bitConfig:
    """Two compute warpgroups where N and K are multiples of 256 and the scales cover 64 columns
    (each warpgroup decodes its own tile while the other's wgmma runs, and x's tile is read once
    for both: 0.27-0.35 ms against 0.39-0.45 with one, Qwen3-30B-A3B shapes on an H200,
    docs/kernels.md), else one."""
    del m
    return Grouped4bitConfig(compute_wgs=2 if _two_warpgroups(n, k, blocksize) else 1)


def smem_bytes(cfg: Grouped4bitConfig, *, forward: bool, out_itemsize: int, a_itemsize: int = 2) -> int:
    """Shared memory a CTA takes: the pipeline's buffers (x or dy, packed weights, scales) per
    step in flight, the decoded tiles and the output tiles (Mosaic adds its barriers)."""
    bm, bn, wgs = cfg.block_m, cfg.block_n, cfg.compute_wgs
    a_tile = bm * (64 if forward else bn) * a_itemsize
    step = a_tile + wgs * bn * 32 + wgs * bn * 4
    out_cols = bn if forward else 64
    return cfg.max_concurrent_steps * step + wgs * bn * 64 * a_itemsize + wgs * bm * out_cols * out_itemsize


def fitted(cfg: Grouped4bitConfig, *, forward: bool, out_itemsize: int) -> Grouped4bitConfig:
    """`cfg` with its pipeline no deeper than shared memory holds (two steps at least): a float32
    output doubles the output tiles."""
    depth = cfg.max_concurrent_steps
    while depth > 2 and smem_bytes(dataclasses.replace(cfg, max_concurrent_steps=depth), forward=forward,
                                   out_itemsize=out_itemsize) > SMEM_LIMIT:
        depth -= 1
    return dataclasses.replace(cfg, max_concurrent_steps=depth)


def shape_problem(m: int, n: int, k: int, blocksize: int, cfg: Grouped4bitConfig) -> str | None:
    """Why the kernel cannot take output columns `n` and contraction `k` with `cfg`, or None.
    Both must be multiples of block_n (the forward tiles N by block_n and K by 64, the backward
    the other way round); scale blocks of at least 64 columns (one per decoded 64-column tile)."""
    del m
    if cfg.block_m not in (64, 128) or cfg.block_n not in (64, 128) or cfg.compute_wgs not in (1, 2):
        return f"block_m and block_n must be 64 or 128, compute_wgs 1 or 2, got {cfg}"
    if blocksize < 64:
        return f"blocksize {blocksize} < 64 is not supported (one scale per decoded 64-column tile row)"
    if n % (cfg.block_n * cfg.compute_wgs) or k % (cfg.block_n * cfg.compute_wgs):
        return f"N={n} and K={k} must be multiples of block_n * compute_wgs = {cfg.block_n * cfg.compute_wgs}"
    if cfg.compute_wgs > 1 and blocksize != 64:
        return "two compute warpgroups take blocksize 64 only (each its own scale column in the backward)"
    return None


def _call(a, tiles, w4, scales_t, code, *, forward: bool, blocksize: int, cfg: Grouped4bitConfig,
          out_dtype):
    """The kernel: a (M, Kc) with M a multiple of block_m, tiles (3, T) int32, w4 (E, N, K)
    int4, scales_t (E, K / blocksize, N) f32, code (16,) f32. Returns (M, n_out), the rows no
    tile covers unwritten."""
    _, pl, plgpu, *_ = mosaic_modules()
    m = a.shape[0]
    e, n, k = w4.shape
    dtype = a.dtype
    bm, bn, wgs = cfg.block_m, cfg.block_n, cfg.compute_wgs
    num_tiles = tiles.shape[1]
    n_out, out_cols, steps = (n, bn, k // 64) if forward else (k, 64, n // bn)
    grid_c = n_out // (out_cols * wgs)  # a work item: one tile's rows x wgs column blocks
    a_cols = 64 if forward else bn
    a_sw = plgpu.find_swizzle(a_cols * 16)
    a_transforms = (plgpu.TilingTransform((8, a_sw // 2)), plgpu.SwizzleTransform(a_sw))
    w_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(32))
    wd_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.RefType(), codes_layout(plgpu)),
        return_type=plgpu.ShapeDtypeStruct((bn, 64), dtype, layout=plgpu.Layout.WGMMA),
    )(decode_fn(dtype, 1, bn, blocksize))
    load_codes = code_loader(plgpu)
    per_scale = blocksize // 64  # 64-column steps under one scale column

    if forward:  # steps walk K: x's columns, the weight tiles' columns and the scale column
        in_specs = [
            plgpu.BlockSpec((bm, 64), lambda s: (0, s), transforms=a_transforms),
            plgpu.BlockSpec((wgs * bn, 64), lambda s: (0, s), transforms=w_transforms),
            plgpu.BlockSpec((1, wgs * bn), lambda s: (lax.div(s, per_scale), 0)),
        ]
    else:  # steps walk N: dy's columns, the weight tiles' rows and their scales (a row each per warpgroup)
        in_specs = [
            plgpu.BlockSpec((bm, bn), lambda s: (0, s), transforms=a_transforms),
            plgpu.BlockSpec((bn, wgs * 64), lambda s: (s, 0), transforms=w_transforms),
            plgpu.BlockSpec((wgs, bn), lambda s: (0, s)),
        ]
    pipeline, allocate = warp_specialized(plgpu, pl, grid=(steps,), in_specs=in_specs, num_compute_wgs=wgs,
                                          depth=cfg.max_concurrent_steps)

    def grouped_4bit_kernel(tiles_gmem, a_gmem, w_gmem, s_gmem, code_gmem, out_gmem, wd_smem, out_smem):
        @functools.partial(pl.run_scoped, allocs=allocate(a_gmem, w_gmem.at[0], s_gmem.at[0]),
                           collective_axes="wg")
        def _scope(allocs):
            @plgpu.nd_loop((num_tiles * grid_c,), collective_axes="sm")
            def _work(info):
                (lin,) = info.index
                ti, ci = lin // grid_c, lin % grid_c
                group = tiles_gmem[0, ti]
                lo = tiles_gmem[1, ti]
                hi = tiles_gmem[2, ti]
                block_start = lax.div(lo, jnp.int32(bm)) * bm
                rows_in = a_gmem.at[pl.ds(block_start, bm)]
                if forward:
                    w_in = w_gmem.at[group, pl.ds(ci * wgs * bn, wgs * bn)]
                    s_in = s_gmem.at[group, pl.ds(0, k // blocksize), pl.ds(ci * wgs * bn, wgs * bn)]
                else:  # (wgs > 1 takes blocksize 64: warpgroup w's columns have scale column ci * wgs + w)
                    w_in = w_gmem.at[group, pl.ds(0, n), pl.ds(ci * wgs * 64, wgs * 64)]
                    s_in = s_gmem.at[group, pl.ds(lax.div(ci * wgs, per_scale), wgs), pl.ds(0, n)]
                wg = lax.axis_index("wg") if wgs > 1 else 0
                col0 = (ci * wgs + wg) * out_cols  # this warpgroup's first output column

                def ctx(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, out_cols), jnp.float32))
                    def _acc(acc):
                        run((acc, load_codes(code_gmem)))  # the code table rides in registers
                        res = acc[...].astype(out_smem.dtype)
                        out = out_smem.at[wg]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read it
                        out[...] = res
                        plgpu.commit_smem()
                        store_tile_rows(out, out_gmem, pl.ds(col0, out_cols), lo=lo, hi=hi,
                                        block_start=block_start, max_rows=min(bm, m))

                def body(_, a_smem, w_smem, s_smem, carry):
                    acc, codes = carry
                    if forward:  # this warpgroup's weight rows and their scales
                        w_own, s_own = w_smem.at[pl.ds(wg * bn, bn)], s_smem.at[:, pl.ds(wg * bn, bn)]
                    else:  # its 64 weight columns and their scale column
                        w_own, s_own = w_smem.at[:, pl.ds(wg * 64, 64)], s_smem.at[pl.ds(wg, 1)]
                    wd = wd_smem.at[wg]
                    w = load_tile(plgpu, w_own if wgs > 1 else w_smem, slice(None), plgpu.Layout.WGMMA_UPCAST_4X)
                    wd[...] = decode(w, s_own if wgs > 1 else s_smem, codes)
                    plgpu.commit_smem()  # the decoded tile is read by the async proxy (wgmma)
                    if forward:
                        plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(wd, (1, 0)))
                    else:
                        plgpu.wgmma(acc, a_smem, wd)
                    plgpu.wgmma_wait(0)
                    return acc, codes

                pipeline(body, ctx)(rows_in, w_in, s_in, allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(
        grouped_4bit_kernel,  # the name Nsight Compute shows
        out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=((2 if wgs == 1 else 1) * sm_count(),),
        grid_names=("sm",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            wd_smem=plgpu.SMEM((wgs, bn, 64), dtype, transforms=wd_transforms),
            out_smem=plgpu.SMEM((wgs, bm, out_cols), out_dtype),
        ),
    )
    return f(tiles, a, w4, scales_t, code)


def _grouped_4bit(a, group_sizes, packed, absmax, code, *, blocksize: int, forward: bool, out_dtype,
                  interpret: bool, config, what: str):
    if interpret:
        raise NotImplementedError(f"{what} has no interpret mode (Mosaic GPU, inline PTX); run the Triton "
                                  "grouped_dot_4bit variants or the reference on CPU")
    e, n, k = check_grouped_4bit_operands(a, group_sizes, packed, absmax, code, blocksize,
                                          transpose_w=forward, what=what)
    if a.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: `x` must be bfloat16 or float16 (the wgmma operand), got {a.dtype}")
    m = a.shape[0]
    n_out = n if forward else k
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if m == 0:
        return jnp.zeros((0, n_out), out_dtype)
    cfg = fitted(config or default_config(m, n, k, blocksize), forward=forward, out_itemsize=out_dtype.itemsize)
    problem = shape_problem(m, n_out, k if forward else n, blocksize, cfg)
    if problem:
        raise ValueError(f"{what}: {problem}")
    tiles = grouped_tiles(group_sizes, m, cfg.block_m)
    mp = -(-m // cfg.block_m) * cfg.block_m  # whole row blocks for the TMA loads of each tile
    ap = jnp.pad(a, ((0, mp - m), (0, 0))) if mp != m else a
    w4 = lax.bitcast_convert_type(packed, jnp.int4).reshape(e, n, k)
    scales_t = jnp.swapaxes(jnp.asarray(absmax, jnp.float32), 1, 2)  # (E, K / blocksize, N)
    y = _call(ap, tiles, w4, scales_t, jnp.asarray(code, jnp.float32), forward=forward, blocksize=blocksize,
              cfg=cfg, out_dtype=out_dtype)
    return zero_rows_past_groups(y[:m] if mp != m else y, group_sizes)


def mgpu_grouped_dot_4bit(x, group_sizes, packed, absmax, code, *, blocksize: int, out_dtype=None,
                          interpret: bool = False, config: Grouped4bitConfig | None = None):
    """y[rows of e] = x[rows of e] @ dequant(W_e).T on a Hopper GPU: x (M, K) bf16/f16, packed
    (E, N, K//2) uint8, absmax (E, N, K//blocksize) f32, code (16,)."""
    return _grouped_4bit(x, group_sizes, packed, absmax, code, blocksize=blocksize, forward=True,
                         out_dtype=out_dtype, interpret=interpret, config=config, what="mgpu_grouped_dot_4bit")


def mgpu_grouped_dot_4bit_t(dy, group_sizes, packed, absmax, code, *, blocksize: int, out_dtype=None,
                            interpret: bool = False, config: Grouped4bitConfig | None = None):
    """y[rows of e] = dy[rows of e] @ dequant(W_e) on a Hopper GPU: dy (M, N) bf16/f16."""
    return _grouped_4bit(dy, group_sizes, packed, absmax, code, blocksize=blocksize, forward=False,
                         out_dtype=out_dtype, interpret=interpret, config=config, what="mgpu_grouped_dot_4bit_t")


def _two_warpgroups(n: int, k: int, blocksize: int) -> bool:
    return n % 256 == 0 and k % 256 == 0 and blocksize == 64


def supports(m, n, k, blocksize=64):
    """Forward (M, N, K) shapes `auto` gives the kernel: those it runs with two warpgroups (N and
    K multiples of 256, blocksize 64), where it measured faster than the dequantization pass
    and `mgpu_grouped_dot`; with one warpgroup it was slower (docs/kernels.md). Called directly
    it also takes N and K multiples of 128 and any blocksize of 64 or more."""
    return m >= 1 and _two_warpgroups(n, k, blocksize)


def supports_t(m, n, k, blocksize=64):
    """Backward (dx = dy @ W_e, output K columns, contraction over N): the same shapes."""
    return m >= 1 and _two_warpgroups(n, k, blocksize)


VARIANTS = (
    Variant(
        name="mgpu_grouped_dot_4bit", op="grouped_matmul_4bit", fn=mgpu_grouped_dot_4bit, platform="sm90",
        interpret=False, reference=grouped_matmul_4bit_reference, supports=supports,
        description="Hopper Mosaic GPU grouped matmul decoding the 4-bit experts in the kernel: each "
                    "(128 x 64) weight tile decoded in registers, stored to shared memory, x . W^T by wgmma; "
                    "two compute warpgroups share x's tile",
        numerics="rounded_weight", status="default", config_type=Grouped4bitConfig,
        default_config=default_config),
    Variant(
        name="mgpu_grouped_dot_4bit_t", op="grouped_matmul_4bit_t", fn=mgpu_grouped_dot_4bit_t, platform="sm90",
        interpret=False, reference=grouped_matmul_4bit_t_reference, supports=supports_t,
        description="the backward dx = dy @ dequant(W_e) of mgpu_grouped_dot_4bit, tiles decoded in the kernel",
        numerics="rounded_weight", status="default", config_type=Grouped4bitConfig,
        default_config=default_config),
)
