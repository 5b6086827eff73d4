"""The in-register 4-bit decode of the Hopper kernels (`mgpu_decoded_wgmma`,
`mgpu_decoded_wgmma_t`): per-row tables of round(code * absmax) and a byte-permute lookup that
turns each 32-bit word of 8 packed codes into four 16-bit pairs of a wgmma operand, as inline PTX
inside Mosaic GPU.

Here: the two PTX programs (`_LOOKUP_PROGRAM` run through `nibble_lookup.program_ptx`, and
`table_ptx`), their jnp twins (`emulate_lookup_words`, `emulate_table_words`) that the CPU tests
check them against, `decode_fn`, the lane-level Mosaic function both kernels call, the per-tile
loads it works from (`code_loader`: the code table into registers; `scale_denester`: scales
de-nested into shared memory, forward kernel only) and `DENEST_PTX`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import nibble_lookup

# --------------------------------------------------------------------------- the decode program
# One 32-bit word r of 8 packed codes (bytes b0..b3, each hi nibble = even column) and the table
# words L0..L3, H0..H3 (low / high bytes of the 16 entries, entry 4i + j in byte j of Li / Hi)
# -> o0..o3, o_b = (code[hi(b_b)] in bits 0-15, code[lo(b_b)] in bits 16-31).
# Two bytes at a time: the selector s holds the 3-bit indices of (lo, hi) of b0 then b1 in its
# four nibbles (r & 0x7777), prmt(L0, L1, s) / prmt(L2, L3, s) look up those codes in entries
# 0-7 / 8-15, and a lop3 picks per byte by bit 3 of the code (sign bits gathered by one more
# prmt of r and r << 4 in sign-replicating mode).
_LOOKUP_PROGRAM = (
    ("shl", "t", "r", 4),
    ("and", "sa", "r", 0x7777),
    ("shr", "sb", "r", 16),
    ("and", "sb", "sb", 0x7777),
    ("prmt", "ma", "r", "t", 0x9D8C),  # sign bits of lo0, hi0, lo1, hi1 -> byte masks
    ("prmt", "mb", "r", "t", 0xBFAE),  # lo2, hi2, lo3, hi3
) + tuple(
    op
    for g in "ab"
    for op in (
        ("prmt", "x", "L0", "L1", f"s{g}"), ("prmt", "y", "L2", "L3", f"s{g}"),
        ("lop3", f"l{g}", "x", "y", f"m{g}", 0xD8),  # (x & ~m) | (y & m)
        ("prmt", "x", "H0", "H1", f"s{g}"), ("prmt", "y", "H2", "H3", f"s{g}"),
        ("lop3", f"h{g}", "x", "y", f"m{g}", 0xD8),
        # l = (L[lo0], L[hi0], L[lo1], L[hi1]) -> (L[hi0], H[hi0], L[lo0], H[lo0]) etc.
        ("prmt", f"o{'0' if g == 'a' else '2'}", f"l{g}", f"h{g}", 0x4051),
        ("prmt", f"o{'1' if g == 'a' else '3'}", f"l{g}", f"h{g}", 0x6273),
    )
)
_TABLE_WORDS = ("L0", "L1", "L2", "L3", "H0", "H1", "H2", "H3")
_OUTPUTS = ("o0", "o1", "o2", "o3")


LOOKUP_PTX = nibble_lookup.program_ptx(
    _LOOKUP_PROGRAM,
    {"r": "$4", **{w: f"${5 + i}" for i, w in enumerate(_TABLE_WORDS)}},
    _OUTPUTS, prefix="q_")


def table_ptx(dtype) -> str:
    """PTX for one row's table, shared by the 4 lanes of a quad (they hold the same rows):
    $8 = absmax (f32), $9..$12 = codes 4q..4q+3 (f32, q = lane % 4) -> $0..$7 = L0..L3, H0..H3
    of round(code * absmax) in dtype (bf16 or f16), one fp32 product and one rounding each.
    Each lane makes its four entries' L_q and H_q words, and eight quad shuffles gather them:
    16 instructions a table where a lane alone needs 32 (and 16 code loads instead of 4)."""
    cvt = {"bfloat16": "cvt.rn.bf16x2.f32", "float16": "cvt.rn.f16x2.f32"}[jnp.dtype(dtype).name]
    lines = ["{", ".reg .f32 p<4>;", ".reg .b32 wa, wb, l, h;"]
    lines += [f"mul.rn.f32 p{i}, ${9 + i}, $8;" for i in range(4)]
    # cvt d, a, b puts a in the upper half: wa = (entry 4q, 4q + 1), wb = (4q + 2, 4q + 3)
    lines += [f"{cvt} wa, p1, p0;", f"{cvt} wb, p3, p2;",
              "prmt.b32 l, wa, wb, 0x6420;", "prmt.b32 h, wa, wb, 0x7531;"]
    for j in range(4):  # 0x1c1f: segments of 4 lanes, source lane = quad base + j
        lines.append(f"shfl.sync.idx.b32 ${j}, l, {j}, 0x1c1f, 0xffffffff;")
        lines.append(f"shfl.sync.idx.b32 ${4 + j}, h, {j}, 0x1c1f, 0xffffffff;")
    lines.append("}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- jnp emulation
def emulate_lookup_words(r, table_words):
    """Run `_LOOKUP_PROGRAM` on uint32 words r (any shape) with table_words (8,) uint32:
    returns the four output words o0..o3 (uint32, shaped like r)."""
    regs = {"r": jnp.asarray(r, jnp.uint32)}
    regs.update({w: table_words[i] for i, w in enumerate(_TABLE_WORDS)})
    regs = nibble_lookup.run_program(_LOOKUP_PROGRAM, regs)
    return tuple(regs[o] for o in _OUTPUTS)


def emulate_table_words(absmax, code, dtype):
    """`table_ptx`'s result: (..., 8) uint32 words of round(code * absmax) in dtype."""
    vals = (code.astype(jnp.float32) * jnp.asarray(absmax, jnp.float32)[..., None]).astype(dtype)
    bits = lax.bitcast_convert_type(vals, jnp.uint16).astype(jnp.uint32)  # (..., 16)
    planes = jnp.stack([bits & 0xFF, bits >> 8], axis=-2)  # (..., 2, 16)
    planes = planes.reshape(*planes.shape[:-1], 4, 4)
    shifts = jnp.asarray([0, 8, 16, 24], jnp.uint32)
    words = jnp.sum(planes << shifts, axis=-1, dtype=jnp.uint32)  # (..., 2, 4)
    return words.reshape(*words.shape[:-2], 8)


