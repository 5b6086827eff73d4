"""cuDNN flash attention over packed rows with no (T, T) mask: each segment its own causal sequence.

Packed training rows hold several documents; the einsum and "xla" paths express that as a boolean
(B, T, T) mask (same segment, key slot <= query slot). Handed that mask, cuDNN reads it tile by
tile and computes every tile under the diagonal, across documents too, so packed rows cost far
more attention time than plain causal rows. cuDNN's packed layout takes instead, per row, the length and start offset of each segment and runs
each as its own causal sequence, so no mask exists and cross-document tiles are skipped.

A segment here is a maximal run of one nonzero id, the notion `segment_positions` already uses for
RoPE positions; 0 marks padding. For ids that each form one run (what `jqlora.train.data` packs)
this is exactly the einsum path's "same id" mask. cuDNN leaves tokens outside every segment
unwritten, so their outputs are set to zero here.

The packed layout is reached through JAX's cuDNN wrapper (`jax._src.cudnn`), which
`jax.nn.dot_product_attention` uses but does not expose this part of; `available()` says whether
this JAX has it, and callers fall back to the mask otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# Widest (B, M) segment table the train loop hands to cuDNN; wider rows keep the (T, T) mask.
# cuDNN's packed backward grows with M whatever the real number of segments; up to this width it
# still beats the mask at the 8B shape (evidence: benchmarks/results/JOURNAL.md).
MAX_WIDTH = 64


def _real_and_run_starts(seg, xp):
    """(token is not padding, token starts a run) for (rows, T) ids, in numpy or jax (xp)."""
    prev = xp.concatenate([xp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    real = seg != 0
    return real, real & (seg != prev)


def segment_runs(segment_ids, max_segments: int):
    """cuDNN's packed-layout operands: (lengths (..., M), offsets (..., M + 1)), int32.

    Row r's j-th run of equal nonzero ids starts at offsets[r, j] and holds lengths[r, j] tokens;
    entries past a row's last run are -1. Runs beyond `max_segments` are left out, which
    `packed_causal_attention` turns into NaN outputs rather than wrong ones. numpy in, numpy out
    (the train loop's host-side batches); jax arrays in, jax arrays out.
    """
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    lead, t = segment_ids.shape[:-1], segment_ids.shape[-1]
    seg = xp.asarray(segment_ids).astype(np.int32).reshape(-1, t)
    b, m = seg.shape[0], max_segments
    real, start = _real_and_run_starts(seg, xp)
    run = xp.cumsum(start, axis=1, dtype=np.int32) - 1  # run index of each real token
    n_runs = xp.minimum(xp.max(xp.where(real, run + 1, 0), axis=1, initial=0), m)[:, None]
    present = xp.arange(m, dtype=np.int32)[None, :] < n_runs
    rows = xp.broadcast_to(xp.arange(b, dtype=np.int32)[:, None], (b, t))
    pos = xp.broadcast_to(xp.arange(t, dtype=np.int32)[None, :], (b, t))
    col = xp.where(real & (run < m), run, m)  # padding and runs >= M: an out-of-range column
    first = xp.where(start & (run < m), run, m + 1)
    if xp is np:
        lengths = np.zeros((b, m + 1), np.int32)
        np.add.at(lengths, (rows, col), 1)
        offsets = np.full((b, m + 2), -1, np.int32)
        offsets[rows[start], first[start]] = pos[start]
        lengths, offsets = lengths[:, :m], offsets[:, :m + 1]
    else:
        lengths = jnp.zeros((b, m), jnp.int32).at[rows, col].add(1, mode="drop")
        offsets = jnp.full((b, m + 1), -1, jnp.int32).at[rows, first].set(pos, mode="drop")
    lengths = xp.where(present, lengths, -1)
    return lengths.reshape(*lead, m), offsets.reshape(*lead, m + 1)


def table_width(segment_ids: np.ndarray, at_least: int = 4) -> int | None:
    """The M to use for these host-side rows: a power of two >= their most runs and >= at_least
    (a run that only widens keeps the compiled step's shapes), or None above MAX_WIDTH."""
    seg = np.asarray(segment_ids).reshape(-1, np.shape(segment_ids)[-1])
    most = int(_real_and_run_starts(seg, np)[1].sum(axis=1).max(initial=0))
    width = max(at_least, 1 << max(0, most - 1).bit_length())
    return width if width <= MAX_WIDTH else None


def available() -> bool:
    """Whether this JAX's cuDNN wrapper takes per-segment lengths and offsets."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return False
    import inspect

    params = inspect.signature(fa.dot_product_attention).parameters
    if not all(p in params for p in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type")):
        return False
    try:
        return fa.check_cudnn_version() >= 90600  # packed layouts need cuDNN 9.6 (JAX's own tests)
    except Exception:  # noqa: BLE001 - no cuDNN here: the caller keeps the mask path
        return False


def packed_causal_attention(q, k, v, segment_ids, runs, *, scale: float):
    """softmax(q k^T * scale) v per segment, causal inside each; q (B, T, H, D), k/v (B, T, KVH, D)
    (grouped-query heads as HF's repeat_kv: query head n uses kv head n // (H / KVH)).
    runs = segment_runs(segment_ids, M). Outputs of padding tokens (id 0) are zero; every output
    of a row whose runs do not all fit in M (or do not match segment_ids) is NaN, so a too-narrow
    table stops training (the loop's non-finite check) instead of training on wrong attention."""
    lengths, offsets = runs
    real = segment_ids != 0
    # cuDNN writes neither the outputs nor the dq/dk/dv of tokens outside every segment: whatever
    # memory held lands there, NaN included. Selecting q, k, v at the real tokens makes the
    # backward of this select drop those gradient rows (a select, not a product, so NaN too).
    keep = real[:, :, None, None]
    q, k, v = (jnp.where(keep, a, jnp.zeros((), a.dtype)) for a in (q, k, v))
    out = _cudnn_packed(q, k, v, lengths, offsets, scale)
    covered = jnp.sum(jnp.maximum(lengths, 0), axis=1) == jnp.sum(real, axis=1)
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
    return jnp.where(covered[:, None, None, None], out, jnp.asarray(jnp.nan, out.dtype))


def _cudnn_packed(q, k, v, lengths, offsets, scale):
    """The cuDNN call (a GPU only; CPU tests substitute `emulate_cudnn_packed`)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa.dot_product_attention(q, k, v, None, None, lengths, lengths, offsets, offsets,
                                    scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL,
                                    qkv_layout="BTNH")


def emulate_cudnn_packed(q, k, v, lengths, offsets, scale):
    """What `_cudnn_packed` computes, from the table alone: token p belongs to run j when
    offsets[j] <= p < offsets[j] + lengths[j]; causal attention within runs; tokens in no run
    get zeros (cuDNN leaves them unwritten). For CPU tests of the wiring."""
    t = q.shape[1]
    p = jnp.arange(t)[None, :, None]
    start, n = offsets[:, None, :-1], lengths[:, None, :]
    inside = (n > 0) & (p >= start) & (p < start + n)  # (B, T, M)
    run = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)  # (B, T)
    mask = (run[:, :, None] == run[:, None, :]) & (run[:, :, None] >= 0)
    mask = mask & (jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None])
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="xla")
    return jnp.where((run >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
