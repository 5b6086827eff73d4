"""Grouped (mixture-of-experts) matmul on Hopper: a persistent Mosaic GPU kernel over row tiles
of the expert-sorted activation, each tile multiplying one expert's dense weight with wgmma.

`mgpu_grouped_dot`:   y[rows of e] = x[rows of e] @ w[e].T   (x (M, K), w (E, N, K), the forward)
`mgpu_grouped_dot_t`: y[rows of e] = a[rows of e] @ w[e]     (a (M, N), the backward dx = dy @ W_e)

w is the expert stack already in x's dtype: jqlora's qgmm dequantizes a 4-bit or int8 stack
with a transient pass first. The schedule (`reference.grouped_tiles`) gives every tile one
group's rows inside one block of `block_m` rows; a block that a group boundary crosses is
computed once per group touching it, and each tile stores only its own rows, with a ladder of
power-of-two TMA stores (a descriptor's row count is static). Rows past sum(group_sizes) are
zeroed after the kernel. Each SM loops over (tile, column block) pairs; the K loop is a TMA
pipeline feeding wgmma from shared memory. Hopper only (wgmma, TMA); no interpret mode: the
schedule is shared with the interpretable Triton kernels (`pallas_kernels/triton/grouped_dot.py`),
which the CPU suite runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.reference.grouped import (
    check_grouped_operands,
    grouped_matmul_reference,
    grouped_matmul_t_reference,
    grouped_tiles,
    zero_rows_past_groups,
)
from pallas_kernels.registry import Variant

reference = grouped_matmul_reference
reference_t = grouped_matmul_t_reference


@dataclasses.dataclass(frozen=True)
class GroupedDotConfig:
    """Tile shape and pipeline depth of the grouped wgmma kernel."""

    block_m: int = 128  # rows of x per tile (the wgmma M side: a multiple of 64)
    block_n: int = 128  # output columns per tile
    block_k: int = 64  # contraction columns per pipeline step
    max_concurrent_steps: int = 4  # TMA pipeline depth
    grid_block_n: int = 2  # column blocks walked together by the SM loop (L2 reuse of x)


def _num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def default_config(m: int, n: int, k: int, blocksize: int = 0) -> GroupedDotConfig:
    """The measured upstream optimum at MoE training shapes (block 128 x 128 x 64, 4 stages),
    with grid_block_n lowered to a divisor of the column blocks."""
    del m, k, blocksize
    cfg = GroupedDotConfig()
    gb = math.gcd(cfg.grid_block_n, max(n // cfg.block_n, 1))
    return dataclasses.replace(cfg, grid_block_n=gb)


def shape_problem(m: int, n: int, k: int, blocksize: int, cfg: GroupedDotConfig) -> str | None:
    """Why the kernel cannot take (M, N, K) with `cfg`, or None (N: output columns, K: contracted)."""
    del m, blocksize
    if cfg.block_m % 64 or cfg.block_k % 64 or cfg.block_n % 64:
        return f"block_m, block_n, block_k must be multiples of 64, got {cfg}"
    if k % cfg.block_k:
        return f"contracted K={k} must be a multiple of block_k={cfg.block_k}"
    if n % (cfg.block_n * cfg.grid_block_n):
        return f"output N={n} must be a multiple of block_n * grid_block_n = {cfg.block_n * cfg.grid_block_n}"
    return None


def _kernel_call(a, tiles, w, *, transpose_w: bool, out_dtype, cfg: GroupedDotConfig):
    """The pallas_call: a (M, Kc), tiles (3, T) int32, w (E, N, K). Returns (M, n_out) with
    the rows no tile covers unwritten."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, kc = a.shape
    n_out = w.shape[1] if transpose_w else w.shape[2]
    num_tiles = tiles.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    grid_n = n_out // bn

    def body(tiles_gmem, a_gmem, w_gmem, o_gmem):
        @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
        def _work(info):
            ti, ni = plgpu.planar_snake(info.index[0], (num_tiles, grid_n), 1, cfg.grid_block_n)
            group = tiles_gmem[0, ti]
            lo = tiles_gmem[1, ti]
            hi = tiles_gmem[2, ti]
            row_block = lax_div(lo, bm)
            block_start = row_block * bm

            def acc_scope(acc_ref):
                plgpu.emit_pipeline(
                    lambda _, a_smem, w_smem: plgpu.wgmma(
                        acc_ref, a_smem, plgpu.transpose_ref(w_smem, (1, 0)) if transpose_w else w_smem),
                    grid=(kc // bk,),
                    in_specs=[
                        plgpu.BlockSpec((bm, bk), lambda kk: (row_block, kk), delay_release=1),
                        plgpu.BlockSpec((bn, bk) if transpose_w else (bk, bn),
                                        (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
                                        delay_release=1),
                    ],
                    max_concurrent_steps=cfg.max_concurrent_steps,
                )(a_gmem, w_gmem.at[group])
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                store_tile_rows(o_smem, o_gmem, pl.ds(ni * bn, bn), lo=lo, hi=hi, block_start=block_start,
                                max_rows=min(bm, m))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n_out), out_dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(tiles, a, w)


def store_tile_rows(src, dst, cols, *, lo, hi, block_start, max_rows: int):
    """Copy a tile's own rows, [lo, hi) of the row block starting at `block_start`, from the
    shared-memory tile `src` to `dst[rows, cols]` in global memory. A TMA descriptor has a static
    row count, so the hi - lo rows go as its binary digits: one store of each power of two up to
    `max_rows` that the count holds, each under `pl.when`."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    size = hi - lo
    start = lo - block_start
    rows = 1 << int(math.log2(max_rows))
    while rows >= 1:
        @pl.when(size & rows != 0)
        def _(start=start, rows=rows):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(start, rows)], dst.at[pl.ds(block_start + start, rows), cols])

        start = start + (size & rows)
        rows //= 2


def lax_div(a, b: int):
    return jax.lax.div(a, jnp.int32(b))


def _grouped(a, group_sizes, w, *, transpose_w: bool, out_dtype, interpret: bool, config, what: str):
    if interpret:
        raise NotImplementedError(f"{what} has no interpret mode (Mosaic GPU); run the Triton "
                                  "grouped_dot variants or the reference on CPU")
    check_grouped_operands(a, group_sizes, w, transpose_w=transpose_w, what=what)
    if a.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != a.dtype:
        raise ValueError(f"{what}: operands must be bfloat16 or float16 of one dtype (the wgmma "
                         f"operands), got {a.dtype} and {w.dtype}")
    m, kc = a.shape
    n_out = w.shape[1] if transpose_w else w.shape[2]
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if m == 0:
        return jnp.zeros((0, n_out), out_dtype)
    cfg = config or default_config(m, n_out, kc)
    problem = shape_problem(m, n_out, kc, 0, cfg)
    if problem:
        raise ValueError(f"{what}: {problem}")
    tiles = grouped_tiles(group_sizes, m, cfg.block_m)
    # TMA descriptors take a row count below 8 or a multiple of 8: pad the rows (no tile reads
    # the padding's products, the loads past the end read zeros)
    mp = m if m < 8 else -(-m // 8) * 8
    ap = jnp.pad(a, ((0, mp - m), (0, 0))) if mp != m else a
    y = _kernel_call(ap, tiles, w, transpose_w=transpose_w, out_dtype=out_dtype, cfg=cfg)
    return zero_rows_past_groups(y[:m] if mp != m else y, group_sizes)


def emulate(a, group_sizes, w, *, transpose_w: bool, cfg: GroupedDotConfig | None = None):
    """numpy twin of the kernel's schedule and stores (CPU tests): float64 products per tile of
    `grouped_tiles`, each tile writing rows [first, end) in its power-of-two pieces; rows no
    tile writes stay NaN (the kernel leaves them unwritten), then `zero_rows_past_groups`."""
    import numpy as np

    a64, w64 = np.asarray(a, np.float64), np.asarray(w, np.float64)
    m = a64.shape[0]
    n_out = w64.shape[1] if transpose_w else w64.shape[2]
    cfg = cfg or default_config(m, n_out, a64.shape[1])
    tiles = np.asarray(grouped_tiles(jnp.asarray(group_sizes), m, cfg.block_m))
    out = np.full((m, n_out), np.nan)
    pad = np.zeros((-(-m // cfg.block_m) * cfg.block_m, a64.shape[1]))
    pad[:m] = a64  # TMA reads past the last row as zeros
    for group, lo, hi in tiles.T:
        block_start = lo // cfg.block_m * cfg.block_m
        we = w64[group]
        acc = pad[block_start:block_start + cfg.block_m] @ (we.T if transpose_w else we)
        size, start, rows = hi - lo, lo - block_start, 1 << int(math.log2(min(cfg.block_m, m)))
        while rows >= 1:
            if size & rows:
                out[block_start + start:block_start + start + rows] = acc[start:start + rows]
                start += rows
            rows //= 2
    return np.asarray(zero_rows_past_groups(jnp.asarray(out), jnp.asarray(group_sizes)))


def mgpu_grouped_dot(x, group_sizes, w, *, out_dtype=None, interpret: bool = False,
                     config: GroupedDotConfig | None = None):
    """y[rows of e] = x[rows of e] @ w[e].T on a Hopper GPU: x (M, K), w (E, N, K), bf16/f16."""
    return _grouped(x, group_sizes, w, transpose_w=True, out_dtype=out_dtype, interpret=interpret,
                    config=config, what="mgpu_grouped_dot")


def mgpu_grouped_dot_t(dy, group_sizes, w, *, out_dtype=None, interpret: bool = False,
                       config: GroupedDotConfig | None = None):
    """y[rows of e] = dy[rows of e] @ w[e] on a Hopper GPU: dy (M, N), w (E, N, K), bf16/f16."""
    return _grouped(dy, group_sizes, w, transpose_w=False, out_dtype=out_dtype, interpret=interpret,
                    config=config, what="mgpu_grouped_dot_t")


def supports(m, n, k, blocksize=0):
    """Forward (M, N, K) shapes the default config takes: K a multiple of 64, N of 128."""
    return m >= 1 and shape_problem(m, n, k, blocksize, default_config(m, n, k)) is None


def supports_t(m, n, k, blocksize=0):
    """Backward: the output has K columns, the contraction runs over N."""
    return m >= 1 and shape_problem(m, k, n, blocksize, default_config(m, k, n)) is None


VARIANTS = (
    Variant(
        name="mgpu_grouped_dot", op="grouped_matmul", fn=mgpu_grouped_dot, platform="sm90",
        interpret=False, reference=grouped_matmul_reference, supports=supports,
        description="Hopper Mosaic GPU grouped matmul: persistent SM loop over expert row tiles, "
                    "TMA pipeline into wgmma, power-of-two TMA stores of each tile's rows",
        numerics="rounded_weight", status="default", config_type=GroupedDotConfig,
        default_config=lambda m, n, k, bs: default_config(m, n, k)),
    Variant(
        name="mgpu_grouped_dot_t", op="grouped_matmul_t", fn=mgpu_grouped_dot_t, platform="sm90",
        interpret=False, reference=grouped_matmul_t_reference, supports=supports_t,
        description="the backward dx = dy @ W_e of mgpu_grouped_dot (the weight tile not transposed)",
        numerics="rounded_weight", status="default", config_type=GroupedDotConfig,
        default_config=lambda m, n, k, bs: default_config(m, k, n)),
)