# --------------------------------------------------------------------------- Mosaic GPU pieces
def mosaic_modules():
    """The Mosaic GPU modules, imported on first use (CPU-only jax versions may lack them)."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    return mgpu, pl, plgpu, ir, arith, memref, fa, mu


def inline_asm(ptx: str, args, n_out: int, *, convergent: bool = False):
    """Inline PTX with n_out 32-bit results (`llvm.inline_asm` directly: jax 0.10's Mosaic has
    no `utils.inline_ptx`). `convergent` (the quad shuffles) where this jaxlib can say it."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    i32 = ir.IntegerType.get_signless(32)
    ret = llvm.StructType.get_literal([i32] * n_out)
    constraints = ",".join(["=r"] * n_out + ["f" if a.type == ir.F32Type.get() else "r"
                                             for a in args])
    extra = {"convergent": True} if convergent and hasattr(llvm.InlineAsmOp, "convergent") else {}
    res = llvm.inline_asm(ret, list(args), ptx, constraints, has_side_effects=False, **extra)
    return [llvm.extractvalue(i32, res, [i]) for i in range(n_out)]


# The code table as each thread holds it (`code_loader`, `decode_fn`): codes 4q .. 4q + 3 of the
# quad lane q, one vector of 4 floats a thread, as a (512,) array in a strided layout.
CODES_SHAPE = (512,)


def codes_layout(plgpu):
    """The Pallas layout of `code_loader`'s array."""
    return plgpu.Layout.WG_STRIDED(CODES_SHAPE, vec_size=4)


