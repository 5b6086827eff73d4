"""What the Hopper pair-table kernels (`mgpu_gemv_pair_table`, `mgpu_mma_pair_table`) share:
typed inline PTX, shared-memory addresses, the in-kernel scale loads with double-quant
de-nesting, and the checks and operand preparation of their public functions.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.reference.fourbit import check_4bit_weight, check_x
from pallas_kernels.mosaic.mgpu_decode import DENEST_PTX, mosaic_modules

LANES = 32  # a warp: the pair tables hold one copy per lane
TABLE_BARRIER = 15  # named barrier of the compute warpgroups (Mosaic uses 0 and 1 + wg)
LOAD_V4_PTX = "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];"


def asm(ptx: str, args, outs: str = "", *, tied: int = 0, side_effects: bool = False):
    """Inline PTX: outputs typed by `outs` ('r' i32, 'f' f32); `tied` last args are the
    initial values of the first `tied` outputs. No outputs: a statement with side effects."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    kinds = {"r": ir.IntegerType.get_signless(32), "f": ir.F32Type.get()}
    free = args[:len(args) - tied]
    cons = [f"={o}" for o in outs]
    cons += ["f" if a.type == ir.F32Type.get() else "r" for a in free]
    cons += [str(i) for i in range(tied)]
    if not outs:
        llvm.inline_asm(ir.Type.parse("!llvm.void"), list(args), ptx, ",".join(cons),
                        has_side_effects=True)
        return []
    ret = llvm.StructType.get_literal([kinds[o] for o in outs])
    res = llvm.inline_asm(ret, list(args), ptx, ",".join(cons), has_side_effects=side_effects)
    return [llvm.extractvalue(kinds[o], res, [i]) for i, o in enumerate(outs)]


def smem_address(ref):
    """The 32-bit shared-window address of a shared-memory ref's first element."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    *_, mu = mosaic_modules()
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mu.memref_ptr(ref))


def scale_loaders(nested: bool, cols: int):
    """(nest_operands, load_scale) for Mosaic pieces that read the scales from global memory:
    nest_operands(nest_refs) loads the double-quant offset once, load_scale(src_ref, nest, row,
    col) reads one absmax (index values into a window of the (N, cols) scales) and de-nests it
    (bitsandbytes' nesting: groups of 256 consecutive scales)."""
    _, _, _, ir, arith, memref, _, _ = mosaic_modules()
    i32 = lambda: ir.IntegerType.get_signless(32)
    cidx = lambda v: arith.constant(ir.IndexType.get(), v)
    as_idx = lambda v: arith.index_cast(ir.IndexType.get(), v)

    def nest_operands(nest_refs):
        """(nested_code ref, nested_absmax ref, the offset loaded once) for `load_scale`."""
        if not nested:
            return ()
        ncode_ref, nabs_ref, off_ref = nest_refs
        return ncode_ref, nabs_ref, memref.load(off_ref, [cidx(0)])

    def load_scale(src_ref, nest, row, col):
        if not nested:
            return memref.load(src_ref, [row, col])
        ncode_ref, nabs_ref, off = nest
        first = memref.extract_strided_metadata(src_ref)[1]
        code_v = as_idx(arith.extui(i32(), memref.load(src_ref, [row, col])))
        group = arith.divui(arith.addi(first, arith.addi(arith.muli(row, cidx(cols)), col)),
                            cidx(256))
        nc = memref.load(ncode_ref, [code_v])
        na = memref.load(nabs_ref, [group])
        return asm(DENEST_PTX, [nc, na, off], "f")[0]

    return nest_operands, load_scale


def scale_operands(absmax, nested, n: int, k: int, blocksize: int):
    """(scales, nest) as the pair-table kernels take them: with double quant the uint8 codes as
    stored, (N, K / blocksize), and nest = (nested_code, nested_absmax, offset (1,)) in f32
    (de-nested in the kernel); else the f32 absmax and None."""
    if nested is None:
        return jnp.asarray(absmax, jnp.float32), None
    nested_absmax, nested_code, offset = nested
    return absmax.reshape(n, k // blocksize), (
        jnp.asarray(nested_code, jnp.float32), jnp.asarray(nested_absmax, jnp.float32),
        jnp.reshape(offset, (1,)).astype(jnp.float32))


def pair_table_product(what: str, cpu_hint: str, make_config, shape_problem, call, x, packed,
                       absmax, code, *, blocksize: int, out_dtype, interpret: bool, nested,
                       config):
    """A pair-table kernel's public entry: the checks (clear errors for interpret mode, weight,
    x and shapes), the default config, the scale operands, `call` and the output dtype."""
    if interpret:
        raise NotImplementedError(f"{what} has no interpret mode (Mosaic GPU, inline PTX); run "
                                  f"{cpu_hint} on CPU")
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what=what)
    check_x(x, k, what=what)
    m = x.shape[0]
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: x must be bfloat16 or float16, got {x.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    cfg = config or make_config(m, n, k, blocksize)
    problem = shape_problem(m, n, k, blocksize, cfg)
    if problem:
        raise ValueError(f"{what}: {problem}")
    scales, nest = scale_operands(absmax, nested, n, k, blocksize)
    y = call(x, packed, scales, jnp.asarray(code, jnp.float32), nest, blocksize=blocksize,
             cfg=cfg, out_dtype=out_dtype)
    return y.astype(out_dtype)
