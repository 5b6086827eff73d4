"""4-bit product for small M (<= 64) on Hopper (Mosaic GPU): y = x @ dequant(W).T, each packed
byte decoded by one shared-memory load straight into a tensor-core operand (mma.sync m16n8k16).

Why: the pair-table GEMV (`matmul_4bit_mgpu_gemv`) spends two fp32 fma per weight and runs at
about 4 instructions per weight; the wgmma kernel (`matmul_4bit_mgpu`) decodes with byte
permutes at 6.1 instructions per weight (H100 ncu, s15-s17). Both are issue-bound at M <= 16.
Here a byte's two codes come as one 32-bit word of two 16-bit codes, (code[hi], code[lo]) in
x's dtype, from a 256-entry pair table replicated per lane (entry b of lane l at byte
256 b + 4 l: conflict-free whatever the bytes), and that word *is* one register of the A
fragment of an m16n8k16 MMA: the multiply-adds run on the tensor core. Per byte: prmt, add, one
load; the scale is applied to each 64-column group's fp32 MMA result (one fma per output), so
the table holds the bare codes.

Numerics: the codes are rounded to x's dtype (bf16: relative error <= 2^-9 per code), the
products and sums are the tensor core's fp32, and absmax multiplies each 64-column group's
sum in fp32. bitsandbytes instead rounds code * absmax to x's dtype (the same size of error, not
the same bits). Oracle: `matmul_4bit_mma_reference` (codes rounded the same way).

Layout: a CTA takes 256 weight rows (two compute warpgroups, four warps each, 32 rows a warp:
two m16 tiles) of one K split; a memory warpgroup streams (256 rows x 128 bytes) weight tiles
and (M x 256) x tiles with TMA (the GEMV's pipeline). The MMA's K order is permuted within each
64-column group so that lane (g, t) of a warp loads 8 contiguous bytes of its rows, g and g + 8:
k16 step s of group q takes bytes 8 t + 2 s (columns 2t, 2t + 1 of the MMA) and 8 t + 2 s + 1
(columns 2t + 8, 2t + 9), i.e. weight columns 64 q + 16 t + 4 s + (0, 1) and (2, 3); the x
fragment follows the same order, so lane (g, t) reads x columns 64 q + 16 t .. + 15 of token g
(tokens 8..15 a second n8 tile). K splits are summed by XLA, as in the GEMV.

Shared-memory banks (session 19): TMA stores the weight tile with the 128-byte swizzle, and
MMA row g of each 8 reads tile row `tile_row(g)` = 2 (g % 4) + g // 4, so a half-warp's four
rows (0, 2, 4, 6 or 1, 3, 5, 7 mod 8) cover all 32 banks with their 8-byte loads; lanes of odd
g read the second 16 bytes of their x piece first (`x_swap`). Before, those loads were 4-way
and 2-way conflicted: 2.75 M wavefronts against 1.61 M ideal at M = 16, 4096x14336, with the
shared-memory queue the top stall (H200 ncu, s19-1). `mgpu_mma_layout` holds the tile geometry
(`MmaConfig`) and the kernel's address arithmetic in numpy, for the CPU tests.

Measured (H200, s19-2, ratio to bf16 at 4096x4096 / 4096x14336 / 14336x4096, same run): M = 1
0.72 / 0.54 / 0.53 (the pair-table GEMV 0.74 / 0.59 / 0.59, so `auto` runs this kernel from
M = 1), M = 2 0.73 / 0.56 / 0.54, M = 8 0.73 / 0.55 / 0.55, M = 16 0.78 / 0.61 / 0.59 (the
session-18 layout 0.88 / 0.73 / 0.72; `mgpu_decoded_wgmma` 0.95 / 0.90 / 0.93). The same
pipeline with no decode streams the weight at 3.3 TB/s, about twice the kernel
(`benchmarks.mgpu_stream_probe`); what is left is in benchmarks/results/README.md, session 19.

Scales (session 20): the four lanes of a quad hold the same rows, so each loads and de-nests
the scales of one group in four and shuffles share them (`quad_scales`), and the double-quant
code table is read from shared memory (`nested_code_smem`): M = 1 0.64 / 0.49 / 0.45 x bf16 (H200
s20-12). The scale path still costs about 10-15% (a run with constant scales: 0.61 / 0.42 /
0.41). Tried and slower (benchmarks/results/README.md, session 20): stream-K over all SMs with
in-kernel partial sums, four compute warpgroups (`compute_wgs = 4`, kept as a config), a 64 KiB-
aligned pair table (one prmt a byte), the next step's scales prefetched.

K-split sums (session 21): XLA's sum of the K splits' fp32 partials is a kernel of its own,
1.3-1.8 us a call (H100 s21-8: the MMA kernel alone 0.38 / 0.38 x bf16 at M = 16 on the large
shapes, the call 0.41 / 0.42). With 512-column steps (`tile_k = 512`) the two warpgroups share
128 rows, each half of the columns in its own swizzled TMA buffer, and sum their partials in the
CTA (`wg_reduce`); where that needs no K split (`default_config`: 4096x14336 among the protocol
shapes) the kernel stores y and the call is one kernel: M = 16 0.374 x bf16 against 0.403 (H100
s21-11). Summing K splits across a thread-block cluster was no faster (results README).

Up to 64 tokens (session 22; 16 before): eight n8 tiles of x, the A fragments of each lookup
shared by all of them. H100 s22-12, same run: M = 17 / 24 / 32 0.617 / 0.636 / 0.671 x bf16 at
4096x4096, 0.387 / 0.383 / 0.454 at 4096x14336, 0.448 / 0.468 / 0.474 at 14336x4096, against
`mgpu_decoded_wgmma`'s 0.831 / 0.808 / 0.707, 0.663 / 0.634 / 0.588 and 0.690 / 0.681 / 0.606;
s22-13: M = 48 0.743 / 0.627 / 0.568 against 0.833 / 0.690 / 0.680, M = 64 0.869 / 0.789 /
0.701 against 0.738 / 0.648 / 0.616 (`auto` stops at 48).

K splits that do not divide the steps (session 22): a prime step count left one split, 16 CTAs
for Llama-2-7B's down projection (K = 11008, 43 steps), so `auto` ran slower kernels there.
Each split now runs a window of ceil(steps / splits) steps; the last window is moved back to end
at K and skips (`lax.cond` around the step) the steps the split before it took, so every step
is summed once, in the same per-split order (`mgpu_pipeline.split_windows`). The skipped
steps are still loaded (at most splits - 1 of them). H200 s22-1, ratio to bf16, same run: K =
11008, N = 4096 M = 1 0.458 (8 splits, 128 CTAs) against the Triton GEMV's 0.818, M = 16 0.518
against the wgmma kernel's 1.396; Qwen2.5-7B's down projection (K = 18944, 74 steps, N = 3584)
0.429 and 0.486 against 0.779 and 0.894.

Hopper only (sm_90, TMA, inline PTX), no interpret mode. CPU checks: `emulate` (the same
groups and order in float64 sums) against the reference, the lookup program in the tests' PTX
interpreter, and CUDA lowering.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.dequantize_4bit import supports_4bit
from pallas_kernels.mgpu_decode import mosaic_modules
from pallas_kernels.mgpu_mma_layout import (
    GROUP, TABLE_BYTES, TILE_KS, MmaConfig, acc_count, mma_columns, n_tiles_of, smem_bytes)
from pallas_kernels.mgpu_pair_table import (
    LANES, LOAD_V4_PTX, TABLE_BARRIER, asm, pair_table_product, scale_loaders, smem_address)
from pallas_kernels.mgpu_pipeline import (
    FOUR_WG_REGISTERS, SMEM_LIMIT, SMS, compute_registers_held, grid_fills, sm_count,
    split_steps, split_windows, traced_window, uneven_splits_problem, warp_specialized)
from pallas_kernels.registry import Variant

MAX_M = 64  # eight n8 tiles of tokens
def default_config(m: int, n: int, k: int, blocksize: int,
                   tile_k: int | None = None) -> MmaConfig:
    """K splits: the most that divide the K steps, keep whole scale blocks and the CTAs within
    one wave of SMs (the GEMV's rule), or, where that leaves a CTA more steps to run, splits
    that do not divide them (`split_windows`). The swizzle where tile_k allows it; x_swap where
    x has two tokens (with one, all lanes read the same row: no conflict to avoid).

    tile_k (None: chosen): 512 where 128-row tiles fill at least as many SMs in one wave
    without a K split as 256-row tiles do with theirs. Its two warpgroups' partials are then
    summed in the CTA (`wg_reduce`) and y is stored by the kernel: no XLA sum of K-split
    partials, a kernel of its own (1.3-1.8 us a call). H100 s21-10, same run, ratio to bf16:
    4096x14336 (112 CTAs either way) M = 1 0.376 against 0.394, M = 16 0.369 against 0.408;
    where 128-row tiles would need K splits (4096x4096, 14336x4096) 256 stays (0.547 against
    0.530 and 0.403 against 0.374 at M = 1 with 512). 256-row tiles' splits may be uneven:
    4096x11008 (K x N) takes 3 of them, 129 CTAs, over 86 of 128 rows (H200 s22-1: 0.462
    against 0.487 at M = 1, 0.539 against 0.593 at M = 16)."""
    if tile_k is None:
        base = default_config(m, n, k, blocksize, 256)
        wide = default_config(m, n, k, blocksize, 512)
        if (n % 256 == 0 and wide.k_splits == 1 and n // wide.cta_rows <= SMS
                and n // wide.cta_rows >= (n // base.cta_rows) * base.k_splits
                and shape_problem(m, n, k, blocksize, wide) is None):
            return wide
        return base
    cfg = MmaConfig(tile_k=tile_k, swizzle=tile_k in (256, 512), x_swap=m > 1,
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


def shape_problem(m: int, n: int, k: int, blocksize: int, cfg: MmaConfig) -> str | None:
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
    windows = split_windows(k // cfg.tile_k, cfg.k_splits)
    window = split_steps(k // cfg.tile_k, cfg.k_splits) * cfg.tile_k
    if window % blocksize or any(first * cfg.tile_k % blocksize for first, _, _ in windows):
        return (f"each K split's window ({window} columns from column "
                f"{windows[-1][0] * cfg.tile_k} for the last) must hold whole scale blocks")
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


def available() -> bool:
    from pallas_kernels import matmul_4bit_mgpu
    return matmul_4bit_mgpu.available()


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


def emulate(x, packed, absmax, code, *, blocksize: int, cfg: MmaConfig = MmaConfig()):
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


# --------------------------------------------------------------------------- PTX programs
def lookup_ptx() -> str:
    """Two rows' 8 bytes of a group ($16, $17: row g; $18, $19: row g + 8) and the lane's
    table address $20 -> $0..$15 = the A fragments of the group's 4 k16 steps, step s at
    $4s..$4s+3 = (row g byte 2s, row g + 8 byte 2s, row g byte 2s + 1, row g + 8 byte 2s + 1)."""
    lines = ["{", ".reg .b32 z, a;", "mov.b32 z, 0;"]
    words = {"lo": ("$16", "$17"), "hi": ("$18", "$19")}
    for s in range(4):
        for i, (row, extra) in enumerate((("lo", 0), ("hi", 0), ("lo", 1), ("hi", 1))):
            byte = 2 * s + extra
            word = words[row][byte // 4]
            lines.append(f"prmt.b32 a, {word}, z, 0x44{byte % 4}4;")  # byte << 8
            lines.append("add.u32 a, a, $20;")
            lines.append(f"ld.shared.b32 ${4 * s + i}, [a];")
    lines.append("}")
    return "\n".join(lines)


def mma_ptx(dtype) -> str:
    """D ($0..$3, f32) = A ($4..$7) . B ($8, $9) + C ($10..$13), m16n8k16, fp32 accumulate."""
    t = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(dtype).name]
    return (f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0, $1, $2, $3}}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


LOAD_PAIR_PTX = "ld.shared.v2.u32 {$0, $1}, [$2];"


# --------------------------------------------------------------------------- Mosaic pieces
def swizzled_tile_transforms(plgpu):
    """The weight tile's shared-memory layout with `MmaConfig.swizzle`: 8-row tiles of whole
    128-byte rows (so the bytes stay row-major) under TMA's 128-byte swizzle."""
    return plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)