def code_loader(plgpu):
    """Pallas function: the f32 code ref (16,) in global memory -> the (512,) array of each
    thread's 4 table codes (codes 4q .. 4q + 3, q = lane % 4). Loaded once per tile and carried
    through the K loop in registers: a per-step shared-memory block of the table needs an XLA
    broadcast kernel per call, and loading it from global memory in every step puts the load's
    latency in each step."""
    _, _, _, ir, arith, memref, fa, mu = mosaic_modules()
    from jax._src.lib.mlir.dialects import vector

    def load(ctx, code_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        idx = ir.IndexType.get()
        c32 = lambda v: arith.constant(i32, v)
        quad = arith.remui(mu.thread_idx(), c32(4))
        vals = [memref.load(code_ref, [arith.index_cast(idx, arith.addi(
            arith.muli(quad, c32(4)), c32(i)))]) for i in range(4)]
        vec = vector.from_elements(ir.VectorType.get((4,), ir.F32Type.get()), vals)
        layout = fa.WGStridedFragLayout(CODES_SHAPE, 4)
        return fa.FragmentedArray(_registers=np.asarray([vec], dtype=object), _layout=layout,
                                  _is_signed=None)

    return plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct(CODES_SHAPE, jnp.float32, layout=codes_layout(plgpu)),
    )(load)


# bitsandbytes' de-nesting of one scale, nested_code[c] * nested_absmax[g] + offset, rounded
# after the product and after the sum (no fused multiply-add: `.rn` forbids contraction)
DENEST_PTX = "\n".join(["{", ".reg .f32 t;", "mul.rn.f32 t, $1, $2;", "add.rn.f32 t, t, $3;",
                        "mov.b32 $0, t;", "}"])


def scale_denester(plgpu, rows: int, cols: int, split_cols: int):
    """Pallas function run by a compute warpgroup at the start of each tile: de-nest the fp32
    scales of its `rows` weight rows and its K split's `split_cols` scale columns into shared
    memory, (split_cols, rows) as the decode reads them. Arguments: the uint8 scale codes (a
    (rows, split_cols) window of the (N, cols) array in global memory), nested_code (256,),
    nested_absmax, offset (1,), and the shared (split_cols, rows) f32 destination.

    Why: de-nesting in XLA first costs a transpose fusion per call and 4x the scale bytes in the
    kernel; de-nesting inside each step's decode puts two dependent global loads in every step
    (slower). Here the loads are
    independent, coalesced, once per tile, and the steps read shared memory as before. It pays
    only with few scales a thread (`mgpu_decoded_wgmma.denests_in_kernel`). Each scale's nested
    group is its flat index in the (N, cols) codes / 256: the window's memref offset is the
    first."""
    _, _, _, ir, arith, memref, fa, mu = mosaic_modules()
    per_thread = rows * split_cols // 128
    assert per_thread * 128 == rows * split_cols, (rows, split_cols)

    def denest(ctx, codes_ref, nested_code_ref, nested_absmax_ref, offset_ref, dst_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        idx = ir.IndexType.get()
        ci = lambda v: arith.constant(idx, v)
        mu.warpgroup_barrier()  # the previous tile's decodes have read dst
        tid = arith.index_cast(idx, arith.remui(mu.thread_idx(), arith.constant(i32, 128)))
        first = memref.extract_strided_metadata(codes_ref)[1]  # flat index of the window
        offset = memref.load(offset_ref, [ci(0)])
        rc = [(arith.divui(e, ci(split_cols)), arith.remui(e, ci(split_cols)))
              for e in (arith.addi(tid, ci(128 * i)) for i in range(per_thread))]
        # all loads before the first store, so none waits behind a store (measured no faster
        # than one scale at a time, and no slower)
        codes = [arith.index_cast(idx, arith.extui(i32, memref.load(codes_ref, [r, c])))
                 for r, c in rc]
        groups = [arith.divui(arith.addi(first, arith.addi(arith.muli(r, ci(cols)), c)),
                              ci(256)) for r, c in rc]  # bitsandbytes nests 256 scales a group
        nabs = [memref.load(nested_absmax_ref, [g]) for g in groups]
        ncode = [memref.load(nested_code_ref, [code]) for code in codes]
        for (r, c), nc, na in zip(rc, ncode, nabs):
            value = arith.bitcast(f32, inline_asm(DENEST_PTX, (nc, na, offset), 1)[0])
            memref.store(value, dst_ref, [c, r])
        mu.warpgroup_barrier()  # every thread's scales are written before any decode reads them

    return plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),) * 5, return_type=None)(denest)


