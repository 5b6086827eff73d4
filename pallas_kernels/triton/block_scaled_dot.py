"""`block_scaled_dot`: 4-bit matmul for small M on tensor cores, scaled per block:
y = x @ dequant(W).T.

Between the GEMV (M <= 4) and a large GEMM the product is bound by the per-weight decode, which
the older paths pay in full: `splitk_small_m` rebuilds each weight as code * absmax in fp32
through a 15-select tree and rounds it, and `dequant_dot` writes a dense bf16 weight (2 bytes
per weight) before a GEMM. This kernel decodes each weight with one table lookup and no
multiply, and moves the scale out of the inner product as the GEMV does:

    y[m, n] = sum_b absmax[n, b] * sum_{k in block b} x[m, k] * code[q[n, k]]

The inner sums are tensor-core dots of a (block_n, c) tile of table codes against x's (M, c)
chunk (c = the bytes of one scale block, or fewer); their (block_n, M) fp32 results are
multiplied by the block's scales and accumulated. The weight is the dot's left operand, so 128
weight rows fill the MMA's M side and x's few rows (padded to 16) its N side.

Two code tables and two lookups, three registered variants:
- `exact_codes=True` (`block_scaled_dot`): the 16 codes are split into x-dtype pairs hi + lo
  (hi = code rounded, lo = the rounded remainder), two dots per nibble half. Each product
  x * hi, x * lo is exact in fp32, and hi + lo is within 2^-17 of the code, relative, for bf16
  (fp16: 2^-22, or 2^-25 absolute where lo is subnormal): the weight is effectively fp32, as in
  the GEMV, whose oracle (`matmul_4bit_gemv_reference`) this variant shares.
- `exact_codes=False` (`block_scaled_dot_rounded_codes`): one dot per nibble half with the code
  table rounded to x's dtype. The effective weight is round(code) * absmax where
  bitsandbytes uses round(code * absmax): the same error bound (half an ulp of x's dtype per
  weight), a different rounding point. Oracle: `matmul_4bit_block_dot_reference`.
  Registered up to MAX_M = 16, beyond which `dequant_dot` is faster (docs/kernels.md).
- `lookup="prmt"` with rounded codes (`block_scaled_dot_prmt`): the same code tiles, bit for
  bit, found by byte permutes in registers (`nibble_lookup`) instead of a gather per weight,
  with its own tile config (PRMT_CONFIG); registered up to PRMT_MAX_M = 64 (docs/kernels.md).

x is viewed as (M, K / 2c, c, 2) and the packed weight as (N, K / 2c, c) (free reshapes); x's
even/odd columns (high/low nibbles) are split in registers. Grid (N tiles, K splits) as in the
GEMV; with several splits XLA sums the fp32 partials. Double-quantized scales are de-nested
in-kernel (`nested=`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat, nibble_lookup
from pallas_kernels._compat import cdiv
from pallas_kernels.reference.fourbit import (
    check_4bit_weight, check_x, matmul_4bit_block_dot_reference, split_code_table, supports_4bit)
from pallas_kernels.triton.dequant_tiled import (
    HIGHEST, kernel_scale_refs, nested_kernel_inputs, row_mask, scale_block_chunks)
from pallas_kernels.triton.matmul_4bit import _NT
from pallas_kernels.registry import Variant

reference = matmul_4bit_block_dot_reference

MAX_M = 16  # where the registry uses it (chosen by measurement: docs/kernels.md); the kernel
KERNEL_MAX_M = 128  # computes up to KERNEL_MAX_M
# (block_n, block_k, num_warps), with ~1024 programs: chosen by measurement: docs/kernels.md
DEFAULT_CONFIG = (128, 512, 8)
# lookup="prmt": 64-row tiles, 4 warps, one K tile per program, registered up to M = 64:
# chosen by measurement: docs/kernels.md
PRMT_CONFIG = (64, 512, 4)
PRMT_MAX_M = 64
_TARGET_PROGRAMS = 1024


def supports(m: int, n: int, k: int, blocksize: int) -> bool:
    return m <= MAX_M and supports_4bit(m, n, k, blocksize)


def supports_prmt(m: int, n: int, k: int, blocksize: int) -> bool:
    return m <= PRMT_MAX_M and supports_4bit(m, n, k, blocksize)


def _block_dot_kernel(*refs, m: int, n: int, mp: int, bn: int, gc: int, per_block: int,
                      tps: int, n_tables: int, nested: bool, prmt: bool, interpret: bool):
    x_ref, packed_ref, absmax_ref, *rest = refs
    table_refs, rest = rest[:n_tables], rest[n_tables:]
    denest, out_ref = kernel_scale_refs(rest, nested, absmax_ref.shape[1])
    j, s = pl.program_id(0), pl.program_id(1)
    ragged = n % bn != 0
    wmask = row_mask(j * bn, bn, n) if ragged else None
    xmask = row_mask(0, mp, m)[:, :, None] if mp != m else None
    # prmt: table_refs[0] holds the 8 words of nibble_lookup.table_words, read once
    words = [table_refs[0][i] for i in range(8)] if prmt else None

    def code_tile(p, table, half):
        """code[p >> 4] (half "hi") or code[p & 15] ("lo") in x's dtype."""
        if prmt:
            return nibble_lookup.lookup(p, words, x_ref.dtype, half, interpret=interpret)
        q = p.astype(jnp.int32)
        return table[q >> 4] if half == "hi" else table[q & 15]

    def chunk_dots(u):
        """(bn, mp) fp32 code-weight dots of chunk u against x (all tables, both nibbles)."""
        p = _compat.load(packed_ref.at[:, u, :], mask=wmask, other=0)
        xv = _compat.load(x_ref.at[:, u, :, :], mask=xmask, other=0)
        xe, xo = lax.unstack(xv, axis=2)  # (mp, c): columns 2i (high nibble), 2i+1 (low)
        part = None
        # each code tile made right before its dot: the tiles are tensor-core operands in
        # shared memory, and four live at once (exact codes, blocksize 4096) overflowed it
        for tab in table_refs:  # prmt: one entry (the words), ignored by code_tile
            for half, xs in (("hi", xe), ("lo", xo)):
                d = lax.dot_general(code_tile(p, tab, half), xs, _NT,
                                    preferred_element_type=jnp.float32,
                                    precision=HIGHEST)  # (bn, mp)
                part = d if part is None else part + d
        return part

    def chunk_scale(u):
        col = u // per_block
        am = _compat.load(absmax_ref.at[:, pl.ds(col, 1)], mask=wmask, other=0)
        return denest(am, j * bn, col).astype(jnp.float32)

    def body(t, acc):
        u0 = pl.multiple_of((s * tps + t) * gc, gc)  # first chunk of this tile
        for g in range(gc):  # static: one scale block (or part of one) per chunk
            acc = acc + chunk_dots(u0 + g) * chunk_scale(u0 + g)
        return acc

    acc = lax.fori_loop(0, tps, body, jnp.zeros((bn, mp), jnp.float32))
    omask = None
    if ragged or mp != m:
        rows = lax.broadcasted_iota(jnp.int32, (mp, 1), 0) < m
        cols = (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n
        omask = rows & cols
    _compat.store(out_ref, acc.T.astype(out_ref.dtype), mask=omask)


def default_splits(n_tiles: int, nk: int, target_programs: int = _TARGET_PROGRAMS) -> int:
    """Largest divisor of the K tile count giving <= ~target_programs programs."""
    return _compat.largest_divisor_at_most(nk, target_programs // n_tiles)


@functools.partial(jax.jit, static_argnames=(
    "blocksize", "out_dtype", "interpret", "block_n", "block_k", "splits", "num_warps",
    "num_stages", "exact_codes", "lookup"))
def block_scaled_dot(x, packed, absmax, code, *, blocksize: int, out_dtype=None,
                     interpret: bool = False, block_n: int | None = None,
                     block_k: int | None = None, splits: int | None = None,
                     num_warps: int | None = None, num_stages: int = 3, nested=None,
                     exact_codes: bool = True, lookup: str = "gather"):
    """y (M, N) = x (M, K) @ dequant(W).T for M <= 128: tensor-core dots per scale block
    (registered for M <= 16, M <= 64 with lookup="prmt": where it was measured faster).

    block_n weight rows (a power of two >= 16) and block_k weight columns (two per byte; a power
    of two) per tile; `splits` K splits (must divide the number of K tiles; default: about
    `_TARGET_PROGRAMS` programs, or one K tile per program with lookup="prmt"). Unset tile
    sizes come from DEFAULT_CONFIG, or PRMT_CONFIG with lookup="prmt". nested = (nested_absmax, nested_code, offset) with `absmax`
    the uint8 (N, K//bs) codes of double-quantized scales: de-nested in-kernel.
    exact_codes=False: one code table rounded to x's dtype, one dot per nibble half instead of
    two (module doc: numerics).
    lookup: how a tile's codes are found: "gather" (a load from the code table per weight) or
    "prmt" (byte permutes in registers, `nibble_lookup`; needs exact_codes=False; fp32 x has
    no 16-bit table and gathers). The two give bitwise the same code tiles.
    """
    what = "block_scaled_dot"
    n, k = check_4bit_weight(packed, absmax, code, blocksize, nested, what=what)
    check_x(x, k, what=what)
    m = x.shape[0]
    if m > KERNEL_MAX_M:
        raise ValueError(f"{what}: M={m} > {KERNEL_MAX_M}; use dequant_dot")
    if lookup not in ("gather", "prmt"):
        raise ValueError(f"{what}: lookup must be 'gather' or 'prmt', got {lookup!r}")
    if lookup == "prmt" and exact_codes:
        raise ValueError(f"{what}: lookup='prmt' needs exact_codes=False (one 16-bit table)")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    bn, bk, nw = PRMT_CONFIG if lookup == "prmt" else DEFAULT_CONFIG
    bn, bk, num_warps = block_n or bn, block_k or bk, num_warps or nw
    if not (_compat.is_pow2(bn) and bn >= 16 and _compat.is_pow2(bk) and bk >= 32):
        raise ValueError(f"{what}: block_n must be a power of two >= 16 and block_k one >= 32, "
                         f"got {bn}, {bk}")
    c, gc, per_block, u, nk = scale_block_chunks(k, blocksize, bk)  # c >= 16: blocksize >= 32
    n_tiles = cdiv(n, bn)
    if splits is None:
        splits = nk if lookup == "prmt" else default_splits(n_tiles, nk)
    elif splits < 1 or nk % splits != 0:
        raise ValueError(f"{what}: splits={splits} must divide the {nk} K tiles")
    mp = max(16, _compat.next_pow2(m))
    tables = split_code_table(code, x.dtype, exact_codes)
    prmt = lookup == "prmt" and tables[0].dtype.itemsize == 2
    if prmt:
        tables = (nibble_lookup.table_words(tables[0]),)
    part_dtype = out_dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_block_dot_kernel, m=m, n=n, mp=mp, bn=bn, gc=gc,
                               per_block=per_block, tps=nk // splits, n_tables=len(tables),
                               nested=nested is not None, prmt=prmt,
                               interpret=_compat.resolve_interpret(interpret))
    nested_ops, nested_specs = nested_kernel_inputs(nested)
    partial = _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, m, n), part_dtype),
        grid=(n_tiles, splits),
        in_specs=[
            pl.BlockSpec((mp, u, c, 2), lambda j, s: (0, 0, 0, 0)),
            pl.BlockSpec((bn, u, c), lambda j, s: (j, 0, 0)),
            pl.BlockSpec((bn, k // blocksize), lambda j, s: (j, 0)),
            *[pl.BlockSpec(t.shape, lambda j, s: (0,)) for t in tables],
            *nested_specs,
        ],
        out_specs=pl.BlockSpec((_compat.SQUEEZED, mp, bn), lambda j, s: (s, 0, j)),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        name="matmul_4bit_block_dot",
    )(x.reshape(m, u, c, 2), packed.reshape(n, u, c), absmax, *tables, *nested_ops)
    y = partial[0] if splits == 1 else jnp.sum(partial, axis=0)
    return y.astype(out_dtype)


def default_config(m: int, n: int, k: int, blocksize: int) -> dict:
    """The tile keywords `block_scaled_dot` uses by default (DEFAULT_CONFIG)."""
    del m, n, k, blocksize
    bn, bk, nw = DEFAULT_CONFIG
    return dict(block_n=bn, block_k=bk, num_warps=nw)


def default_config_prmt(m: int, n: int, k: int, blocksize: int) -> dict:
    """The tile keywords `block_scaled_dot(lookup="prmt")` uses by default (PRMT_CONFIG)."""
    del m, n, k, blocksize
    bn, bk, nw = PRMT_CONFIG
    return dict(block_n=bn, block_k=bk, num_warps=nw)


VARIANTS = (
    Variant(
        name="block_scaled_dot",
        op="matmul_4bit",
        fn=block_scaled_dot,
        reference=matmul_4bit_block_dot_reference,
        supports=supports,
        description="Pallas/Triton 4-bit matmul for M <= 16: tensor-core dots of table codes "
                    "(hi + lo x-dtype pairs, effectively fp32) against x per scale block, then "
                    "one multiply by the block's absmax per (row, block); the weight is not "
                    "rounded to x's dtype. Grid (N tiles, K splits). De-nests double-quantized "
                    "scales in-kernel (nested=).",
        accepts_nested=True,
        numerics="fp32_weight",
        status="alternative",
        default_config=default_config,
    ),
    Variant(
        name="block_scaled_dot_rounded_codes",
        op="matmul_4bit",
        fn=functools.partial(block_scaled_dot, exact_codes=False),
        reference=functools.partial(matmul_4bit_block_dot_reference, exact_codes=False),
        supports=supports,
        description="block_scaled_dot with the code table rounded to x's dtype (one dot per "
                    "nibble half): effective weight round(code) * absmax, bitsandbytes' error "
                    "bound at a different rounding point.",
        accepts_nested=True,
        numerics="rounded_codes",
        status="alternative",
        default_config=default_config,
    ),
    Variant(
        name="block_scaled_dot_prmt",
        op="matmul_4bit",
        fn=functools.partial(block_scaled_dot, exact_codes=False, lookup="prmt"),
        reference=functools.partial(matmul_4bit_block_dot_reference, exact_codes=False),
        supports=supports_prmt,
        description="block_scaled_dot_rounded_codes with the codes looked up by byte permutes "
                    "in registers (nibble_lookup, no load) instead of a table gather; bitwise "
                    "the same code tiles; 64-row tiles, 4 warps, one K tile per program.",
        accepts_nested=True,
        numerics="rounded_codes",
        status="default",
        default_config=default_config_prmt,
    ),
)
