"""`decode_attention`: one new query token per row attending to one layer's keys and values, read
in place from the whole KV cache (L, B, S, kvh, d), for cached decoding.

Why: the einsum path of a decoding step copies the layer's whole (B, S, kvh, d) slab of keys and
of values out of the cache (a dynamic slice the vendor GEMMs need contiguous), runs two batched
GEMMs over all S slots, and builds the mask and the softmax in more XLA kernels, each a
microsecond or more at batch 1 for a few KB of work (a 1B decode: 342.6 kernels a token there,
277.9 with this kernel, docs/kernels.md). This
kernel reads the row `layer` of the cache with the layer index as data, walks only the slots up
to the new token's (`index`), and keeps a float32 online softmax in registers: one launch a
layer, two when the slots are split.

Layout: program (b, kv head, split) takes the kv head's `groups` = h / kvh query heads (GQA) and
the slot blocks [split * per, ...) up to the last block holding `index`; per block it loads
(block_s, d) keys and values of its head and the blocks' segment ids, and updates each query
head's running max, sum and (d,) accumulator. A block that would run past S moves back to end
at S and masks the slots the block before it took (no out-of-bounds load, in interpret mode
either). One split: the program normalises and stores y. Several (long caches with few rows):
each stores its normalised partial and its log-sum-exp, and one XLA fusion combines them.

Numerics: "online_softmax" (`decode_attention_reference`). A row that sees no key gives zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference.attention import check_decode_attention_operands, decode_attention_reference
from pallas_kernels.registry import Variant

reference = decode_attention_reference

_NEG = -1e30  # a masked score: finite, so exp(m_old - m_new) stays defined before any key is seen
_TARGET_PROGRAMS = 264  # two programs per SM of a Hopper GPU
MIN_BLOCKS_PER_SPLIT = 1
MAX_TILE = 64 * 128  # float32 values a default (slots, head_dim) block of keys holds: the largest measured


def _kernel(pos_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, *out_refs, groups: int, bs: int, per: int,
            n_slots: int, scale: float, cap, window, split: bool):
    b, hk, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, index = pos_ref[0], pos_ref[1]
    qseg = qseg_ref[b]
    first = sp * per
    last = jnp.minimum(first + per, lax.div(index + bs, jnp.int32(bs)))  # blocks up to the one holding index
    d = q_ref.shape[-1]
    qs = [q_ref[b, hk * groups + g, :].astype(jnp.float32) for g in range(groups)]

    def block(i, carry):
        s0 = i * bs
        lo = jnp.minimum(s0, n_slots - bs)  # the last block moves back to end at S
        slot = lo + lax.broadcasted_iota(jnp.int32, (bs,), 0)
        kseg = kseg_ref[b, pl.ds(lo, bs)]
        valid = (slot >= s0) & (slot <= index) & (kseg == qseg) & (kseg != 0)
        if window is not None:
            valid = valid & (index - slot < window)
        k = k_ref[layer, b, pl.ds(lo, bs), hk, :].astype(jnp.float32)  # (bs, d)
        v = v_ref[layer, b, pl.ds(lo, bs), hk, :].astype(jnp.float32)
        out = []
        for g in range(groups):
            m, total, acc = carry[3 * g:3 * g + 3]
            s = jnp.sum(k * qs[g][None, :], axis=1) * scale
            if cap is not None:
                s = jnp.tanh(s / cap) * cap
            s = jnp.where(valid, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            out += [m_new, total * alpha + jnp.sum(p), acc * alpha + jnp.sum(p[:, None] * v, axis=0)]
        return tuple(out)

    init = (jnp.float32(_NEG), jnp.float32(0.0), jnp.zeros((d,), jnp.float32)) * groups
    carry = lax.fori_loop(first, last, block, init)
    for g in range(groups):
        m, total, acc = carry[3 * g:3 * g + 3]
        seen = total > 0
        y = acc / jnp.where(seen, total, 1.0)
        h = hk * groups + g
        if split:
            o_ref, lse_ref = out_refs
            o_ref[sp, b, h, :] = y
            lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), _NEG)
            lse_ref[sp, b, h, :] = jnp.full((d,), lse, jnp.float32)
        else:
            out_refs[0][b, h, :] = y.astype(out_refs[0].dtype)


def block_slots(n_slots: int, head_dim: int, block_s: int | None = None) -> int:
    """Slots a block loads: block_s, by default 64 and at most MAX_TILE / head_dim (with the default
    splits 64 beat 8, 16 and 32 in every cell measured, head_dim 64 and 128, docs/kernels.md; at
    head_dim 256 the block holds as many values as that measured (64, 128) block, 32 slots); at
    most S's largest power of two (a block never starts before slot 0)."""
    want = block_s or min(64, max(1, MAX_TILE // head_dim))
    if not _compat.is_pow2(want):
        raise ValueError(f"decode_attention: block_s={want} must be a power of two")
    return min(want, 1 << (int(n_slots).bit_length() - 1))


def default_splits(batch: int, kv_heads: int, n_blocks: int) -> int:
    """Slot splits: enough programs to fill the GPU (_TARGET_PROGRAMS), each split at least
    MIN_BLOCKS_PER_SPLIT blocks of the cache's S; one where the rows and heads fill it or S is short."""
    want = -(-_TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(want, n_blocks // MIN_BLOCKS_PER_SPLIT))


def combine_splits(o, lse, out_dtype):
    """y (B, h, d) from each split's normalised partial o (splits, B, h, d) and log-sum-exp."""
    lse = lse[..., 0]
    top = jnp.max(lse, axis=0)
    w = jnp.where(lse > _NEG / 2, jnp.exp(lse - top), 0.0)
    total = jnp.sum(w, axis=0)
    y = jnp.sum(w[..., None] * o, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("scale", "cap", "window", "out_dtype", "interpret", "block_s",
                                             "splits", "num_warps", "num_stages"))
def decode_attention(q, k_cache, v_cache, layer, index, q_seg, k_seg, *, scale: float, cap=None, window=None,
                     out_dtype=None, interpret=False, block_s=None, splits=None, num_warps=4, num_stages=2):
    """(B, h, d): q (B, h, d) over row `layer` of k_cache, v_cache (L, B, S, kvh, d), the new
    token at slot `index` already written; q_seg (B,), k_seg (B, S) the segment ids
    (`pallas_kernels.reference.attention`). head_dim must be a power of two."""
    check_decode_attention_operands(q, k_cache, v_cache, q_seg, k_seg, what="decode_attention")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    _, b, n_slots, kvh, d = k_cache.shape
    h = q.shape[1]
    if not _compat.is_pow2(d):
        raise ValueError(f"decode_attention: head_dim {d} must be a power of two")
    bs = block_slots(n_slots, d, block_s)
    n_blocks = -(-n_slots // bs)
    splits = default_splits(b, kvh, n_blocks) if splits is None else int(splits)
    if not 1 <= splits <= n_blocks:
        raise ValueError(f"decode_attention: splits={splits} must be in 1..{n_blocks} (the slot blocks)")
    per = -(-n_blocks // splits)
    pos = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(index, jnp.int32)])
    operands = (pos, q_seg.astype(jnp.int32), k_seg.astype(jnp.int32), q, k_cache, v_cache)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, s, r=x.ndim: (0,) * r)  # noqa: E731 - indexed in-kernel
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((b, h, d), out_dtype)
        out_specs = pl.BlockSpec((b, h, d), lambda i, j, s: (0, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, b, h, d), jnp.float32),) * 2
        out_specs = (pl.BlockSpec((splits, b, h, d), lambda i, j, s: (0, 0, 0, 0)),) * 2
    out = _compat.pallas_call(
        functools.partial(_kernel, groups=h // kvh, bs=bs, per=per, n_slots=n_slots, scale=float(scale),
                          cap=None if cap is None else float(cap), window=window, split=splits > 1),
        out_shape=out_shape, grid=(b, kvh, splits), in_specs=[whole(x) for x in operands], out_specs=out_specs,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages, name="decode_attention",
    )(*operands)
    return out if splits == 1 else combine_splits(*out, out_dtype)


def supports(batch: int, heads: int, n_slots: int, head_dim: int) -> bool:
    """Shapes the kernel takes: a power-of-two head_dim up to 256, at least one slot."""
    return batch > 0 and heads > 0 and n_slots > 0 and _compat.is_pow2(head_dim) and head_dim <= 256


VARIANTS = (
    Variant(
        name="decode_attention",
        op="decode_attention",
        fn=decode_attention,
        reference=decode_attention_reference,
        supports=supports,
        description="one query token per row over a layer of the KV cache read in place (layer index as "
                    "data), slots up to the new token's only, float32 online softmax: one launch a layer",
        numerics="online_softmax",
        status="default",
    ),
)
