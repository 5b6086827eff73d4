"""`mgpu_decoded_wgmma_t`: the backward product of the 4-bit layer on Hopper (Mosaic GPU),
dx = dy @ dequant(W), the
gradient `qmatmul` needs with respect to x, with the weight decoded per step as in
`mgpu_decoded_wgmma` but multiplied from shared memory.

In the forward kernel the decoded weight is the wgmma's register operand (its rows are the
product's rows). Here the weight's rows are the reduction dimension, and a register operand
holds rows of the output: a thread would need codes of two weight rows per register, with a
different scale for each. So each step decodes an (n_t, 64) tile of W exactly as the forward
does (per-row tables, `decode_fn`), stores it to shared memory in the swizzled layout wgmma
reads, and multiplies dy's (M_t, n_t) tile by it:

    acc (M_t, 64) += dy (M_t, n_t) . W (n_t, 64)

One compute warpgroup per CTA, which owns 64 output columns (one scale block at blocksize 64);
the memory warpgroup streams dy, W and the scales with TMA (the code table is loaded once per
tile into registers, `mgpu_decode.code_loader`). With 64 dy rows a CTA takes about 100 KB of
shared memory, which leaves room for two per SM, so one CTA's decode can run under the other's
MMA; with 128 dy rows and 128 weight rows a step (M > 64) its buffers take about 178 KB, one
CTA per SM, and it is still faster than 64 rows a step (docs/kernels.md). The output
is dx itself (no transpose); with several N splits XLA sums fp32 partials. Hopper only, no
interpret mode (as the forward kernel).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference.fourbit import (
    check_4bit_operands, check_x, matmul_4bit_t_reference, supports_4bit)
from pallas_kernels.mosaic.mgpu_decode import code_loader, codes_layout, decode_fn, mosaic_modules
from pallas_kernels.mosaic.mgpu_pipeline import (
    SMS, load_tile, sm_count, warp_specialized)
from pallas_kernels.registry import Variant

reference = matmul_4bit_t_reference


@dataclasses.dataclass(frozen=True)
class DecodedWgmmaTConfig:
    """Each CTA computes a (tile_m, 64) tile of dx over N / n_splits weight rows."""

    tile_m: int = 128  # dy rows per CTA (the wgmma M side: 64, 128, 192 or 256)
    tile_n: int = 64  # weight rows per pipeline step (the reduction; 64 or 128)
    n_splits: int = 1  # N ranges computed by separate CTAs; fp32 partials summed by XLA
    max_concurrent_steps: int = 4


def shape_problem(m, n, k, blocksize, cfg: DecodedWgmmaTConfig) -> str | None:
    if cfg.tile_m % 64 or not 64 <= cfg.tile_m <= 256:
        return f"tile_m must be 64, 128, 192 or 256 (the wgmma M side), got {cfg.tile_m}"
    if cfg.tile_n not in (64, 128):
        return f"tile_n must be 64 or 128, got {cfg.tile_n}"
    if blocksize < 64:
        return f"blocksize {blocksize} < 64 is not supported"
    if k % 64:
        return f"K ({k}) must be a multiple of 64"
    if cfg.n_splits < 1 or n % (cfg.tile_n * cfg.n_splits):
        return f"N ({n}) must be a multiple of tile_n * n_splits ({cfg.tile_n * cfg.n_splits})"
    return None


def default_config(m: int, n: int, k: int, blocksize: int) -> DecodedWgmmaTConfig:
    """dy rows per CTA: 64 or 128 (the smallest holding M up to 128), else 128; N splits until
    (M tiles x K / 64 column blocks x splits) is about one wave of CTAs, two per SM; 128 weight
    rows per step wherever each split's rows allow it."""
    tile_m = 64 if m <= 64 else 128
    base = -(-m // tile_m) * (k // 64)
    splits = 1
    while base * splits * 2 <= 2 * SMS and splits < 8 and n % (64 * splits * 2) == 0:
        splits *= 2
    # 128 weight rows per step, with or without N splits: chosen by measurement: docs/kernels.md
    tile_n = 128 if (n // splits) % 128 == 0 else 64
    return DecodedWgmmaTConfig(tile_m=tile_m, tile_n=tile_n, n_splits=splits)


def supports(m, n, k, blocksize):
    return (supports_4bit(m, n, k, blocksize) and m >= 1
            and shape_problem(m, n, k, blocksize, default_config(m, n, k, blocksize)) is None)


def mgpu_decoded_wgmma_t(dy, packed, absmax, code, *, blocksize: int, out_dtype=None,
                         interpret: bool = False, config: DecodedWgmmaTConfig | None = None):
    """dx = dy @ dequant(W) on a Hopper GPU. dy (M, N) bf16/f16; packed (N, K//2) uint8;
    absmax (N, K//blocksize) f32."""
    what = "mgpu_decoded_wgmma_t"
    if interpret:
        raise NotImplementedError(f"{what} has no interpret mode (Mosaic GPU, inline PTX); run "
                                  "matmul_4bit_t_reference or another variant on CPU")
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what=what)
    check_x(dy, n, what=what, name="dy")
    if dy.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: dy must be bfloat16 or float16, got {dy.dtype}")
    m = dy.shape[0]
    out_dtype = jnp.dtype(out_dtype or dy.dtype)
    if m == 0:
        return jnp.zeros((0, k), out_dtype)
    cfg = config or default_config(m, n, k, blocksize)
    problem = shape_problem(m, n, k, blocksize, cfg)
    if problem:
        raise ValueError(f"{what}: {problem}")
    w4 = lax.bitcast_convert_type(packed, jnp.int4).reshape(n, k)
    mp = -(-m // cfg.tile_m) * cfg.tile_m
    dyp = jnp.pad(dy, ((0, mp - m), (0, 0))) if mp != m else dy
    scales_t = jnp.asarray(absmax, jnp.float32).T  # (K / blocksize, N)
    dx = _call_t(dyp, w4, scales_t, jnp.asarray(code, jnp.float32), blocksize=blocksize, cfg=cfg)
    if cfg.n_splits > 1:
        dx = jnp.sum(dx, axis=0)
    return dx[:m].astype(out_dtype)


def _call_t(dy, w4, scales_t, code, *, blocksize: int, cfg: DecodedWgmmaTConfig):
    _, pl, plgpu, *_ = mosaic_modules()
    m, n = dy.shape
    k = w4.shape[1]
    dtype = dy.dtype
    tile_m, tile_n = cfg.tile_m, cfg.tile_n
    n_per = n // cfg.n_splits
    n_iters = n_per // tile_n
    m_iters, k_iters = m // tile_m, k // 64
    out_dtype = jnp.float32 if cfg.n_splits > 1 else dtype

    dy_sw = plgpu.find_swizzle(tile_n * 16)
    dy_transforms = (plgpu.TilingTransform((8, dy_sw // 2)), plgpu.SwizzleTransform(dy_sw))
    w_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(32))
    wd_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    out_sw = plgpu.find_swizzle(64 * out_bits)
    out_transforms = (plgpu.TilingTransform((8, out_sw * 8 // out_bits)),
                      plgpu.SwizzleTransform(out_sw))
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.RefType(), codes_layout(plgpu)),
        return_type=plgpu.ShapeDtypeStruct((tile_n, 64), dtype, layout=plgpu.Layout.WGMMA),
    )(decode_fn(dtype, 1, tile_n, blocksize))
    load_codes = code_loader(plgpu)

    pipeline, allocate = warp_specialized(
        plgpu, pl, grid=(n_iters,), num_compute_wgs=1, depth=cfg.max_concurrent_steps,
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_n), lambda i: (0, i), transforms=dy_transforms),
            plgpu.BlockSpec((tile_n, 64), lambda i: (i, 0), transforms=w_transforms),
            plgpu.BlockSpec((1, tile_n), lambda i: (0, i)),
        ])

    def matmul_4bit_mgpu_t_kernel(dy_gmem, w_gmem, s_gmem, code_gmem, out_gmem, wd_smem, out_smem):
        @functools.partial(pl.run_scoped, allocs=allocate(dy_gmem, w_gmem, s_gmem),
                           collective_axes="wg")
        def _scope(allocs):
            @plgpu.nd_loop((m_iters * k_iters * cfg.n_splits,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                split = lin % cfg.n_splits
                mk = lin // cfg.n_splits
                mi, ki = mk % m_iters, mk // m_iters
                m_sl = pl.ds(mi * tile_m, tile_m)
                k_sl = pl.ds(ki * 64, 64)
                n_sl = pl.ds(split * n_per, n_per)
                blk = (ki * 64) // blocksize

                def ctx(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_m, 64), jnp.float32))
                    def _acc(acc):
                        run((acc, load_codes(code_gmem)))  # the table rides in registers
                        res = acc[...].astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[...] = res
                        plgpu.commit_smem()
                        dst = out_gmem.at[split] if cfg.n_splits > 1 else out_gmem
                        plgpu.copy_smem_to_gmem(out_smem, dst.at[m_sl, k_sl])

                def body(_, dy_smem, w_smem, s_smem, carry):
                    acc, codes = carry
                    w = load_tile(plgpu, w_smem, slice(None), plgpu.Layout.WGMMA_UPCAST_4X)
                    wd_smem[...] = decode(w, s_smem, codes)
                    plgpu.commit_smem()  # the decoded tile is read by the async proxy (wgmma)
                    plgpu.wgmma(acc, dy_smem, wd_smem)
                    plgpu.wgmma_wait(0)
                    return acc, codes

                pipeline(body, ctx)(
                    dy_gmem.at[m_sl, n_sl], w_gmem.at[n_sl, k_sl],
                    s_gmem.at[pl.ds(blk, 1), n_sl], allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = sm_count()
    out_shape = (cfg.n_splits, m, k) if cfg.n_splits > 1 else (m, k)
    f = plgpu.kernel(
        matmul_4bit_mgpu_t_kernel,  # the name Nsight Compute shows
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(2 * num_sms,),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            wd_smem=plgpu.SMEM((tile_n, 64), dtype, transforms=wd_transforms),
            out_smem=plgpu.SMEM((tile_m, 64), out_dtype, transforms=out_transforms),
        ),
    )
    return f(dy, w4, scales_t, code)


VARIANTS = (
    Variant(
        name="mgpu_decoded_wgmma_t", op="matmul_4bit_t", fn=mgpu_decoded_wgmma_t,
        platform="sm90", interpret=False,
        reference=matmul_4bit_t_reference, supports=supports,
        description="Hopper Mosaic GPU backward: each (n_t, 64) weight tile decoded in registers "
                    "(per-row byte-plane tables), stored to shared memory, dx tile += dy . W by "
                    "wgmma",
        numerics="rounded_weight", status="default", config_type=DecodedWgmmaTConfig,
        default_config=default_config),
)
