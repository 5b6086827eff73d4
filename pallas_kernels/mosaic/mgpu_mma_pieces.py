"""The pair-table MMA kernel's (`mgpu_mma_pair_table`) code below Pallas: its PTX programs
(the byte -> A-fragment lookup, the m16n8k16 MMA) and the Mosaic GPU pieces its pipeline calls
through `inline_mgpu` (pair-table build, one step's lookups, MMAs and scales, the stores of y
or its partials, the warpgroups' in-CTA sum). Apart from the kernel module so that it keeps its
configs, reference, emulation and call; the address arithmetic here is modelled in numpy by
`mgpu_mma_layout` for the CPU tests.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.mosaic.mgpu_decode import mosaic_modules
from pallas_kernels.mosaic.mgpu_mma_layout import GROUP, MmaPairTableConfig, acc_count, n_tiles_of
from pallas_kernels.mosaic.mgpu_pair_table import (
    LANES, LOAD_V4_PTX, TABLE_BARRIER, asm, scale_loaders, smem_address)


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
    """The weight tile's shared-memory layout with `MmaPairTableConfig.swizzle`: 8-row tiles of
    whole 128-byte rows (so the bytes stay row-major) under TMA's 128-byte swizzle."""
    return plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)


def pieces(plgpu, m: int, dtype, blocksize: int, cols: int, nested: bool, cfg: MmaPairTableConfig,
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
