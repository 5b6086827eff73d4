"""What the Hopper Mosaic GPU kernels build their pipelines from: the warp-specialized TMA
pipeline, a tile load that works under jax 0.10 and 0.11, the SM count, grids that fill it
(`grid_fills`, K splits that need not divide the steps: `split_windows`), and the register hold
that four compute warpgroups need.
"""
from __future__ import annotations

import contextlib
import inspect

import jax

# SMs of a Hopper GPU (H100 / H200): the CTA count where no GPU is attached (lowering on CPU)
SMS = 132
# an H100/H200 block's shared memory, less Mosaic's barriers (64 to 1072 B seen)
SMEM_LIMIT = 232448 - 1088


def sm_count() -> int:
    """SMs of the default device, or `SMS` where there is no GPU (lowering for CUDA on CPU)."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else SMS


def grid_fills(n_tiles: int, k_iters: int, k_splits: int) -> bool:
    """Whether a (row tiles x K splits) grid of one CTA an SM uses the GPU: a quarter of the SMs
    or more get a CTA, or the product has fewer steps than SMs anyway. The GEMV splits K only
    into equal runs of whole steps, so a prime step count leaves one CTA a row tile: K = 11008
    (43 steps of 256, Llama-2-7B's down projection) gives 16 CTAs, far slower than the other
    kernels (docs/kernels.md). Where this is False `auto` takes other kernels."""
    return 4 * n_tiles * k_splits >= SMS or n_tiles * k_iters < SMS


# K splits that need not divide the steps: each split's CTA runs a window of the same number
# of steps, the last window moved back to end at K; it skips (a branch around the step) the
# steps the split before it owns. Summed once each, in per-split order.
def split_steps(k_iters: int, k_splits: int) -> int:
    """Pipeline steps each K split's CTA runs: ceil(k_iters / k_splits)."""
    return -(-k_iters // k_splits)


def split_windows(k_iters: int, k_splits: int) -> list[tuple[int, int, int]]:
    """Per K split, (first step of its window, first and end step of its own steps): windows
    of `split_steps` steps; split s owns steps s p .. min((s + 1) p, k_iters). Only the last
    window can start before its own steps (moved back to end at K); the kernel skips those."""
    p = split_steps(k_iters, k_splits)
    return [(min(s * p, k_iters - p), s * p, min((s + 1) * p, k_iters))
            for s in range(k_splits)]


def window_blocks_problem(k_iters: int, k_splits: int, tile_k: int,
                          blocksize: int) -> str | None:
    """Why `split_windows` of `tile_k`-column steps would cut a scale block, or None. A kernel
    reads its scales from its window's first block on; windows other than a moved-back last
    one start at multiples of the window, so the window and the last start are all to check."""
    window = split_steps(k_iters, k_splits) * tile_k
    last_first = split_windows(k_iters, k_splits)[-1][0] * tile_k
    if window % blocksize or last_first % blocksize:
        return (f"each K split's window ({window} columns from column {last_first} for the "
                f"last) must hold whole scale blocks")
    return None


def traced_window(split, k_iters: int, k_splits: int):
    """`split_windows` inside a kernel, for a traced split index: (the window's first step,
    the steps at its start that the split before owns, 0 but for a moved-back last window)."""
    import jax.numpy as jnp

    p = split_steps(k_iters, k_splits)
    first = jnp.minimum(split * p, k_iters - p)
    return first, split * p - first


def uneven_splits_problem(k_iters: int, k_splits: int) -> str | None:
    """Why `k_splits` cannot split `k_iters` steps into `split_windows`, or None: every split
    must own a step (more splits than that give the same windows with idle CTAs)."""
    if not 1 <= k_splits <= k_iters:
        return f"k_splits ({k_splits}) must be 1..{k_iters} (the K steps)"
    if (k_splits - 1) * split_steps(k_iters, k_splits) >= k_iters:
        return (f"{k_splits} K splits of {split_steps(k_iters, k_splits)} steps leave the last "
                f"without a step of its own ({k_iters} steps)")
    return None


# Registers a thread of each of four compute warpgroups: what 5 warpgroups (640 threads) get at
# launch, 65536 / 640 rounded down to a multiple of 8, so `setmaxnreg.inc` asks for nothing.
FOUR_WG_REGISTERS = 96


@contextlib.contextmanager
def compute_registers_held(count: int | None):
    """While a kernel is traced, hold the register count that jax's warp-specialized pipeline
    gives its compute warpgroups at `count` (None: jax's own). jax computes
    (512 - memory registers) / compute warpgroups, which assumes the whole register file
    is free: with four compute warpgroups that is 112, while 640 threads launch with 96 a
    thread, and 40 * 128 + 112 * 512 > 96 * 640, so `setmaxnreg.inc` could not be granted
    (tile-ai/tilelang#2406 fixed the same deadlock in its own warp specialization). A kernel
    must also launch every warpgroup the pipeline waits for, or its barriers hang."""
    if count is None:
        yield
        return
    from jax._src.pallas.mosaic_gpu import pipeline as ws_pipeline
    original = ws_pipeline._compute_registers
    ws_pipeline._compute_registers = lambda memory_registers, num_compute_wgs: count
    try:
        yield
    finally:
        ws_pipeline._compute_registers = original


def warp_specialized(plgpu, pl, *, grid, in_specs, num_compute_wgs: int, depth: int):
    """`pipeline(body, ctx)` over `grid` with a TMA memory warpgroup feeding `num_compute_wgs`
    compute warpgroups, and `allocate(*gmem_refs)` for the scoped buffers it needs."""
    def pipeline(body, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=grid, memory_registers=40, in_specs=in_specs, wg_axis="wg",
            num_compute_wgs=num_compute_wgs, max_concurrent_steps=depth, compute_context=ctx)

    ignore = lambda *_, **__: None
    allocate = lambda *refs: pipeline(ignore, ignore).get_allocations(*refs)
    return pipeline, allocate


def load_tile(plgpu, ref, index, layout):
    """plgpu.load of ref[index] in `layout`: jax 0.11 takes `ref.at[index]` (a separate index
    is deprecated), jax 0.10 only the separate index."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (index,), layout=layout)
    return plgpu.load(ref.at[index], layout=layout)

