"""Where the pair-table MMA kernel's (`mgpu_mma_pair_table`) bytes live: its tile geometry
(`MmaPairTableConfig`), its shared memory, the MMA's column order within a scale group, and
numpy models of the addresses its shared-memory loads compute. The CPU tests check with these that
every weight load finds the bytes TMA stored (swizzled or not) and count the loads'
bank-conflict wavefronts; the kernel's MLIR computes the same addresses.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.mosaic.mgpu_pair_table import LANES

GROUP = 64  # weight columns of one scale group: four k16 MMAs
TABLE_BYTES = 256 * 256  # entry b at 256 b, lane l's copy at + 4 l (half of each entry unused)
TILE_KS = (256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class MmaPairTableConfig:
    """A step is a (cta_rows x tile_k) weight tile, 32 KiB packed. tile_k = 256: each compute
    warpgroup takes 128 of the CTA's 256 rows (128 bytes of a row a step); 512 / 1024: both
    warpgroups take all of the CTA's 128 / 64 rows, each half of the step's columns (256 / 512
    contiguous bytes of a row a step), their fp32 partials summed in the CTA (`wg_reduce`) or
    by XLA like K splits."""
    # K ranges computed by separate CTAs; fp32 partials summed by XLA. Splits need not divide
    # the steps: each takes `split_steps` of them, and where they do not divide, the last
    # split's window is moved back to end at K and skips the steps the one before it took
    # (`mgpu_pipeline.split_windows`): a prime step count (K = 11008, 43 steps) fills the GPU
    k_splits: int = 1
    stages: int = 2  # pipeline depth (32 KiB of weight a stage)
    tile_k: int = 256
    # True (tile_k 256 or 512): TMA stores the weight tile (with tile_k = 512 each warpgroup's
    # 128-byte half of it, a buffer of its own) with the 128-byte swizzle and MMA row g of each
    # 8 reads tile row `tile_row(g)` = 2 (g % 4) + g // 4, so a half-warp's 8-byte loads (rows
    # g = 0..3, 32 bytes each) fall in 32 distinct banks. False: rows g, the plain layout, where
    # those 4 rows sit 128 bytes apart in the same 8 banks: 4-way conflicts
    swizzle: bool = True
    # True: lanes of odd g read the second 16 bytes of their x piece first, so the two tokens
    # of a quarter-warp hit different banks (their rows are 2 * tile_k bytes apart: 2-way
    # conflicts otherwise), and 8 selects per 32 bytes put the words back in order
    x_swap: bool = True
    # compute warpgroups (2 or 4). 4 (tile_k = 256 only): each takes 64 of the CTA's 256 rows
    # (one m16 tile a warp), so each scheduler has 4 warps to hide the lookups' and MMAs'
    # latency instead of 2, at 96 registers a thread (FOUR_WG_REGISTERS). Correct but measured
    # slower (docs/kernels.md): not a default
    compute_wgs: int = 2
    # True: the four lanes of a quad (same rows) each load and de-nest the scales of one
    # group in four and take the others by shuffles, where each lane loaded all of them (4
    # times the global loads and de-nesting); chosen by measurement: docs/kernels.md
    quad_scales: bool = True
    # True: the 256 double-quant codes are copied into shared memory once a tile, and each
    # scale's de-nesting reads its entry there instead of from global memory
    nested_code_smem: bool = True
    # True (tile_k > 256): the two compute warpgroups' fp32 partials (same rows, each half of
    # the columns) are summed in the CTA through shared memory, so XLA sums K splits only
    # (none with k_splits = 1: y is stored by the kernel)
    wg_reduce: bool = False

    @property
    def col_split(self) -> bool:
        return self.tile_k > 256

    @property
    def m_tiles(self) -> int:  # m16 tiles a warp
        return 1 if self.tile_k == 1024 or self.compute_wgs == 4 else 2

    @property
    def wg_rows(self) -> int:
        return 64 * self.m_tiles

    @property
    def cta_rows(self) -> int:
        return self.wg_rows * (1 if self.col_split else self.compute_wgs)

    @property
    def wg_cols(self) -> int:  # weight columns a warpgroup takes a step
        return self.tile_k // 2 if self.col_split else self.tile_k

    @property
    def partials(self) -> int:  # fp32 partial products XLA sums
        return self.k_splits * (2 if self.col_split and not self.wg_reduce else 1)

    @property
    def w_row(self) -> int:  # bytes between weight rows in a warpgroup's part of the tile
        return 128 if self.swizzle else self.tile_k // 2


def n_tiles_of(m: int) -> int:
    """n8 token tiles of the MMA."""
    return -(-m // 8)


def acc_count(m: int, cfg: MmaPairTableConfig) -> int:
    """fp32 accumulators a compute thread holds: m16 tiles x n8 tiles x a fragment's 4."""
    return cfg.m_tiles * n_tiles_of(m) * 4