def _pieces(plgpu, m: int, dtype, blocksize: int, cols: int, nested: bool, cfg: MmaConfig,
            smem_code: bool = False):
    _, _, _, ir, arith, memref, fa, mu = mosaic_modules()
    from jax._src.lib.mlir.dialects import scf, vector
    n8, mt = n_tiles_of(m), cfg.m_tiles
    w_row, x_row = cfg.w_row, cfg.tile_k * 2  # bytes of a weight / x row of the tile
    n_acc = acc_count(m, cfg)
    shape = (128 * n_acc,)
    layout = fa.WGStridedFragLayout(shape, n_acc)
    acc_arg = plgpu.Layout.WG_STRIDED(shape, vec_size=n_acc)
    acc_type = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=acc_arg)
    i32 = lambda: ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32(), v)
    as_idx = lambda v: arith.index_cast(ir.IndexType.get(), v)
    cvt = {"bfloat16": "cvt.rn.bf16x2.f32", "float16": "cvt.rn.f16x2.f32"}[jnp.dtype(dtype).name]
    nest_operands, load_scale = scale_loaders(nested, cols)

    def thread():
        """(warp in the warpgroup, g = lane // 4, t = lane % 4, lane)"""
        tid = arith.remui(mu.thread_idx(), c32(128))
        lane = arith.remui(tid, c32(LANES))
        return arith.divui(tid, c32(LANES)), arith.divui(lane, c32(4)), arith.remui(lane, c32(4)), lane

    def first_row(warp, g):
        """The warpgroup row of MMA row g of the warp's first m16 tile (`tile_row`)."""
        if cfg.swizzle:
            g = arith.ori(arith.shli(arith.andi(g, c32(3)), c32(1)), arith.shrui(g, c32(2)))
        return arith.addi(arith.muli(warp, c32(16 * mt)), g)

    warps = 4 * cfg.compute_wgs  # compute warps of the CTA: 8 or 16

    def build_table(ctx, table_ref, code_ref, *nested_code):
        """The 256 x 32 words (code[b >> 4], code[b & 15]) in x's dtype, over the compute
        threads: warp w of the CTA writes bytes w + warps i, each lane its own copy. With
        `nested_code` (gmem, smem): the 256 double-quant codes copied to shared memory too,
        so that each scale's de-nesting reads its code entry there (a shared-memory load where
        it was a global one, behind the load of the scale's own code)."""
        del ctx
        *_, lane = thread()
        if nested_code:
            src, dst = nested_code
            i = as_idx(arith.andi(mu.thread_idx(), c32(255)))
            memref.store(memref.load(src, [i]), dst, [i])
        w = arith.divui(mu.thread_idx(), c32(LANES))  # over all compute warpgroups
        hi = [memref.load(code_ref, [as_idx(c32(v))]) for v in range(16)]
        lo = {e: memref.load(code_ref, [as_idx(arith.addi(w, c32(e)))])
              for e in sorted({(warps * i) % 16 for i in range(256 // warps)})}
        base = arith.addi(arith.addi(smem_address(table_ref), arith.muli(lane, c32(4))),
                          arith.muli(w, c32(256)))
        for i in range(256 // warps):  # byte b = w + warps i (w < warps <= 16)
            b0 = warps * i  # hi nibble b0 // 16, lo nibble w + b0 % 16
            word = asm(f"{cvt} $0, $1, $2;", [lo[b0 % 16], hi[b0 // 16]], "r")[0]
            asm("st.shared.b32 [$0], $1;", [arith.addi(base, c32(256 * b0)), word])
        asm(f"bar.sync {TABLE_BARRIER}, {32 * warps};", [])

    def zeros(ctx):
        del ctx
        return fa.FragmentedArray.splat(arith.constant(ir.F32Type.get(), 0.0), shape, layout)

    two_parts = cfg.col_split and cfg.swizzle  # each warpgroup's half: a buffer of its own

    def step(ctx, w_ref, *rest):
        """One pipeline step: this warp's 16 mt rows of the warpgroup's (wg_rows, wg_cols)
        part of the weight tile, wg_cols / 64 groups; s_ref: the part's window of the scales.
        With swizzled 512-column steps (`two_parts`) both warpgroups' halves come, as two
        buffers, and each warpgroup reads its own."""
        del ctx
        w_base = smem_address(w_ref)
        if two_parts:  # warpgroup 1 reads the second buffer
            w_other, *rest = rest
            second = arith.cmpi(arith.CmpIPredicate.uge, mu.thread_idx(), c32(128))
            w_base = arith.select(second, smem_address(w_other), w_base)
        x_ref, table_ref, s_ref, *nest_refs, acc = rest
        f32 = ir.F32Type.get()
        warp, g, t, lane = thread()
        tb = arith.addi(smem_address(table_ref), arith.muli(lane, c32(4)))
        row0 = first_row(warp, g)  # MMA row g of m16 tile 0
        wb = arith.addi(w_base,
                        arith.addi(arith.muli(row0, c32(w_row)), arith.muli(t, c32(8))))
        xb = arith.addi(smem_address(x_ref), arith.muli(t, c32(32)))
        if cfg.x_swap:  # odd g reads bytes 16..31 of its piece first
            g_odd = arith.andi(g, c32(1))
            swap = arith.cmpi(arith.CmpIPredicate.ne, g_odd, c32(0))
            first_half = arith.shli(g_odd, c32(4))
        nest = nest_operands(nest_refs)
        (vec,) = acc.registers.flat
        accs = [vector.extract(vec, [], [i]) for i in range(n_acc)]
        zero = arith.constant(f32, 0.0)
        groups = cfg.wg_cols // GROUP
        # all the step's scale loads first (rows g, g + 8 of each m16 tile and group): their
        # global-memory latency then overlaps the step's lookups and MMAs
        rows = [as_idx(arith.addi(row0, c32(16 * i + 8 * e))) for i in range(mt)
                for e in range(2)]
        if cfg.quad_scales:  # lane t loads groups t, t + 4, ...; the quad shares them
            quad = arith.andi(lane, c32(~3))
            cols = [as_idx(arith.divui(arith.muli(arith.addi(t, c32(p)), c32(GROUP)),
                                       c32(blocksize))) for p in range(0, groups, 4)]
            own = [[load_scale(s_ref, nest, r, col) for r in rows] for col in cols]
            scales = [[asm("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;",
                           [v, arith.ori(quad, c32(q % 4))], "f")[0]
                       for v in own[q // 4]] for q in range(groups)]
        else:
            scales = [[load_scale(s_ref, nest, r, as_idx(c32((GROUP * q) // blocksize)))
                       for r in rows] for q in range(groups)]
        for q in range(groups):
            bfrag = []  # per n8 tile: 8 words, step s at (2 s, 2 s + 1)
            for h in range(n8):  # token 8 h + g, clamped to x's last row (unused results)
                tok = arith.minui(arith.addi(g, c32(8 * h)), c32(m - 1))
                xa = arith.addi(xb, arith.addi(arith.muli(tok, c32(x_row)), c32(128 * q)))
                if cfg.x_swap:  # xa is 32-byte aligned
                    xa = arith.ori(xa, first_half)
                first = asm(LOAD_V4_PTX, [xa], "rrrr", side_effects=True)
                second = asm(LOAD_V4_PTX, [arith.xori(xa, c32(16))], "rrrr", side_effects=True)
                if cfg.x_swap:
                    first, second = ([arith.select(swap, b, a) for a, b in zip(first, second)],
                                     [arith.select(swap, a, b) for a, b in zip(first, second)])
                bfrag.append(first + second)
            # the rows' bytes 32 q + 8 t; + 8 w_row (row g + 8) and + 16 w_row (the next m16
            # tile) are multiples of 1024, which the swizzle leaves alone
            wq = arith.addi(wb, c32(32 * q))
            if cfg.swizzle:
                wq = arith.xori(wq, arith.andi(arith.shrui(wq, c32(3)), c32(0x70)))
            for i in range(mt):  # m16 tiles
                wa = arith.addi(wq, c32(16 * i * w_row))
                words = (asm(LOAD_PAIR_PTX, [wa], "rr", side_effects=True)
                         + asm(LOAD_PAIR_PTX, [arith.addi(wa, c32(8 * w_row))], "rr",
                                side_effects=True))
                a = asm(lookup_ptx(), [*words, tb], "r" * 16)
                for h in range(n8):
                    d = [zero] * 4
                    for s in range(4):
                        d = asm(mma_ptx(dtype), [*a[4 * s:4 * s + 4], *bfrag[h][2 * s:2 * s + 2],
                                                  *d], "ffff")
                    for e in range(4):  # d0, d1: row g; d2, d3: row g + 8
                        j = (i * n8 + h) * 4 + e
                        accs[j] = asm("fma.rn.f32 $0, $1, $2, $3;",
                                       [d[e], scales[q][2 * i + e // 2], accs[j]], "f")[0]
        new = vector.from_elements(ir.VectorType.get((n_acc,), f32), accs)
        return fa.FragmentedArray(_registers=np.asarray([new], dtype=object), _layout=layout,
                                  _is_signed=None)

    def finish(ctx, acc, out_ref):
        """Lane (g, t) holds MMA rows g, g + 8 of each m16 tile for tokens 8 h + 2 t + (0, 1):
        stored where the token exists."""
        del ctx
        (vec,) = acc.registers.flat
        store_values([vector.extract(vec, [], [i]) for i in range(n_acc)], out_ref)

    def finish_pair(ctx, acc, red_ref, out_ref):
        """`wg_reduce`: warpgroup 1 puts its partial in shared memory (value i of thread t at
        float 128 i + t: conflict-free), the two meet at a named barrier, and warpgroup 0 adds
        it to its own (same rows, same register order) and stores y. The next tile's table
        barrier keeps warpgroup 1 from writing again before warpgroup 0 has read."""
        del ctx
        (vec,) = acc.registers.flat
        mine = [vector.extract(vec, [], [i]) for i in range(n_acc)]
        tid = arith.remui(mu.thread_idx(), c32(128))
        second = arith.cmpi(arith.CmpIPredicate.uge, mu.thread_idx(), c32(128))
        at = lambda i: [as_idx(arith.addi(tid, c32(128 * i)))]
        branch = scf.IfOp(second)
        with ir.InsertionPoint(branch.then_block):
            for i, v in enumerate(mine):
                memref.store(v, red_ref, at(i))
            scf.yield_([])
        asm(f"bar.sync {TABLE_BARRIER}, 256;", [])
        branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, mu.thread_idx(), c32(128)))
        with ir.InsertionPoint(branch.then_block):
            store_values([arith.addf(v, memref.load(red_ref, at(i))) for i, v in enumerate(mine)],
                         out_ref)
            scf.yield_([])

    def store_values(vals, out_ref):
        warp, g, t, _ = thread()
        out_ty = ir.MemRefType(out_ref.type).element_type
        row0 = first_row(warp, g)
        for h in range(n8):
            for e in range(2):
                token = arith.addi(arith.muli(t, c32(2)), c32(8 * h + e))
                branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, token, c32(m)))
                with ir.InsertionPoint(branch.then_block):
                    for i in range(mt):
                        for half in range(2):
                            v = vals[(i * n8 + h) * 4 + 2 * half + e]
                            if out_ty != ir.F32Type.get():
                                v = arith.truncf(out_ty, v)
                            row = arith.addi(row0, c32(16 * i + 8 * half))
                            memref.store(v, out_ref, [as_idx(token), as_idx(row)])
                    scf.yield_([])

    ref = plgpu.RefType()
    w_ref_type = plgpu.RefType(swizzled_tile_transforms(plgpu)) if cfg.swizzle else ref
    return dict(
        build_table=plgpu.inline_mgpu(arg_types=(ref,) * (4 if smem_code else 2),
                                      return_type=None)(build_table),
        zeros=plgpu.inline_mgpu(arg_types=(), return_type=acc_type)(zeros),
        step=plgpu.inline_mgpu(arg_types=(w_ref_type,) * (2 if two_parts else 1)
                               + (ref,) * (3 + (3 if nested else 0)) + (acc_arg,),
                               return_type=acc_type)(step),
        finish=plgpu.inline_mgpu(arg_types=(acc_arg, ref), return_type=None)(finish),
        finish_pair=plgpu.inline_mgpu(arg_types=(acc_arg, ref, ref),
                                      return_type=None)(finish_pair),
    )


def _call(x, packed, scales, code, nest, *, blocksize: int, cfg: MmaConfig, out_dtype):
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
    f = _pieces(plgpu, m, x.dtype, blocksize, k // blocksize, nest is not None, cfg, smem_code)
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


def matmul_4bit_mgpu_mma(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                         interpret: bool = False, nested=None, config: MmaConfig | None = None):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 64 on a Hopper GPU. x bf16/f16; packed
    (N, K // 2) uint8; absmax (N, K // blocksize) f32 or, with `nested`, the uint8 codes."""
    return pair_table_product(
        "matmul_4bit_mgpu_mma", "matmul_4bit_mma_reference", default_config, shape_problem,
        _call, x, packed, absmax, code, blocksize=blocksize, out_dtype=out_dtype,
        interpret=interpret, nested=nested, config=config)


VARIANTS = (
    Variant(
        name="mgpu_mma_pair_table", op="matmul_4bit", fn=matmul_4bit_mgpu_mma,
        reference=matmul_4bit_mma_reference, supports=supports, accepts_nested=True,
        description="Hopper Mosaic GPU (M <= 64): TMA-streamed packed tiles, each byte looked up "
                    "in a lane-replicated 256-entry table of 16-bit code pairs straight into an "
                    "mma.sync A fragment; fp32 group sums times absmax"),
)
