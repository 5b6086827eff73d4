"""`mgpu_gemv_pair_table`: 4-bit GEMV on Hopper (Mosaic GPU) for M <= 2, y = x @ dequant(W).T
from a byte-pair table.

Why: at M = 1 the Triton GEMV (`gemv_block_scaled`) moves the weight well below the copy
bandwidth, bound by its decode (one fp32 table gather per nibble). Here a thread turns each
packed byte (two weights) into both fp32 codes with one shared-memory load from a 256-entry
table of code pairs, (code[b >> 4], code[b & 15]), and multiplies them into x by two fused
multiply-adds:

    per byte: prmt (byte to the table offset), add (the lane's column), ld.shared.v2.f32, 2 fma

about 2.5 instructions per weight on paper, plus index, x-conversion and pipeline-wait work.
The table is replicated once per lane, laid out so that lane l only ever reads bank pair
(2l, 2l + 1) mod 32: every lookup of a warp is conflict-free whatever
the bytes are (a 256-entry table shared by the lanes puts 3-4 of 32 random lookups in one bank).
That costs 256 x 32 x 8 = 64 KiB of shared memory per CTA, written once per tile (each compute
warpgroup its share, then a named barrier).

The sums follow the block structure (as `gemv_block_scaled`): per scale block,
y += absmax * sum(x * code), all in fp32; the weight is never rounded to x's dtype. Oracle:
`matmul_4bit_gemv_reference`.

Layout: a CTA takes 256 weight rows (128 per compute warpgroup) of one K split; a memory
warpgroup streams (256 rows x 128 bytes) tiles of the packed weight and (M x 256) tiles of x
with TMA. Thread t of a compute warpgroup takes the 16-byte chunk c = t % 8 (32 columns, inside
one scale block for blocksize >= 32) of rows t // 8 + 16 j, j = 0..7: the 8 lanes of a
quarter-warp read one row's 128 contiguous bytes, so the tile loads are conflict-free too, and a
thread's 32 x values serve all its 8 rows. Each step a thread loads its 8 rows' scales from
global memory and de-nests them for double quant (bitsandbytes' two roundings, as the wgmma
kernel); `GemvPairTableConfig(staged_scales=True)` instead stages the tile's scales into shared
memory first (coalesced), measured no faster. At the end of a tile the 8 lanes of a row sum their
partials by shuffles; with K splits the fp32 partials are summed by XLA. `auto` runs it for
the shapes `mgpu_mma_pair_table`, faster at M = 1 too, declines (docs/kernels.md).

Hopper only (sm_90, TMA, inline PTX), no interpret mode. CPU checks: `emulate` re-runs the
kernel's thread mapping, table layout and block sums in numpy against the reference, the PTX
word program runs in the tests' PTX interpreter, and the kernel lowers for CUDA on CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.reference.fourbit import matmul_4bit_gemv_reference, supports_4bit
from pallas_kernels.mosaic.mgpu_decode import mosaic_modules
from pallas_kernels.mosaic.mgpu_pair_table import (
    LANES, LOAD_V4_PTX, TABLE_BARRIER, asm, pair_table_product, scale_loaders, smem_address)
from pallas_kernels.mosaic.mgpu_pipeline import (
    FOUR_WG_REGISTERS, SMEM_LIMIT, SMS, compute_registers_held, grid_fills, sm_count,
    warp_specialized)
from pallas_kernels.registry import Variant

reference = matmul_4bit_gemv_reference

MAX_M = 2
TILE_K = 256  # weight columns a step: 128 packed bytes a row
CTA_ROWS = 256  # weight rows a CTA, shared by its compute warpgroups
CHUNK = 32  # weight columns of one thread's 16-byte chunk
TABLE_FLOATS = 256 * LANES * 2  # (byte, lane) -> (code[hi], code[lo]), 64 KiB


@dataclasses.dataclass(frozen=True)
class GemvPairTableConfig:
    k_splits: int = 1  # K ranges computed by separate CTAs; fp32 partials summed by XLA
    stages: int = 2  # pipeline depth of the memory warpgroup (32 KiB of weight a stage)
    # compute warpgroups: 2 (128 rows, 8 a thread) or 4 (64 rows, 4 a thread). 4 doubles the
    # warps that hide latency but halves the rows one thread's 32 x values serve; measured
    # slower (docs/kernels.md)
    wgs: int = 2
    # True: the tile's scales staged (de-nested) into shared memory at the start of a tile.
    # False: each step loads and de-nests its own scales from global memory: no slower, and
    # faster with few steps a CTA, where the staging is one more round trip before the first
    # (chosen by measurement: docs/kernels.md)
    staged_scales: bool = False
    # True: a step loads the 16-byte chunks of all its rows first, then runs word q of every
    # row before word q + 1 (the rows' fma chains are independent: more loads in flight per
    # warp), and applies the scales last. False: row by row. Same sums in the same order;
    # measured no faster (docs/kernels.md)
    interleave: bool = False

    @property
    def wg_rows(self) -> int:
        return CTA_ROWS // self.wgs

    @property
    def rows_per_thread(self) -> int:
        return self.wg_rows // 16


def smem_bytes(m: int, k: int, blocksize: int, cfg: GemvPairTableConfig) -> int:
    """Shared memory of the kernel: the pair table, the pipeline's weight and x stages and the
    tile's staged scales, each rounded up to Mosaic's 1024-byte alignment."""
    up = lambda b: -(-b // 1024) * 1024
    split_cols = k // cfg.k_splits // blocksize
    staged = cfg.wgs * cfg.wg_rows * scale_stride(split_cols) * 4 if cfg.staged_scales else 0
    return (up(TABLE_FLOATS * 4) + up(cfg.stages * CTA_ROWS * TILE_K // 2)
            + up(cfg.stages * m * TILE_K * 2) + up(staged))


def scale_stride(split_cols: int) -> int:
    """Floats per staged scale row: >= split_cols and 4 mod 8, so that the 16 (row, block)
    scales a warp reads in a step (4 consecutive rows x 4 blocks) fall in 16 banks."""
    return split_cols + (4 - split_cols) % 8


def default_config(m: int, n: int, k: int, blocksize: int) -> GemvPairTableConfig:
    """K splits: the most that divide the K steps and keep the CTAs within one wave of SMs;
    a 2-stage pipeline (chosen by measurement: docs/kernels.md): two 32 KiB stages keep enough
    bytes in flight, and a smaller carve-out leaves more L1 for the scale loads. `m` is unused
    (kept for the signature the other kernels' defaults have)."""
    del m
    n_tiles, k_iters = n // CTA_ROWS, k // TILE_K
    splits = 1
    for d in range(1, k_iters + 1):
        if k_iters % d == 0 and n_tiles * d <= SMS and (k // d) % blocksize == 0:
            splits = d
    return GemvPairTableConfig(k_splits=splits, stages=2)


def shape_problem(m: int, n: int, k: int, blocksize: int, cfg: GemvPairTableConfig) -> str | None:
    if not 1 <= m <= MAX_M:
        return f"M ({m}) must be 1..{MAX_M}"
    if n % CTA_ROWS:
        return f"N ({n}) must be a multiple of {CTA_ROWS}"
    if cfg.k_splits < 1 or k % (TILE_K * cfg.k_splits):
        return f"K ({k}) must be a multiple of {TILE_K} x k_splits ({cfg.k_splits})"
    if blocksize % CHUNK:
        return f"blocksize ({blocksize}) must be a multiple of {CHUNK}"
    if (k // cfg.k_splits) % blocksize:
        return f"each K split ({k // cfg.k_splits} columns) must hold whole scale blocks"
    if cfg.wgs not in (2, 4):
        return f"wgs must be 2 or 4, got {cfg.wgs}"
    if not 2 <= cfg.stages <= 4:
        return f"stages must be 2..4, got {cfg.stages}"
    if smem_bytes(m, k, blocksize, cfg) > SMEM_LIMIT:
        return (f"{cfg} needs {smem_bytes(m, k, blocksize, cfg)} bytes of shared memory, more "
                f"than {SMEM_LIMIT}: fewer stages or more K splits")
    return None


def supports(m: int, n: int, k: int, blocksize: int) -> bool:
    """Shapes the default config takes (`shape_problem` holds every condition) and whose grid
    fills the GPU (`grid_fills`)."""
    if not supports_4bit(m, n, k, blocksize):
        return False
    cfg = default_config(m, n, k, blocksize)
    return (shape_problem(m, n, k, blocksize, cfg) is None
            and grid_fills(n // CTA_ROWS, k // TILE_K, cfg.k_splits))


# --------------------------------------------------------------------------- the PTX programs
def word_ptx(m: int) -> str:
    """One 32-bit word of 4 packed bytes (8 weights) of one row, for m rows of x.
    $0..$(2m-1): the running even / odd sums of each x row (tied to the last 2m inputs);
    then the word, the lane's table address, and per x row its 4 even then 4 odd values.
    (One prmt putting the byte into bits 8-15 of the lane's address would save the add, but
    needs the table 64 KiB-aligned, and Mosaic's shared memory does not start at such an
    address.)"""
    n_out = 2 * m
    w, tb = f"${n_out}", f"${n_out + 1}"
    xv = lambda r, i: f"${n_out + 2 + 8 * r + i}"  # i < 4: even column of byte i; else odd
    lines = ["{", ".reg .b32 z, a<4>;", ".reg .f32 h<4>, l<4>;", "mov.b32 z, 0;"]
    # byte i -> i << 8: the entry's offset (256 bytes an entry), plus the lane's address
    lines += [f"prmt.b32 a{i}, {w}, z, 0x44{i}4;" for i in range(4)]
    lines += [f"add.u32 a{i}, a{i}, {tb};" for i in range(4)]
    for i in range(4):
        lines.append(f"ld.shared.v2.f32 {{h{i}, l{i}}}, [a{i}];")
    for r in range(m):
        for i in range(4):  # the high nibble is the even column (bitsandbytes' order)
            lines.append(f"fma.rn.f32 ${2 * r}, {xv(r, i)}, h{i}, ${2 * r};")
            lines.append(f"fma.rn.f32 ${2 * r + 1}, {xv(r, 4 + i)}, l{i}, ${2 * r + 1};")
    lines.append("}")
    return "\n".join(lines)


def x_ptx(dtype) -> str:
    """16 bytes of x (8 values) at shared address $8 -> $0..$7 = f32 of values 0..7."""
    lines = ["{", ".reg .b32 w<4>;", "ld.shared.v4.u32 {w0, w1, w2, w3}, [$8];"]
    if jnp.dtype(dtype) == jnp.bfloat16:
        for i in range(4):  # value 2i in the low half, 2i + 1 in the high half
            lines.append(f"shl.b32 ${2 * i}, w{i}, 16;")
            lines.append(f"and.b32 ${2 * i + 1}, w{i}, 0xffff0000;")
    else:
        lines.append(".reg .b16 p, q;")
        lines.append(".reg .f32 f;")
        for i in range(4):
            lines.append(f"mov.b32 {{p, q}}, w{i};")
            lines.append("cvt.f32.f16 f, p;")
            lines.append(f"mov.b32 ${2 * i}, f;")
            lines.append("cvt.f32.f16 f, q;")
            lines.append(f"mov.b32 ${2 * i + 1}, f;")
    lines.append("}")
    return "\n".join(lines)


STORE_PAIR_PTX = "st.shared.v2.f32 [$0], {$1, $2};"


# --------------------------------------------------------------------------- numpy emulation
def table_offset(byte, lane):
    """Byte offset of the table entry of `byte` for `lane`: the word program's prmt + add."""
    return (np.asarray(byte, np.int64) << 8) + 8 * np.asarray(lane, np.int64)


def fma_f32(a, b, c):
    """fma.rn.f32 in numpy: the product of two float32 is exact in float64; one rounding of the
    sum (a double rounding only where the float64 sum itself rounds: not for these sizes)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)
            + np.asarray(c, np.float64)).astype(np.float32)


def emulate(x, packed, absmax, code, *, blocksize: int,
            cfg: GemvPairTableConfig = GemvPairTableConfig()):
    """The kernel's arithmetic in numpy, in its order: for each row, K split, step and chunk
    c (the thread 8 (row % 16) + c of the row's warpgroup), the table entries of the chunk's
    16 bytes (looked up at `table_offset`), two fma chains (even and odd columns), their sum
    times the block's absmax added to the thread's partial; the 8 partials of a row summed by
    butterfly shuffles (1, 2, 4); K splits summed last. x (M, K) float32 -> (M, N) float32."""
    x = np.asarray(x, np.float32)
    packed = np.asarray(packed, np.uint8)
    absmax = np.asarray(absmax, np.float32)
    code = np.asarray(code, np.float32)
    m, k = x.shape
    n = packed.shape[0]
    table = np.zeros((TABLE_FLOATS,), np.float32)
    b, lane = np.meshgrid(np.arange(256), np.arange(LANES), indexing="ij")
    off = table_offset(b, lane) // 4
    table[off], table[off + 1] = code[b >> 4], code[b & 15]
    rows = np.arange(n)
    k_per = k // cfg.k_splits
    parts = []
    for split in range(cfg.k_splits):
        partial = np.zeros((m, n, 8), np.float32)  # per thread c of each row
        for step in range(k_per // TILE_K):
            for c in range(8):
                col0 = split * k_per + step * TILE_K + c * CHUNK
                scale = absmax[:, col0 // blocksize]  # (n,)
                lanes = (8 * (rows % 16) + c) % LANES
                byte = packed[:, col0 // 2:col0 // 2 + CHUNK // 2].astype(np.int64)  # (n, 16)
                entry = table_offset(byte, lanes[:, None]) // 4
                hi, lo = table[entry], table[entry + 1]
                even = np.zeros((m, n), np.float32)
                odd = np.zeros((m, n), np.float32)
                for j in range(CHUNK // 2):
                    even = fma_f32(x[:, None, col0 + 2 * j], hi[None, :, j], even)
                    odd = fma_f32(x[:, None, col0 + 2 * j + 1], lo[None, :, j], odd)
                partial[:, :, c] = fma_f32((even + odd).astype(np.float32), scale[None],
                                           partial[:, :, c])
        for d in (1, 2, 4):  # shfl.bfly over the row's 8 lanes
            partial = (partial + partial[:, :, np.arange(8) ^ d]).astype(np.float32)
        parts.append(partial[:, :, 0])
    return np.sum(np.stack(parts), axis=0, dtype=np.float32)  # XLA's order may differ


# --------------------------------------------------------------------------- Mosaic pieces
def _pieces(plgpu, m: int, dtype, blocksize: int, cols: int, split_cols: int, nested: bool,
            cfg: GemvPairTableConfig):
    """The Pallas functions the kernel calls: table build, scale staging, zero accumulators,
    one step, and the tile's epilogue."""
    _, _, _, ir, arith, memref, fa, mu = mosaic_modules()
    from jax._src.lib.mlir.dialects import vector
    rpt, wg_rows = cfg.rows_per_thread, cfg.wg_rows
    s_stride = scale_stride(split_cols)
    shape = (128 * rpt * m,)
    layout = fa.WGStridedFragLayout(shape, rpt * m)
    acc_arg = plgpu.Layout.WG_STRIDED(shape, vec_size=rpt * m)
    acc_type = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=acc_arg)
    i32 = lambda: ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32(), v)
    cidx = lambda v: arith.constant(ir.IndexType.get(), v)
    as_idx = lambda v: arith.index_cast(ir.IndexType.get(), v)

    def thread():
        """(thread in the warpgroup, lane, chunk c = tid % 8, first row tid // 8)"""
        tid = arith.remui(mu.thread_idx(), c32(128))
        return tid, arith.remui(tid, c32(LANES)), arith.remui(tid, c32(8)), arith.divui(tid, c32(8))

    def build_table(ctx, table_ref, code_ref):
        """Compute warpgroup g writes bytes 4 i + t // 32 (i in its share of 0..63) for lane
        t % 32, then all compute warpgroups meet at a named barrier. A later tile rewrites the
        same values, so a warpgroup still reading the table sees no change."""
        del ctx
        tid, lane, _, _ = thread()
        wg = arith.divui(mu.thread_idx(), c32(128))
        quarter = arith.divui(tid, c32(LANES))  # 0..3
        per = 64 // cfg.wgs  # bytes 4 i + quarter for i in [wg * per, (wg + 1) * per)
        hi = [memref.load(code_ref, [as_idx(arith.addi(arith.muli(wg, c32(per // 4)), c32(v)))])
              for v in range(per // 4)]
        lo = [memref.load(code_ref, [as_idx(arith.addi(quarter, c32(4 * q)))]) for q in range(4)]
        base = arith.addi(arith.addi(smem_address(table_ref), arith.muli(lane, c32(8))),
                          arith.addi(arith.muli(quarter, c32(256)),
                                     arith.muli(wg, c32(1024 * per))))
        for i in range(per):
            asm(STORE_PAIR_PTX, [arith.addi(base, c32(1024 * i)), hi[i // 4], lo[i % 4]])
        asm(f"bar.sync {TABLE_BARRIER}, {128 * cfg.wgs};", [])

    nest_operands, load_scale = scale_loaders(nested, cols)

    def stage_scales(ctx, src_ref, *rest):
        """This warpgroup's scales of the tile (wg_rows x split_cols, global) into shared
        memory, row-major with `s_stride` floats a row: element e = t + 128 i is (row
        e // split_cols, column e % split_cols), so a warp's loads are coalesced and its
        stores nearly conflict-free. (Row-per-thread loads, 32 rows a warp instruction, are
        slower.)"""
        del ctx
        *nest_refs, dst_ref = rest
        tid, *_ = thread()
        total = wg_rows * split_cols
        mu.warpgroup_barrier()  # the previous tile's steps are done reading dst
        nest = nest_operands(nest_refs)
        vals = []
        for i in range(-(-total // 128)):
            e = arith.minui(arith.addi(tid, c32(128 * i)), c32(total - 1))  # tail: repeats
            row = as_idx(arith.divui(e, c32(split_cols)))
            col = as_idx(arith.remui(e, c32(split_cols)))
            vals.append((row, col, load_scale(src_ref, nest, row, col)))
        for row, col, v in vals:
            memref.store(v, dst_ref, [arith.addi(arith.muli(row, cidx(s_stride)), col)])
        mu.warpgroup_barrier()

    def zeros(ctx):
        del ctx
        return fa.FragmentedArray.splat(arith.constant(ir.F32Type.get(), 0.0), shape, layout)

    def step(ctx, w_ref, x_ref, table_ref, s_ref, *rest):
        """One pipeline step: the thread's rows t // 8 + 16 j, chunk c of the step's columns.
        s_ref: the staged scales from this step's first column, or without staging the step's
        (wg_rows, step columns) window of the scales in global memory (then the nested refs)."""
        del ctx
        *nest_refs, acc = rest
        f32 = ir.F32Type.get()
        tid, lane, c, r0 = thread()
        tb = arith.addi(smem_address(table_ref), arith.muli(lane, c32(8)))
        wb = arith.addi(smem_address(w_ref),
                        arith.addi(arith.muli(r0, c32(TILE_K // 2)), arith.muli(c, c32(16))))
        xb = arith.addi(smem_address(x_ref), arith.muli(c, c32(CHUNK * 2)))
        blk = (arith.divui(arith.muli(c, c32(CHUNK)), c32(blocksize)) if blocksize < TILE_K
               else c32(0))
        if cfg.staged_scales:
            sb = arith.addi(smem_address(s_ref),
                            arith.muli(arith.addi(arith.muli(r0, c32(s_stride)), blk), c32(4)))
            scales = [asm("ld.shared.f32 $0, [$1];", [arith.addi(sb, c32(64 * s_stride * j))],
                           "f", side_effects=True)[0] for j in range(rpt)]
        else:  # all the step's scale loads first: their latency overlaps the x and row work
            nest = nest_operands(nest_refs)
            scales = [load_scale(s_ref, nest, as_idx(arith.addi(r0, c32(16 * j))), as_idx(blk))
                      for j in range(rpt)]

        def x_word(q):
            """x's 8 columns of word q per x row, as word_ptx takes them: 4 even, 4 odd."""
            out = []
            for r in range(m):
                v = [arith.bitcast(f32, w) for w in asm(
                    x_ptx(dtype), [arith.addi(xb, c32(r * TILE_K * 2 + 16 * q))], "r" * 8,
                    side_effects=True)]
                out += v[0::2] + v[1::2]
            return out

        def row_words(j):
            return asm(LOAD_V4_PTX, [arith.addi(wb, c32(16 * j * TILE_K // 2))], "rrrr",
                        side_effects=True)

        program = word_ptx(m)
        zero = arith.constant(f32, 0.0)
        (vec,) = acc.registers.flat
        accs = [vector.extract(vec, [], [i]) for i in range(rpt * m)]

        def scale_row(j, sums):
            """acc += absmax * (even + odd) of row j, per x row."""
            for r in range(m):
                block_sum = arith.addf(sums[2 * r], sums[2 * r + 1])
                i = r * rpt + j
                accs[i] = asm("fma.rn.f32 $0, $1, $2, $3;", [block_sum, scales[j], accs[i]],
                               "f")[0]

        if cfg.interleave:  # all rows' chunks, then word q of every row (independent chains)
            words = [row_words(j) for j in range(rpt)]
            sums = [[zero] * (2 * m) for _ in range(rpt)]  # row j: even / odd sum per x row
            for q in range(4):
                xq = x_word(q)
                for j in range(rpt):
                    sums[j] = asm(program, [words[j][q], tb, *xq, *sums[j]], "f" * (2 * m),
                                   tied=2 * m)
            for j in range(rpt):
                scale_row(j, sums[j])
        else:  # x first (32 columns per x row), then row by row
            xw = [x_word(q) for q in range(4)]
            for j in range(rpt):
                words, sums = row_words(j), [zero] * (2 * m)
                for q in range(4):
                    sums = asm(program, [words[q], tb, *xw[q], *sums], "f" * (2 * m),
                                tied=2 * m)
                scale_row(j, sums)
        new = vector.from_elements(ir.VectorType.get((rpt * m,), f32), accs)
        return fa.FragmentedArray(_registers=np.asarray([new], dtype=object), _layout=layout,
                                  _is_signed=None)

    def finish(ctx, acc, out_ref):
        """Sum each row over its 8 lanes; lane c stores row t // 8 + 16 (c % rpt) of each x
        row (with 4 rows a thread, lanes c and c + 4 store the same value)."""
        del ctx
        tid, lane, c, r0 = thread()
        (vec,) = acc.registers.flat
        vals = [vector.extract(vec, [], [i]) for i in range(rpt * m)]
        for d in (1, 2, 4):
            vals = [arith.addf(v, mu.shfl_bfly(v, d)) for v in vals]
        j_c = arith.remui(c, c32(rpt))
        row = as_idx(arith.addi(r0, arith.muli(j_c, c32(16))))
        out_ty = ir.MemRefType(out_ref.type).element_type
        for r in range(m):
            pick = vals[r * rpt]
            for j in range(1, rpt):
                pick = arith.select(arith.cmpi(arith.CmpIPredicate.eq, j_c, c32(j)),
                                    vals[r * rpt + j], pick)
            if out_ty != ir.F32Type.get():
                pick = arith.truncf(out_ty, pick)
            memref.store(pick, out_ref, [cidx(r), row])

    ref = plgpu.RefType()
    n_nest = 3 if nested else 0
    return dict(

        build_table=plgpu.inline_mgpu(arg_types=(ref, ref), return_type=None)(build_table),
        stage_scales=plgpu.inline_mgpu(arg_types=(ref,) * (2 + n_nest),
                                       return_type=None)(stage_scales),
        zeros=plgpu.inline_mgpu(arg_types=(), return_type=acc_type)(zeros),
        step=plgpu.inline_mgpu(arg_types=(ref,) * (4 + (0 if cfg.staged_scales else n_nest))
                               + (acc_arg,), return_type=acc_type)(step),
        finish=plgpu.inline_mgpu(arg_types=(acc_arg, ref), return_type=None)(finish),
    )


def _call(x, packed, scales, code, nest, *, blocksize: int, cfg: GemvPairTableConfig, out_dtype):
    """The kernel: x (M, K) 16-bit, packed (N, K / 2) uint8, scales (N, K / blocksize) f32 or
    with `nest` = (nested_code, nested_absmax, offset (1,)) their uint8 codes."""
    _, pl, plgpu, *_ = mosaic_modules()
    m, k = x.shape
    n = packed.shape[0]
    splits, wg_rows = cfg.k_splits, cfg.wg_rows
    k_per = k // splits
    k_iters = k_per // TILE_K
    n_tiles = n // CTA_ROWS
    split_cols = k_per // blocksize
    s_len = wg_rows * scale_stride(split_cols)
    step_cols = max(1, TILE_K // blocksize)
    out_dtype = jnp.float32 if splits > 1 else out_dtype
    f = _pieces(plgpu, m, x.dtype, blocksize, k // blocksize, split_cols, nest is not None, cfg)
    pipeline, allocate = warp_specialized(
        plgpu, pl, grid=(k_iters,), num_compute_wgs=cfg.wgs, depth=cfg.stages,
        in_specs=[plgpu.BlockSpec((CTA_ROWS, TILE_K // 2), lambda kk: (0, kk)),
                  plgpu.BlockSpec((m, TILE_K), lambda kk: (0, kk))])

    def matmul_4bit_mgpu_gemv_kernel(x_gmem, w_gmem, s_gmem, code_gmem, *rest, table_smem,
                                     scale_smem=None):
        *nest_gmem, out_gmem = rest

        @functools.partial(pl.run_scoped, allocs=allocate(w_gmem, x_gmem),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_tiles * splits,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                split = lin % splits
                ni = lin // splits
                row0 = ni * CTA_ROWS + wg * wg_rows
                dst = (out_gmem.at[split] if splits > 1 else out_gmem).at[:, pl.ds(row0, wg_rows)]
                s_tile = s_gmem.at[pl.ds(row0, wg_rows), pl.ds(split * split_cols, split_cols)]

                def ctx(run):
                    if cfg.staged_scales:
                        f["stage_scales"](s_tile, *nest_gmem, scale_smem.at[wg])
                    f["build_table"](table_smem, code_gmem)
                    f["finish"](run(f["zeros"]()), dst)

                def body(indices, w_smem, x_smem, acc):
                    (kk,) = indices
                    col = kk * TILE_K // blocksize  # the step's first scale column in the split
                    if cfg.staged_scales:
                        s_step = (scale_smem.at[wg].at[pl.ds(col, s_len - split_cols)],)
                    else:
                        s_step = (s_tile.at[:, pl.ds(col, step_cols)], *nest_gmem)
                    return f["step"](w_smem.at[pl.ds(wg * wg_rows, wg_rows)], x_smem,
                                     table_smem, *s_step, acc)

                pipeline(body, ctx)(
                    w_gmem.at[pl.ds(ni * CTA_ROWS, CTA_ROWS), pl.ds(split * k_per // 2, k_per // 2)],
                    x_gmem.at[:, pl.ds(split * k_per, k_per)], allocations=allocs)

    out_shape = (splits, m, n) if splits > 1 else (m, n)
    kernel = plgpu.kernel(
        matmul_4bit_mgpu_gemv_kernel,  # the name Nsight Compute shows
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(sm_count(),),
        grid_names=("sm",),
        num_threads=cfg.wgs + 1,  # the compute warpgroups and the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            table_smem=plgpu.SMEM((TABLE_FLOATS,), jnp.float32),
            **({"scale_smem": plgpu.SMEM((cfg.wgs, s_len), jnp.float32)}
               if cfg.staged_scales else {})),
    )
    with compute_registers_held(FOUR_WG_REGISTERS if cfg.wgs == 4 else None):
        y = kernel(x, packed, scales, code, *(nest or ()))
    return jnp.sum(y, axis=0) if splits > 1 else y


def mgpu_gemv_pair_table(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                         interpret: bool = False, nested=None,
                         config: GemvPairTableConfig | None = None):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 2 on a Hopper GPU. x bf16/f16; packed
    (N, K // 2) uint8; absmax (N, K // blocksize) f32 or, with `nested`, the uint8 codes."""
    return pair_table_product(
        "mgpu_gemv_pair_table", "gemv_block_scaled or the reference", default_config,
        shape_problem, _call, x, packed, absmax, code, blocksize=blocksize, out_dtype=out_dtype,
        interpret=interpret, nested=nested, config=config)


VARIANTS = (
    Variant(
        name="mgpu_gemv_pair_table", op="matmul_4bit", fn=mgpu_gemv_pair_table,
        platform="sm90", interpret=False,
        reference=matmul_4bit_gemv_reference, supports=supports, accepts_nested=True,
        description="Hopper Mosaic GPU GEMV (M <= 2): TMA-streamed packed tiles, each byte's two "
                    "fp32 codes from one conflict-free shared-memory load of a lane-replicated "
                    "256-entry pair table, two fma per byte, fp32 block sums times absmax "
                    "(de-nested in-kernel)",
        numerics="fp32_weight", status="default", config_type=GemvPairTableConfig,
        default_config=default_config),
)