def smem_bytes(m: int, cfg: MmaPairTableConfig) -> int:
    """The pair table, the stages' weight and x tiles, (nested_code_smem) the 256 f32
    double-quant codes and (wg_reduce) a warpgroup's fp32 partial, each rounded up to 1 KiB."""
    up = lambda b: -(-b // 1024) * 1024
    return (up(TABLE_BYTES) + up(cfg.stages * cfg.cta_rows * cfg.tile_k // 2)
            + up(cfg.stages * m * cfg.tile_k * 2) + (1024 if cfg.nested_code_smem else 0)
            + (up(128 * acc_count(m, cfg) * 4) if cfg.wg_reduce else 0))


def tile_row(g: int, swizzle: bool) -> int:
    """The tile row (within its 8) that MMA row g (and g + 8) of a warp's m16 tile reads."""
    return 2 * (g % 4) + g // 4 if swizzle else g


def swizzle_128(address):
    """Where TMA's 128-byte swizzle puts byte `address` of shared memory: the 16-byte chunk
    index (bits 4-6) xor the 128-byte row index (bits 7-9); an involution."""
    address = np.asarray(address, np.int64)
    return address ^ ((address >> 3) & 0x70)


def weight_load_offsets(cfg: MmaPairTableConfig, warp: int = 0):
    """The step's 8-byte weight loads of one warp as the kernel computes them: (physical,
    logical) byte offsets from the start of the warpgroup's part of the tile, each (groups,
    m16 tiles, 2 rows, 32 lanes). Physical is where the load reads, logical the byte (row * row
    bytes + column byte) it must find there; TMA stores logical byte L at swizzle_128(L) when
    `cfg.swizzle`, else at L (the part starts 1024-byte aligned)."""
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    w_row, mt = cfg.w_row, cfg.m_tiles
    row0 = warp * 16 * mt + np.asarray([tile_row(v, cfg.swizzle) for v in g])
    groups = cfg.wg_cols // GROUP
    phys = np.zeros((groups, mt, 2, LANES), np.int64)
    logical = np.zeros_like(phys)
    for q in range(groups):
        wq = row0 * w_row + 8 * t + 32 * q
        wq = swizzle_128(wq) if cfg.swizzle else wq
        for i in range(mt):
            for e in range(2):
                phys[q, i, e] = wq + (16 * i + 8 * e) * w_row
                logical[q, i, e] = (row0 + 16 * i + 8 * e) * w_row + 32 * q + 8 * t
    return phys, logical


def x_load_offsets(cfg: MmaPairTableConfig, m: int):
    """The step's two 16-byte x loads per (group, n8 tile) of a lane, as the kernel computes
    them: (first, second) byte offsets into the x tile, each (groups, n8 tiles, 32 lanes), and
    the byte offsets of the lane's x words 0..3 and 4..7 (columns 64 q + 16 t + 0..7 and
    + 8..15 of its token) that the selects take from them: with `cfg.x_swap` lanes of odd g
    read the second half first."""
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    x_row, groups = cfg.tile_k * 2, cfg.wg_cols // GROUP
    shape = (groups, n_tiles_of(m), LANES)
    first, second, lo, hi = (np.zeros(shape, np.int64) for _ in range(4))
    for q in range(groups):
        for h in range(n_tiles_of(m)):
            xa = np.minimum(g + 8 * h, m - 1) * x_row + 32 * t + 128 * q
            lo[q, h], hi[q, h] = xa, xa + 16
            first[q, h] = xa | ((g & 1) << 4) if cfg.x_swap else xa
            second[q, h] = first[q, h] ^ 16
    return first, second, lo, hi


def mma_columns(t: int, s: int) -> tuple[int, int, int, int]:
    """Weight columns (within a 64-column group) of MMA columns 2t, 2t + 1, 2t + 8, 2t + 9 of
    k16 step s: lane t's bytes 8 t + 2 s and 8 t + 2 s + 1."""
    c = 16 * t + 4 * s
    return c, c + 1, c + 2, c + 3