def decode_fn(dtype, kb: int, rows: int, blocksize: int):
    """Mosaic GPU (lane-level) function: int4 (rows, 64 * kb) tile in WGMMA_LAYOUT_UPCAST_4X,
    the f32 scale ref (kb, rows) and the thread's codes (`code_loader`) -> the decoded
    (rows, 64 * kb) tile in WGMMA_LAYOUT, dtype."""
    mgpu, pl, plgpu, ir, arith, memref, fa, mu = mosaic_modules()
    from jax._src.lib.mlir.dialects import vector

    def decode(ctx, w, scale_ref, code_vals):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        idx = ir.IndexType.get()
        c32 = lambda v: arith.constant(i32, v)
        w = w.to_layout(fa.WGMMA_LAYOUT_UPCAST_2X)
        tid = mu.thread_idx()
        lane = arith.remui(tid, c32(32))
        warp = arith.remui(arith.divui(tid, c32(32)), c32(4))
        row_in_16 = arith.addi(arith.muli(warp, c32(16)), arith.divui(lane, c32(4)))
        (vec,) = code_vals.registers.flat
        codes = [vector.extract(vec, [], [i]) for i in range(4)]
        tables = {}

        def table(rt, h, blk):
            key = (rt, h, blk)
            if key not in tables:
                row = arith.addi(row_in_16, c32(64 * rt + 8 * h))
                a = memref.load(scale_ref, [arith.constant(idx, blk), arith.index_cast(idx, row)])
                tables[key] = inline_asm(table_ptx(dtype), (a, *codes), 8, convergent=True)
            return tables[key]

        # Mosaic's WGMMA_LAYOUT_UPCAST_2X -> WGMMA_LAYOUT relayout for 4-bit data, stopped
        # before it splits each 32-bit word into four registers (fragmented_array.to_layout).
        is_even = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, c32(2)), c32(0))
        regs = w.registers
        col_minor = np.moveaxis(regs, 1, -1)
        paired = [mu.vector_concat((lo, hi))
                  for lo, hi in zip(col_minor.flat[::2], col_minor.flat[1::2])]
        paired = np.asarray(paired, dtype=object).reshape(
            *col_minor.shape[:-1], col_minor.shape[-1] // 2)
        paired = np.moveaxis(paired, -1, 1)
        out_layout = mgpu.WGMMA_LAYOUT
        shape = (rows, 64 * kb)
        new_regs = np.empty(out_layout.registers_shape(shape), dtype=object)
        vec_ty = ir.VectorType.get((2,), mu.dtype_to_ir_type(dtype))
        perm = arith.select(is_even, c32(0x6240), c32(0x3715))
        for index, reg in np.ndenumerate(paired):
            word = mu.bitcast(reg, i32)
            exchanged = mu.shfl_bfly(word, 1)
            blend = mu.prmt(word, exchanged, perm)
            rt, h = index[0], index[4]
            # WGMMA registers index[1] * 4 + i hold columns 8 * (index[1] * 4 + i) + ...
            blk = (index[1] * 4 * 8) // blocksize if blocksize <= 64 * kb else 0
            outs = inline_asm(LOOKUP_PTX, (blend, *table(rt, h, blk)), 4)
            for i, o in enumerate(outs):
                new_regs[(index[0], index[1] * 4 + i, *index[2:-1])] = mu.bitcast(o, vec_ty)
        assert all(r is not None for r in new_regs.flat)
        return fa.FragmentedArray(_registers=new_regs, _layout=out_layout, _is_signed=None)

    return decode
