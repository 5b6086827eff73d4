"""4-bit (NF4/FP4) weights decoded to FP8 (E4M3) with a per-row scale: a Pallas (Triton lowering)
kernel, in the weight's (N, K) layout (`dequant_fp8`) or transposed to (K, N) (`dequant_fp8_t`).

The optional FP8 base products (`jqlora.ops.fp8`) multiply float8_e4m3fn operands on the tensor
cores. The forward needs W8 (N, K); the backward dx = g @ W8 needs the weight K-major, (K, N): an
XLA transpose of an (N, K) fp8 array costs more than the FP8 GEMM saves (docs/numerics.md), so
the transposed kernel writes it directly. Each element is W[n, k] * inv_scale[n] in fp32 (W =
code * absmax, as `dequant_tiled` decodes it), clipped to +-448 and cast once. The oracle is
`dequantize_4bit_fp8_reference` in `pallas_kernels.reference.fourbit`. Scales are fp32 (de-nest
double-quantized ones first, as for `dequant_tiled`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._compat import cdiv
from pallas_kernels.reference.fourbit import (
    FP8_DTYPE, check_4bit_operands, check_fp8_row_scales, dequantize_4bit_fp8_reference, saturate_to_fp8,
    supports_4bit)
from pallas_kernels.registry import Variant
from pallas_kernels.triton.dequant_tiled import (
    apply_scales, decode_nibbles, load_code_scalars, pick_block_bytes, resolve_method, row_mask)


def _dequant_fp8_kernel(packed_ref, absmax_ref, inv_ref, code_ref, out_ref, *, n_rows: int, bn: int,
                        transpose: bool, method: str):
    i = pl.program_id(0)
    ragged = n_rows % bn != 0
    mask = row_mask(i * bn, bn, n_rows) if ragged else None
    p = _compat.load(packed_ref, mask=mask, other=0).astype(jnp.int32)
    am = _compat.load(absmax_ref, mask=mask, other=0.0)
    inv = _compat.load(inv_ref, mask=mask, other=0.0)  # (bn, 1)
    table = load_code_scalars(code_ref) if method == "select" else None
    halves = []
    for high in (True, False):
        vals = apply_scales(decode_nibbles(p, code_ref, table, high=high, method=method), am)
        halves.append(saturate_to_fp8(vals * inv))
    out = jnp.stack(halves, axis=-1).reshape(bn, 2 * p.shape[1])  # interleave: hi -> 2j
    if not transpose:
        _compat.store(out_ref, out, mask=mask)
        return
    cols = (i * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n_rows if ragged else None
    _compat.store(out_ref, out.T, mask=cols)


def _grid_specs(n: int, k: int, blocksize: int, bn: int, bkb: int, transpose: bool):
    span = 2 * bkb  # weight columns per tile
    if span >= blocksize:
        am_spec = pl.BlockSpec((bn, span // blocksize), lambda i, j: (i, j))
    else:
        am_spec = pl.BlockSpec((bn, 1), lambda i, j: (i, (j * span) // blocksize))
    in_specs = [pl.BlockSpec((bn, bkb), lambda i, j: (i, j)), am_spec,
                pl.BlockSpec((bn, 1), lambda i, j: (i, 0)), pl.BlockSpec((16,), lambda i, j: (0,))]
    if transpose:
        out_spec = pl.BlockSpec((span, bn), lambda i, j: (j, i))
        out_shape = jax.ShapeDtypeStruct((k, n), FP8_DTYPE)
    else:
        out_spec = pl.BlockSpec((bn, span), lambda i, j: (i, j))
        out_shape = jax.ShapeDtypeStruct((n, k), FP8_DTYPE)
    return (cdiv(n, bn), (k // 2) // bkb), in_specs, out_spec, out_shape


def _dequant_fp8(packed, absmax, code, inv_scale, *, blocksize: int, transpose: bool, interpret: bool,
                 block_n: int | None, block_k: int | None, method: str, num_warps: int, what: str):
    n, k = check_4bit_operands(packed, absmax, code, blocksize, what=what)
    check_fp8_row_scales(inv_scale, n, what=what)
    method = resolve_method(method, "gather")
    # Tiles (not tuned; times on an H200 in docs/kernels.md): the (N, K) kernel takes dequant_tiled's 16 rows x 256 bytes; the
    # transposed one 64 rows x 64 bytes, so that each stored row of the (K, N) tile is 64 bytes.
    bn = block_n or min(16 if not transpose else 64, _compat.next_pow2(n))
    if not _compat.is_pow2(bn):
        raise ValueError(f"{what}: block_n must be a power of two, got {bn}")
    bkb = pick_block_bytes(k // 2, (block_k or (512 if not transpose else 128)) // 2)
    grid, in_specs, out_spec, out_shape = _grid_specs(n, k, blocksize, bn, bkb, transpose)
    kernel = functools.partial(_dequant_fp8_kernel, n_rows=n, bn=bn, transpose=transpose, method=method)
    return _compat.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_spec,
        interpret=interpret, num_warps=num_warps, num_stages=1,
        name="dequantize_4bit_fp8_t" if transpose else "dequantize_4bit_fp8",
    )(packed, absmax, inv_scale.reshape(n, 1), code)


_STATIC = ("blocksize", "interpret", "block_n", "block_k", "method", "num_warps")


@functools.partial(jax.jit, static_argnames=_STATIC)
def dequant_fp8(packed, absmax, code, inv_scale, *, blocksize: int, interpret: bool = False,
                block_n: int | None = None, block_k: int | None = None, method: str = "auto",
                num_warps: int = 4):
    """(N, K) float8_e4m3fn: W[n, k] * inv_scale[n], clipped to +-448, from bitsandbytes' 4-bit
    operands (packed (N, K/2) uint8, fp32 absmax (N, K/bs), code (16,)). Bit-exact with
    `dequantize_4bit_fp8_reference`."""
    return _dequant_fp8(packed, absmax, code, inv_scale, blocksize=blocksize, transpose=False,
                        interpret=interpret, block_n=block_n, block_k=block_k, method=method,
                        num_warps=num_warps, what="dequant_fp8")


@functools.partial(jax.jit, static_argnames=_STATIC)
def dequant_fp8_t(packed, absmax, code, inv_scale, *, blocksize: int, interpret: bool = False,
                  block_n: int | None = None, block_k: int | None = None, method: str = "auto",
                  num_warps: int = 4):
    """The transpose of `dequant_fp8`, (K, N), written by the kernel (each tile transposed in
    registers): the K-major operand of the FP8 backward product."""
    return _dequant_fp8(packed, absmax, code, inv_scale, blocksize=blocksize, transpose=True,
                        interpret=interpret, block_n=block_n, block_k=block_k, method=method,
                        num_warps=num_warps, what="dequant_fp8_t")


def _reference_t(packed, absmax, code, inv_scale, *, blocksize: int, interpret: bool = False):
    return dequantize_4bit_fp8_reference(packed, absmax, code, inv_scale, blocksize=blocksize,
                                         transpose=True, interpret=interpret)


VARIANTS = (
    Variant(
        name="dequant_fp8",
        op="dequantize_4bit_fp8",
        fn=dequant_fp8,
        reference=dequantize_4bit_fp8_reference,
        supports=supports_4bit,
        description="Pallas/Triton 4-bit dequant to float8_e4m3fn with a per-row reciprocal scale, "
                    "(N, K): the forward operand of the FP8 base product; bit-exact with the reference.",
        numerics="fp8_row_scaled",
        status="alternative",  # run by numerics="fp8" (jqlora.ops.fp8), never by `auto`'s table
    ),
    Variant(
        name="dequant_fp8_t",
        op="dequantize_4bit_fp8_t",
        fn=dequant_fp8_t,
        reference=_reference_t,
        supports=supports_4bit,
        description="dequant_fp8 written transposed, (K, N), tile by tile: the K-major operand of "
                    "the FP8 backward product dx = g @ W8, with no XLA transpose.",
        numerics="fp8_row_scaled",
        status="alternative",
    ),
)
