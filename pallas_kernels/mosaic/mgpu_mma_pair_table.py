"""`mgpu_mma_pair_table`: 4-bit product for small M (<= 64) on Hopper (Mosaic GPU),
y = x @ dequant(W).T, each packed byte decoded by one shared-memory load straight into a
tensor-core operand (mma.sync m16n8k16).

Why: the pair-table GEMV (`mgpu_gemv_pair_table`) spends two fp32 fma per weight and the wgmma
kernel (`mgpu_decoded_wgmma`) decodes with byte permutes; both are issue-bound at small M. Here a
byte's two codes come as one 32-bit word of two 16-bit codes, (code[hi], code[lo]) in x's dtype,
from a 256-entry pair table replicated per lane (entry b of lane l at byte 256 b + 4 l:
conflict-free whatever the bytes), and that word *is* one register of the A fragment of an
m16n8k16 MMA: the multiply-adds run on the tensor core. Per byte: prmt, add, one load; the scale
is applied to each 64-column group's fp32 MMA result (one fma per output), so the table holds
the bare codes.

Numerics: the codes are rounded to x's dtype (bf16: relative error <= 2^-8 per code), the
products and sums are the tensor core's fp32, and absmax multiplies each 64-column group's
sum in fp32. bitsandbytes instead rounds code * absmax to x's dtype (the same size of error, not
the same bits). Oracle: `matmul_4bit_mma_reference` (codes rounded the same way).

Layout: a CTA takes 256 weight rows (two compute warpgroups, four warps each, 32 rows a warp:
two m16 tiles) of one K split; a memory warpgroup streams (256 rows x 128 bytes) weight tiles
and (M x 256) x tiles with TMA. The MMA's K order is permuted within each 64-column group so
that lane (g, t) of a warp loads 8 contiguous bytes of its rows g and g + 8: k16 step s of group
q takes weight columns 64 q + 16 t + 4 s + (0, 1) and (2, 3); the x fragment follows the same
order, and up to eight n8 tiles of tokens share the A fragments of each lookup. The weight tile
has the 128-byte swizzle and MMA row g reads tile row 2 (g % 4) + g // 4, so a half-warp's
8-byte loads cover all 32 banks; lanes of odd g read the second half of their x piece first
(`x_swap`). `mgpu_mma_layout` holds this geometry (`MmaPairTableConfig`) and address arithmetic
in numpy for the CPU tests; `mgpu_mma_pieces` the PTX programs and the Mosaic pieces.

Scales: the four lanes of a quad hold the same rows, so each loads and de-nests the scales of
one group in four and shuffles share them; the double-quant code table is read from shared
memory. With 512-column steps the two warpgroups share 128 rows, each half of the columns, and
sum their partials in the CTA (`wg_reduce`): where that needs no K split the kernel stores y
and the call is one kernel. Otherwise XLA sums the K splits' fp32 partials. K splits need not
divide the steps: the last split's window moves back to end at K and skips (`lax.cond`) the
steps the split before it took (`mgpu_pipeline.split_windows`); those are still loaded.

Hopper only (sm_90, TMA, inline PTX), no interpret mode. CPU checks: `emulate` (the same
groups and order in float64 sums) against the reference, the lookup program in the tests' PTX
interpreter, and CUDA lowering. Evidence for each choice: docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.reference.fourbit import supports_4bit
from pallas_kernels.mosaic.mgpu_decode import mosaic_modules
from pallas_kernels.mosaic.mgpu_mma_layout import (
    GROUP, TABLE_BYTES, TILE_KS, MmaPairTableConfig, acc_count, mma_columns, smem_bytes)
from pallas_kernels.mosaic.mgpu_mma_pieces import pieces, swizzled_tile_transforms
from pallas_kernels.mosaic.mgpu_pair_table import pair_table_product
from pallas_kernels.mosaic.mgpu_pipeline import (
    FOUR_WG_REGISTERS, SMEM_LIMIT, SMS, compute_registers_held, grid_fills, sm_count,
    split_steps, split_windows, traced_window, uneven_splits_problem, warp_specialized,
    window_blocks_problem)
from pallas_kernels.registry import Variant

MAX_M = 64  # eight n8 tiles of tokens
def default_config(m: int, n: int, k: int, blocksize: int,
                   tile_k: int | None = None) -> MmaPairTableConfig:
    """K splits: the most that divide the K steps, keep whole scale blocks and the CTAs within
    one wave of SMs (the GEMV's rule), or, where that leaves a CTA more steps to run, splits
    that do not divide them (`split_windows`). The swizzle where tile_k allows it; x_swap where
    x has two tokens (with one, all lanes read the same row: no conflict to avoid).

    tile_k (None: chosen): 512 where 128-row tiles fill at least as many SMs in one wave
    without a K split as 256-row tiles do with theirs. Its two warpgroups' partials are then
    summed in the CTA (`wg_reduce`) and y is stored by the kernel: no XLA sum of K-split
    partials, a kernel of its own. 256-row tiles' splits may be uneven: 4096x11008 (K x N)
    takes 3 of them, 129 CTAs. Chosen by measurement: docs/kernels.md"""
    if tile_k is None:
        base = default_config(m, n, k, blocksize, 256)
        wide = default_config(m, n, k, blocksize, 512)
        if (n % 256 == 0 and wide.k_splits == 1 and n // wide.cta_rows <= SMS
                and n // wide.cta_rows >= (n // base.cta_rows) * base.k_splits
                and shape_problem(m, n, k, blocksize, wide) is None):
            return wide
        return base
    cfg = MmaPairTableConfig(tile_k=tile_k, swizzle=tile_k in (256, 512), x_swap=m > 1,
                             wg_reduce=tile_k > 256)
    n_tiles, k_iters = n // cfg.cta_rows, k // tile_k
    splits = 1
    for d in range(1, k_iters + 1):
        if k_iters % d == 0 and n_tiles * d <= SMS and (k // d) % blocksize == 0:
            splits = d
    # splits that do not divide the steps, where they shorten a CTA's run of steps: the
    # fewest splits of the shortest run (K = 11008, 43 steps: 8 of 6 steps, not 1 of 43)
    for d in range(splits + 1, min(k_iters, SMS // max(n_tiles, 1)) + 1):
        run = split_steps(k_iters, d)
        uneven = dataclasses.replace(cfg, k_splits=-(-k_iters // run))
        if (run < split_steps(k_iters, splits)
                and shape_problem(m, n, k, blocksize, uneven) is None):
            splits = uneven.k_splits
    return dataclasses.replace(cfg, k_splits=splits)


def shape_problem(m: int, n: int, k: int, blocksize: int, cfg: MmaPairTableConfig) -> str | None:
    if not 1 <= m <= MAX_M:
        return f"M ({m}) must be 1..{MAX_M}"
    if cfg.tile_k not in TILE_KS:
        return f"tile_k must be one of {TILE_KS}, got {cfg.tile_k}"
    if cfg.compute_wgs not in (2, 4):
        return f"compute_wgs must be 2 or 4, got {cfg.compute_wgs}"
    if cfg.compute_wgs == 4 and cfg.tile_k != 256:
        return f"compute_wgs = 4 needs tile_k = 256, got {cfg.tile_k}"
    if n % cfg.cta_rows:
        return f"N ({n}) must be a multiple of {cfg.cta_rows}"
    if k % cfg.tile_k:
        return f"K ({k}) must be a multiple of tile_k ({cfg.tile_k})"
    problem = uneven_splits_problem(k // cfg.tile_k, cfg.k_splits)
    if problem:
        return problem
    if blocksize % GROUP:
        return f"blocksize ({blocksize}) must be a multiple of {GROUP} (one scale a group)"
    if cfg.wg_cols % blocksize and blocksize % cfg.wg_cols:
        return f"blocksize ({blocksize}) and {cfg.wg_cols} columns must divide one another"
    problem = window_blocks_problem(k // cfg.tile_k, cfg.k_splits, cfg.tile_k, blocksize)
    if problem:
        return problem
    if not 2 <= cfg.stages <= 4:
        return f"stages must be 2..4, got {cfg.stages}"
    if cfg.swizzle and cfg.tile_k not in (256, 512):
        return (f"swizzle needs tile_k = 256 or 512 (one 128-byte swizzle row a warpgroup's "
                f"tile row), got {cfg.tile_k}")
    if cfg.wg_reduce and not cfg.col_split:
        return f"wg_reduce needs tile_k > 256 (warpgroups sharing rows), got {cfg.tile_k}"
    if smem_bytes(m, cfg) > SMEM_LIMIT:
        return f"{cfg} needs {smem_bytes(m, cfg)} bytes of shared memory, more than {SMEM_LIMIT}"
    return None


def supports(m: int, n: int, k: int, blocksize: int) -> bool:
    """Shapes the default config takes and whose grid fills the GPU (`grid_fills`)."""
    if not supports_4bit(m, n, k, blocksize):
        return False
    cfg = default_config(m, n, k, blocksize)
    return (shape_problem(m, n, k, blocksize, cfg) is None
            and grid_fills(n // cfg.cta_rows, k // cfg.tile_k, cfg.k_splits))


# --------------------------------------------------------------------------- reference, emulation
def matmul_4bit_mma_reference(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                              interpret: bool = False):
    """The kernel's numerics in jnp: codes rounded to x's dtype, fp32 sums per 64-column group
    times the group's absmax, fp32 total. x (M, K); absmax (N, K // blocksize) f32."""
    del interpret
    m, k = x.shape
    n = packed.shape[0]
    code_x = jnp.asarray(code, jnp.float32).astype(x.dtype).astype(jnp.float32)
    p = jnp.asarray(packed, jnp.uint8)
    w = jnp.stack([code_x[p >> 4], code_x[p & 15]], axis=-1).reshape(n, k // GROUP, GROUP)
    sums = jnp.einsum("mgc,ngc->mng", x.astype(jnp.float32).reshape(m, k // GROUP, GROUP), w,
                      precision=lax.Precision.HIGHEST)
    scale = jnp.repeat(jnp.asarray(absmax, jnp.float32).reshape(n, k // blocksize),
                       blocksize // GROUP, axis=1)
    y = jnp.sum(sums * scale[None], axis=-1)
    return y.astype(out_dtype or x.dtype)


reference = matmul_4bit_mma_reference


def emulate(x, packed, absmax, code, *, blocksize: int,
            cfg: MmaPairTableConfig = MmaPairTableConfig()):
    """The kernel's sums in numpy: per row, K split and 64-column group, the group's products
    (codes rounded to x's dtype) summed in float64 over the MMA's permuted column order (the
    tensor core's fp32 sum order is its own), rounded to f32, times absmax and added to the
    row's f32 total by one fma; splits (their own steps, `split_windows`) summed last. x (M, K)
    in its 16-bit dtype."""
    xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    code_x = np.asarray(jnp.asarray(code, jnp.float32).astype(jnp.asarray(x).dtype)
                        .astype(jnp.float32), np.float64)
    p = np.asarray(packed, np.uint8)
    absmax = np.asarray(absmax, np.float32)
    m, k = xf.shape
    n = p.shape[0]
    w = np.stack([code_x[p >> 4], code_x[p & 15]], axis=-1).reshape(n, k)
    order = np.asarray([c for s in range(4) for t in range(4) for c in mma_columns(t, s)])
    parts = []
    for _, own, end in split_windows(k // cfg.tile_k, cfg.k_splits):
        total = np.zeros((m, n), np.float32)
        for g0 in range(own * cfg.tile_k, end * cfg.tile_k, GROUP):
            cols = g0 + order
            group_sum = (xf[:, cols] @ w[:, cols].T).astype(np.float32)
            scale = absmax[:, g0 // blocksize][None]
            total = (group_sum.astype(np.float64) * scale + total).astype(np.float32)
        parts.append(total)
    return np.sum(np.stack(parts), axis=0, dtype=np.float32)


def _call(x, packed, scales, code, nest, *, blocksize: int, cfg: MmaPairTableConfig, out_dtype):
    _, pl, plgpu, *_ = mosaic_modules()
    m, k = x.shape
    n = packed.shape[0]
    splits, tile_k, cta_rows, wg_rows, wg_cols = (
        cfg.k_splits, cfg.tile_k, cfg.cta_rows, cfg.wg_rows, cfg.wg_cols)
    k_iters = k // tile_k
    steps = split_steps(k_iters, splits)  # a K split's window of steps
    uneven = steps * splits != k_iters  # the last window moved back, its first steps skipped
    k_per = steps * tile_k
    n_tiles = n // cta_rows
    split_cols = k_per // blocksize
    step_cols = max(1, wg_cols // blocksize)  # scale columns of a warpgroup's part of a step
    out_dtype = jnp.float32 if cfg.partials > 1 else out_dtype
    smem_code = nest is not None and cfg.nested_code_smem
    f = pieces(plgpu, m, x.dtype, blocksize, k // blocksize, nest is not None, cfg, smem_code)
    # TMA boxes take <= 256 elements a dimension: rows of 256-column chunks (128 bytes of
    # weight, 256 values of x), a step's chunks side by side (the same bytes as (rows, tile_k))
    chunks, chunk_k = tile_k // 256, k_per // 256
    if cfg.swizzle:  # (rows, 128 bytes) tiles, 8-row tiles of 128 bytes: row-major bytes;
        # a step's chunks are separate buffers (one a warpgroup with tile_k = 512)
        w_view = packed
        w_specs = [plgpu.BlockSpec((cta_rows, 128), lambda kk, j=j: (0, kk * chunks + j),
                                   transforms=swizzled_tile_transforms(plgpu))
                   for j in range(chunks)]
    else:
        w_view = packed.reshape(n, k // 256, 128)
        w_specs = [plgpu.BlockSpec((cta_rows, chunks, 128), lambda kk: (0, kk, 0))]
    pipeline, allocate = warp_specialized(
        plgpu, pl, grid=(steps,), num_compute_wgs=cfg.compute_wgs, depth=cfg.stages,
        in_specs=[*w_specs, plgpu.BlockSpec((m, chunks, 256), lambda kk: (0, kk, 0))])

    def matmul_4bit_mgpu_mma_kernel(x_gmem, w_gmem, s_gmem, code_gmem, *rest, table_smem,
                                    **smem):
        *nest_gmem, out_gmem = rest
        ncode_smem = smem.get("ncode_smem")  # the nested code table, copied in build_table
        nest_copy = (nest_gmem[0], ncode_smem) if smem_code else ()
        nest_refs = (ncode_smem, *nest_gmem[1:]) if smem_code else tuple(nest_gmem)

        w_inputs = (w_gmem,) * len(w_specs)  # each spec takes its own chunks of the weight
        red_smem = smem.get("red_smem")  # wg_reduce: warpgroup 1's partial

        @functools.partial(pl.run_scoped, allocs=allocate(*w_inputs, x_gmem),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_tiles * splits,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                split, ni = lin % splits, lin // splits
                if cfg.col_split:  # all the CTA's rows, half of each step's columns
                    row0, col0 = ni * cta_rows, wg * wg_cols
                    part = split if cfg.wg_reduce else split * 2 + wg
                else:  # half of the CTA's rows, all of each step's columns
                    row0, col0, part = ni * cta_rows + wg * wg_rows, 0, split
                out = out_gmem.at[part] if cfg.partials > 1 else out_gmem
                dst = out.at[:, pl.ds(row0, wg_rows)]
                if uneven:  # the window's first step, and the steps to skip
                    first, skipped = traced_window(split, k_iters, splits)

                def window_start(unit):  # the window's first K column // unit (it divides)
                    if not uneven:
                        return split * (k_per // unit)
                    if tile_k % unit:
                        return first * tile_k // unit
                    return first * (tile_k // unit)

                s_tile = s_gmem.at[pl.ds(row0, wg_rows),
                                   pl.ds(window_start(blocksize), split_cols)]

                def ctx(run):
                    f["build_table"](table_smem, code_gmem, *nest_copy)
                    if cfg.wg_reduce:
                        f["finish_pair"](run(f["zeros"]()), red_smem, dst)
                    else:
                        f["finish"](run(f["zeros"]()), dst)

                def body(indices, *rest):
                    (kk,) = indices
                    *w_smems, x_smem, acc = rest
                    col = (kk * tile_k + col0) // blocksize
                    if cfg.col_split:
                        half = pl.ds(wg * (chunks // 2), chunks // 2)
                        x_part = x_smem.at[:, half]
                        w_parts = w_smems if cfg.swizzle else [w_smems[0].at[:, half]]
                    else:
                        w_parts, x_part = [w_smems[0].at[pl.ds(wg * wg_rows, wg_rows)]], x_smem

                    def run_step():
                        return f["step"](*w_parts, x_part, table_smem,
                                         s_tile.at[:, pl.ds(col, step_cols)], *nest_refs, acc)

                    if uneven:  # the moved-back window's steps the split before took
                        return lax.cond(kk >= skipped, run_step, lambda: acc)
                    return run_step()

                w_cols = k_per // 2 if cfg.swizzle else chunk_k  # a K split's packed bytes / chunks
                w_tile = w_gmem.at[pl.ds(ni * cta_rows, cta_rows),
                                   pl.ds(window_start(2 if cfg.swizzle else 256), w_cols)]
                pipeline(body, ctx)(*(w_tile,) * len(w_specs),
                                    x_gmem.at[:, pl.ds(window_start(256), chunk_k)],
                                    allocations=allocs)

    out_shape = (cfg.partials, m, n) if cfg.partials > 1 else (m, n)
    kernel = plgpu.kernel(
        matmul_4bit_mgpu_mma_kernel,  # the name Nsight Compute shows
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(sm_count(),),
        grid_names=("sm",),
        num_threads=cfg.compute_wgs + 1,  # the compute warpgroups and the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            table_smem=plgpu.SMEM((TABLE_BYTES // 4,), jnp.float32),
            **({"ncode_smem": plgpu.SMEM((256,), jnp.float32)} if smem_code else {}),
            **({"red_smem": plgpu.SMEM((128 * acc_count(m, cfg),), jnp.float32)}
               if cfg.wg_reduce else {})),
    )
    with compute_registers_held(FOUR_WG_REGISTERS if cfg.compute_wgs == 4 else None):
        y = kernel(x.reshape(m, k // 256, 256), w_view, scales, code, *(nest or ()))
    return jnp.sum(y, axis=0) if cfg.partials > 1 else y


def mgpu_mma_pair_table(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                        interpret: bool = False, nested=None,
                        config: MmaPairTableConfig | None = None):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 64 on a Hopper GPU. x bf16/f16; packed
    (N, K // 2) uint8; absmax (N, K // blocksize) f32 or, with `nested`, the uint8 codes."""
    return pair_table_product(
        "mgpu_mma_pair_table", "matmul_4bit_mma_reference", default_config, shape_problem,
        _call, x, packed, absmax, code, blocksize=blocksize, out_dtype=out_dtype,
        interpret=interpret, nested=nested, config=config)


VARIANTS = (
    Variant(
        name="mgpu_mma_pair_table", op="matmul_4bit", fn=mgpu_mma_pair_table,
        platform="sm90", interpret=False,
        reference=matmul_4bit_mma_reference, supports=supports, accepts_nested=True,
        description="Hopper Mosaic GPU (M <= 64): TMA-streamed packed tiles, each byte looked up "
                    "in a lane-replicated 256-entry table of 16-bit code pairs straight into an "
                    "mma.sync A fragment; fp32 group sums times absmax",
        numerics="rounded_codes", status="default", config_type=MmaPairTableConfig,
        default_config=default_config),
)
