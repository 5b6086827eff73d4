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
from pallas_kernels.reference.attention import (check_decode_attention_operands, decode_attention_reference,
                                                decode_attention_step_reference)
from pallas_kernels.registry import Variant

reference = decode_attention_reference

_NEG = -1e30  # a masked score: finite, so exp(m_old - m_new) stays defined before any key is seen
_TARGET_PROGRAMS = 264  # two programs per SM of a Hopper GPU
MIN_BLOCKS_PER_SPLIT = 1
MAX_TILE = 64 * 128  # float32 values a default (slots, head_dim) block of keys holds: the largest measured


def _kernel(pos_ref, qseg_ref, kseg_ref, *refs, groups: int, bs: int, per: int, n_slots: int, scale: float, cap,
            window, split: bool, fresh: bool, terms: int, heads: int):
    b, hk, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, index = pos_ref[0], pos_ref[1]
    qseg = qseg_ref[b]
    if fresh:
        qkv_ref, cos_ref, sin_ref, k_ref, v_ref, *out_refs = refs
        *out_refs, k_out, v_out = out_refs
    else:
        q_ref, k_ref, v_ref, *out_refs = refs
    first = sp * per
    last = jnp.minimum(first + per, lax.div(index + bs, jnp.int32(bs)))  # blocks up to the one holding index
    d = k_ref.shape[-1]
    halves = (pl.ds(0, d // 2), pl.ds(d // 2, d // 2))  # RoPE pairs feature i with i + d / 2
    f32 = jnp.float32
    if fresh:  # the new token's q, k, v from its projection's terms; k, v written at slot index
        dtype = k_ref.dtype

        def proj(col):  # (d / 2,) features from col: the terms summed, rounded as the product rounds
            total = qkv_ref[0, b, pl.ds(col, d // 2)].astype(f32)
            for t in range(1, terms):
                total = total + qkv_ref[t, b, pl.ds(col, d // 2)].astype(f32)
            return total.astype(dtype).astype(f32)

        cos = [cos_ref[b, h].astype(f32) for h in halves]
        sin = [sin_ref[b, h].astype(f32) for h in halves]

        def rope(col):  # x * cos + rotate_half(x) * sin, rounded once
            lo, hi = proj(col), proj(col + d // 2)
            return ((lo * cos[0] - hi * sin[0]).astype(dtype).astype(f32),
                    (hi * cos[1] + lo * sin[1]).astype(dtype).astype(f32))

        qs = [rope((hk * groups + g) * d) for g in range(groups)]
        k_new = rope((heads + hk) * d)
        kv_heads = k_ref.shape[3]
        v_new = (proj((heads + kv_heads + hk) * d), proj((heads + kv_heads + hk) * d + d // 2))

        @pl.when(sp == 0)
        def _write():
            for h, kn, vn in zip(halves, k_new, v_new):
                k_out[layer, b, index, hk, h] = kn.astype(k_out.dtype)
                v_out[layer, b, index, hk, h] = vn.astype(v_out.dtype)
    else:
        qs = [tuple(q_ref[b, hk * groups + g, h].astype(f32) for h in halves) for g in range(groups)]

    def score(k_lo, k_hi, q):  # (bs,) scaled and soft-capped scores of keys given by halves
        s = (jnp.sum(k_lo * q[0][None, :], axis=-1) + jnp.sum(k_hi * q[1][None, :], axis=-1)) * scale
        return s if cap is None else jnp.tanh(s / cap) * cap

    def block(i, carry):
        s0 = i * bs
        lo = jnp.minimum(s0, n_slots - bs)  # the last block moves back to end at S
        slot = lo + lax.broadcasted_iota(jnp.int32, (bs,), 0)
        kseg = kseg_ref[b, pl.ds(lo, bs)]
        seen = (slot < index) if fresh else (slot <= index)  # fresh: the new token comes from registers
        valid = (slot >= s0) & seen & (kseg == qseg) & (kseg != 0)
        if window is not None:
            valid = valid & (index - slot < window)
        k = [k_ref[layer, b, pl.ds(lo, bs), hk, h].astype(f32) for h in halves]  # (bs, d / 2) each
        v = [v_ref[layer, b, pl.ds(lo, bs), hk, h].astype(f32) for h in halves]
        out = []
        for g in range(groups):
            m, total, acc_lo, acc_hi = carry[4 * g:4 * g + 4]
            s = jnp.where(valid, score(k[0], k[1], qs[g]), _NEG)
            m_new = jnp.maximum(m, jnp.max(s))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
            out += [m_new, total * alpha + jnp.sum(p), acc_lo * alpha + jnp.sum(p[:, None] * v[0], axis=0),
                    acc_hi * alpha + jnp.sum(p[:, None] * v[1], axis=0)]
        return tuple(out)

    zeros = jnp.zeros((d // 2,), f32)
    init = []
    for g in range(groups):
        if fresh:  # split 0 starts from the new token's own key, seen where its row has a segment
            own = ((sp == 0) & (qseg != 0)).astype(f32)  # 1.0 or 0.0 (no vector select on a scalar)
            s_new = jnp.sum(score(k_new[0][None, :], k_new[1][None, :], qs[g]))
            init += [own * s_new + (1.0 - own) * _NEG, own, own * v_new[0], own * v_new[1]]
        else:
            init += [jnp.float32(_NEG), jnp.float32(0.0), zeros, zeros]
    carry = lax.fori_loop(first, last, block, tuple(init))
    for g in range(groups):
        m, total, acc_lo, acc_hi = carry[4 * g:4 * g + 4]
        seen = total > 0
        h = hk * groups + g
        for half, acc in zip(halves, (acc_lo, acc_hi)):
            y = acc / jnp.where(seen, total, 1.0)
            if split:
                out_refs[0][sp, b, h, half] = y
            else:
                out_refs[0][b, h, half] = y.astype(out_refs[0].dtype)
        if split:
            lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), _NEG)
            out_refs[1][sp, b, h, :] = jnp.full((d,), lse, jnp.float32)


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


def _launch(what, front, k_cache, v_cache, layer, index, q_seg, k_seg, *, heads: int, fresh: bool, terms: int,
            scale, cap, window, out_dtype, interpret, block_s, splits, num_warps, num_stages):
    """The kernel's grid, blocks, splits and call; front: (q,) or (qkv terms, cos, sin). -> the
    output (combined across splits), and with fresh the caches the kernel wrote to."""
    _, b, n_slots, kvh, d = k_cache.shape
    if not _compat.is_pow2(d) or d < 2:
        raise ValueError(f"{what}: head_dim {d} must be a power of two")
    bs = block_slots(n_slots, d, block_s)
    n_blocks = -(-n_slots // bs)
    splits = default_splits(b, kvh, n_blocks) if splits is None else int(splits)
    if not 1 <= splits <= n_blocks:
        raise ValueError(f"{what}: splits={splits} must be in 1..{n_blocks} (the slot blocks)")
    per = -(-n_blocks // splits)
    pos = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(index, jnp.int32)])
    operands = (pos, q_seg.astype(jnp.int32), k_seg.astype(jnp.int32), *front, k_cache, v_cache)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, s, r=x.ndim: (0,) * r)  # noqa: E731 - indexed in-kernel
    if splits == 1:
        out_shape = (jax.ShapeDtypeStruct((b, heads, d), out_dtype),)
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, b, heads, d), jnp.float32),) * 2
    aliases = {}
    if fresh:  # the caches are outputs too, the same buffers: only slot index of row layer is written
        out_shape += (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),) * 2
        aliases = {len(operands) - 2: len(out_shape) - 2, len(operands) - 1: len(out_shape) - 1}
    out = _compat.pallas_call(
        functools.partial(_kernel, groups=heads // kvh, bs=bs, per=per, n_slots=n_slots, scale=float(scale),
                          cap=None if cap is None else float(cap), window=window, split=splits > 1, fresh=fresh,
                          terms=terms, heads=heads),
        out_shape=out_shape, grid=(b, kvh, splits), in_specs=[whole(x) for x in operands],
        out_specs=tuple(whole(o) for o in out_shape), interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, name="decode_attention", input_output_aliases=aliases,
    )(*operands)
    y = out[0] if splits == 1 else combine_splits(out[0], out[1], out_dtype)
    return (y, *out[-2:]) if fresh else y


@functools.partial(jax.jit, static_argnames=("scale", "cap", "window", "out_dtype", "interpret", "block_s",
                                             "splits", "num_warps", "num_stages"))
def decode_attention(q, k_cache, v_cache, layer, index, q_seg, k_seg, *, scale: float, cap=None, window=None,
                     out_dtype=None, interpret=False, block_s=None, splits=None, num_warps=4, num_stages=2):
    """(B, h, d): q (B, h, d) over row `layer` of k_cache, v_cache (L, B, S, kvh, d), the new
    token at slot `index` already written; q_seg (B,), k_seg (B, S) the segment ids
    (`pallas_kernels.reference.attention`). head_dim must be a power of two."""
    check_decode_attention_operands(q, k_cache, v_cache, q_seg, k_seg, what="decode_attention")
    return _launch("decode_attention", (q,), k_cache, v_cache, layer, index, q_seg, k_seg, heads=q.shape[1],
                   fresh=False, terms=0, scale=scale, cap=cap, window=window,
                   out_dtype=jnp.dtype(out_dtype or q.dtype), interpret=interpret, block_s=block_s, splits=splits,
                   num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("heads", "scale", "cap", "window", "out_dtype", "interpret", "block_s",
                                             "splits", "num_warps", "num_stages"))
def decode_attention_step(qkv, cos, sin, k_cache, v_cache, layer, index, q_seg, k_seg, *, heads: int, scale: float,
                          cap=None, window=None, out_dtype=None, interpret=False, block_s=None, splits=None,
                          num_warps=4, num_stages=2):
    """-> (y (B, h, d), k_cache, v_cache): one decoding step's attention from the new token's q|k|v
    projection, qkv (B, (h + 2 kvh) d) or its product's terms (S, B, ...) (`QLoRALinear.partial_products`):
    the kernel sums them, applies RoPE (cos, sin (B, d), the whole head) to q and k, writes k
    and v at slot `index` of row `layer` of the caches (aliased: in place where XLA can) and
    attends, the new key from registers. Numerics: `decode_attention_step_reference`."""
    terms = qkv if qkv.ndim == 3 else qkv[None]
    b, d = cos.shape
    kvh = k_cache.shape[3]
    width = (heads + 2 * kvh) * d
    if terms.shape[1:] != (b, width) or sin.shape != cos.shape:
        raise ValueError(f"decode_attention_step: `qkv` must be ({b}, {width}) or (terms, {b}, {width}) for "
                         f"{heads} heads and {kvh} kv heads of {d}, and `cos`, `sin` ({b}, {d}); got "
                         f"{qkv.shape}, {cos.shape}, {sin.shape}")
    q_like = jax.ShapeDtypeStruct((b, heads, d), k_cache.dtype)
    check_decode_attention_operands(q_like, k_cache, v_cache, q_seg, k_seg, what="decode_attention_step")
    return _launch("decode_attention_step", (terms, cos, sin), k_cache, v_cache, layer, index, q_seg, k_seg,
                   heads=heads, fresh=True, terms=terms.shape[0], scale=scale, cap=cap, window=window,
                   out_dtype=jnp.dtype(out_dtype or k_cache.dtype), interpret=interpret, block_s=block_s,
                   splits=splits, num_warps=num_warps, num_stages=num_stages)


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
    Variant(
        name="decode_attention_step",
        op="decode_attention_step",
        fn=decode_attention_step,
        reference=decode_attention_step_reference,
        supports=supports,
        description="decode_attention from the new token's q|k|v projection (a product's K-split terms summed "
                    "in-kernel): RoPE on q and k, k and v written into the cache in place, the new key from "
                    "registers: one launch where XLA runs three kernels before decode_attention",
        numerics="online_softmax",
        status="default",
    ),
)
