"""Grouped (mixture-of-experts) matmul in the Pallas Triton lowering: any CUDA GPU, and Pallas
interpret mode on CPU, where it is the interpretable twin of the Hopper kernel
(`pallas_kernels/mosaic/grouped_mgpu.py`): the same tile schedule (`reference.grouped_tiles`),
one program per (tile, column block), each storing only its own rows (a masked store).

`grouped_dot` / `grouped_dot_t` take the expert stack dense in x's dtype (op `grouped_matmul[_t]`);
`grouped_dot_4bit` / `grouped_dot_4bit_t` take the packed 4-bit stack and decode each weight tile
in registers (op `grouped_matmul_4bit[_t]`: code[nibble] * absmax in fp32, rounded once to x's
dtype, as the jnp reference), so no dense stack exists at all.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference.grouped import (
    check_grouped_4bit_operands,
    check_grouped_operands,
    grouped_matmul_4bit_reference,
    grouped_matmul_4bit_t_reference,
    grouped_matmul_reference,
    grouped_matmul_t_reference,
    grouped_tiles,
    zero_rows_past_groups,
)
from pallas_kernels.registry import Variant
from pallas_kernels.triton.dequant_tiled import HIGHEST, DECODE_METHODS, apply_scales, decode_nibbles, load_code_scalars

reference = grouped_matmul_reference

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 2


def _tile_rows(tiles_ref, t, bm: int):
    """(group, first row of the tile's row block, (bm, 1) mask of the tile's own rows)."""
    group, lo, hi = tiles_ref[0, t], tiles_ref[1, t], tiles_ref[2, t]
    start = jax.lax.div(lo, jnp.int32(bm)) * bm
    rows = start + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    return group, start, (rows >= lo) & (rows < hi)


def _dense_kernel(tiles_ref, a_ref, w_ref, o_ref, *, bm, bn, bk, transpose_w, nk):
    t, j = pl.program_id(0), pl.program_id(1)
    group, start, mask = _tile_rows(tiles_ref, t, bm)

    def step(kk, acc):
        a = _compat.load(a_ref.at[pl.ds(start, bm), pl.ds(kk * bk, bk)],
                         mask=jnp.broadcast_to(mask, (bm, bk)), other=0.0)
        if transpose_w:  # w (E, N, K): the (bn, bk) tile of rows j
            w = w_ref[group, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)]
            return acc + jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                             preferred_element_type=jnp.float32)
        w = w_ref[group, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)]  # (bk, bn): contract over N
        return acc + jnp.dot(a, w, precision=HIGHEST, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))
    _compat.store(o_ref.at[pl.ds(start, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                  mask=jnp.broadcast_to(mask, (bm, bn)))


def _decoded_tile(packed_ref, absmax_ref, code_ref, table, group, r0, nr, c0, nc, blocksize, dtype, method):
    """W[group, r0:r0+nr, c0:c0+nc] decoded: code[nibble] * absmax (fp32), one rounding to dtype
    (`method`: `decode_nibbles`' table gather or select tree)."""
    p = packed_ref[group, pl.ds(r0, nr), pl.ds(c0 // 2, nc // 2)].astype(jnp.int32)
    if nc >= blocksize:
        am = absmax_ref[group, pl.ds(r0, nr), pl.ds(c0 // blocksize, nc // blocksize)]
    else:
        am = absmax_ref[group, pl.ds(r0, nr), pl.ds(c0 // blocksize, 1)]
    hi = apply_scales(decode_nibbles(p, code_ref, table, high=True, method=method), am)
    lo = apply_scales(decode_nibbles(p, code_ref, table, high=False, method=method), am)
    return jnp.stack([hi.astype(dtype), lo.astype(dtype)], axis=-1).reshape(nr, nc)


def _fourbit_kernel(tiles_ref, a_ref, packed_ref, absmax_ref, code_ref, o_ref, *, bm, bn, bk,
                    transpose_w, nk, blocksize, method):
    t, j = pl.program_id(0), pl.program_id(1)
    group, start, mask = _tile_rows(tiles_ref, t, bm)
    table = load_code_scalars(code_ref) if method == "select" else None

    def step(kk, acc):
        a = _compat.load(a_ref.at[pl.ds(start, bm), pl.ds(kk * bk, bk)],
                         mask=jnp.broadcast_to(mask, (bm, bk)), other=0.0)
        if transpose_w:  # weight rows j*bn.., columns kk*bk..: contract over K
            w = _decoded_tile(packed_ref, absmax_ref, code_ref, table, group, j * bn, bn, kk * bk, bk,
                              blocksize, a.dtype, method)
            return acc + jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                             preferred_element_type=jnp.float32)
        w = _decoded_tile(packed_ref, absmax_ref, code_ref, table, group, kk * bk, bk, j * bn, bn,
                          blocksize, a.dtype, method)  # rows kk*bk.. of W (contract over N), columns j*bn..
        return acc + jnp.dot(a, w, precision=HIGHEST, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))
    _compat.store(o_ref.at[pl.ds(start, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                  mask=jnp.broadcast_to(mask, (bm, bn)))


def _run(kernel, a, group_sizes, weight_ops, n_out: int, *, out_dtype, interpret, name: str, block_m: int,
         block_n: int, block_k: int, num_warps: int, num_stages: int):
    """Pad rows to whole row blocks, run one program per (tile, column block), zero the rows past
    the groups. Column and contraction blocks are the largest powers of two up to block_n /
    block_k that divide the operand."""
    m, kc = a.shape
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if m == 0:
        return jnp.zeros((0, n_out), out_dtype)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"{name}: block_m must be a power of two >= 16, got {block_m}")
    bm = block_m
    bn, bk = _compat.largest_pow2_divisor(n_out, block_n), _compat.largest_pow2_divisor(kc, block_k)
    tiles = grouped_tiles(group_sizes, m, bm)
    mp = -(-m // bm) * bm
    ap = jnp.pad(a, ((0, mp - m), (0, 0))) if mp != m else a
    operands = (tiles, ap, *weight_ops)
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, j, r=x.ndim: (0,) * r)  # noqa: E731 - indexed in-kernel
    y = _compat.pallas_call(
        functools.partial(kernel, bm=bm, bn=bn, bk=bk, nk=kc // bk),
        out_shape=jax.ShapeDtypeStruct((mp, n_out), out_dtype),
        grid=(tiles.shape[1], n_out // bn),
        in_specs=[whole(x) for x in operands],
        out_specs=pl.BlockSpec((mp, n_out), lambda t, j: (0, 0)),
        interpret=interpret, num_warps=num_warps, num_stages=num_stages, name=name,
    )(*operands)
    return zero_rows_past_groups(y[:m] if mp != m else y, group_sizes)


def _supports(m, n_out, kc):
    return m >= 0 and n_out % 16 == 0 and kc % 16 == 0


def grouped_dot(x, group_sizes, w, *, out_dtype=None, interpret: bool = False, block_m: int = BLOCK_M,
                block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES):
    """y[rows of e] = x[rows of e] @ w[e].T, w (E, N, K) in x's dtype."""
    check_grouped_operands(x, group_sizes, w, transpose_w=True, what="grouped_dot")
    kernel = functools.partial(_dense_kernel, transpose_w=True)
    return _run(kernel, x, group_sizes, (w.astype(x.dtype),), w.shape[1], out_dtype=out_dtype,
                interpret=interpret, name="grouped_dot", block_m=block_m, block_n=block_n, block_k=block_k,
                num_warps=num_warps, num_stages=num_stages)


def grouped_dot_t(dy, group_sizes, w, *, out_dtype=None, interpret: bool = False, block_m: int = BLOCK_M,
                  block_n: int = BLOCK_N, block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
                  num_stages: int = NUM_STAGES):
    """y[rows of e] = dy[rows of e] @ w[e] (the backward dx), w (E, N, K)."""
    check_grouped_operands(dy, group_sizes, w, transpose_w=False, what="grouped_dot_t")
    kernel = functools.partial(_dense_kernel, transpose_w=False)
    return _run(kernel, dy, group_sizes, (w.astype(dy.dtype),), w.shape[2], out_dtype=out_dtype,
                interpret=interpret, name="grouped_dot_t", block_m=block_m, block_n=block_n, block_k=block_k,
                num_warps=num_warps, num_stages=num_stages)


def _check_method(method: str, what: str):
    if method not in DECODE_METHODS:
        raise ValueError(f"{what}: method must be one of {DECODE_METHODS}, got {method!r}")


def grouped_dot_4bit(x, group_sizes, packed, absmax, code, *, blocksize: int, out_dtype=None,
                     interpret: bool = False, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                     block_k: int = BLOCK_K, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     method: str = "gather"):
    """y[rows of e] = x[rows of e] @ dequant(W_e).T, each weight tile decoded in registers."""
    e, n, k = check_grouped_4bit_operands(x, group_sizes, packed, absmax, code, blocksize,
                                          transpose_w=True, what="grouped_dot_4bit")
    _check_method(method, "grouped_dot_4bit")
    kernel = functools.partial(_fourbit_kernel, transpose_w=True, blocksize=blocksize, method=method)
    return _run(kernel, x, group_sizes, (packed, absmax, code), n, out_dtype=out_dtype,
                interpret=interpret, name="grouped_dot_4bit", block_m=block_m, block_n=block_n,
                block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def grouped_dot_4bit_t(dy, group_sizes, packed, absmax, code, *, blocksize: int, out_dtype=None,
                       interpret: bool = False, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                       block_k: int = BLOCK_K, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                       method: str = "gather"):
    """y[rows of e] = dy[rows of e] @ dequant(W_e), each weight tile decoded in registers."""
    e, n, k = check_grouped_4bit_operands(dy, group_sizes, packed, absmax, code, blocksize,
                                          transpose_w=False, what="grouped_dot_4bit_t")
    _check_method(method, "grouped_dot_4bit_t")
    kernel = functools.partial(_fourbit_kernel, transpose_w=False, blocksize=blocksize, method=method)
    return _run(kernel, dy, group_sizes, (packed, absmax, code), k, out_dtype=out_dtype,
                interpret=interpret, name="grouped_dot_4bit_t", block_m=block_m, block_n=block_n,
                block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def default_config(m, n, k, blocksize=0):
    """The tuning keywords of the dense kernels, as they run by default."""
    del m, n, k, blocksize
    return dict(block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def default_config_4bit(m, n, k, blocksize=0):
    """The 4-bit kernels' tuning keywords: the dense ones and the nibble decode method."""
    return {**default_config(m, n, k, blocksize), "method": "gather"}


def supports(m, n, k, blocksize=0):
    """Forward: output N and contracted K multiples of 16 (K of the blocksize for 4-bit)."""
    return _supports(m, n, k) and (not blocksize or k % blocksize == 0)


def supports_t(m, n, k, blocksize=0):
    """Backward: output K, contracted N (a 4-bit tile of BLOCK_K weight rows spans whole rows)."""
    return _supports(m, k, n) and (not blocksize or k % blocksize == 0)


_COMMON = dict(platform="gpu", interpret=True, numerics="rounded_weight", status="alternative")
VARIANTS = (
    Variant(name="grouped_dot", op="grouped_matmul", fn=grouped_dot, reference=grouped_matmul_reference,
            supports=supports, default_config=default_config, description="Triton grouped matmul over expert "
            "row tiles (dense expert stack); the interpretable twin of mgpu_grouped_dot", **_COMMON),
    Variant(name="grouped_dot_t", op="grouped_matmul_t", fn=grouped_dot_t, reference=grouped_matmul_t_reference,
            supports=supports_t, default_config=default_config, description="the backward of grouped_dot (dy @ W_e)",
            **_COMMON),
    Variant(name="grouped_dot_4bit", op="grouped_matmul_4bit", fn=grouped_dot_4bit,
            reference=grouped_matmul_4bit_reference, supports=supports, default_config=default_config_4bit,
            description="Triton grouped matmul with each 4-bit weight tile decoded in registers "
                        "(no dense expert stack)", **_COMMON),
    Variant(name="grouped_dot_4bit_t", op="grouped_matmul_4bit_t", fn=grouped_dot_4bit_t,
            reference=grouped_matmul_4bit_t_reference, supports=supports_t, default_config=default_config_4bit,
            description="the backward of grouped_dot_4bit (dy @ dequant(W_e)), tiles decoded in registers",
            **_COMMON),
)
