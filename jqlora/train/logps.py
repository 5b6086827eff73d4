"""Per-token log-probabilities of given tokens under a model: what DPO and GRPO score sequences
with (:mod:`jqlora.train.preference`, :mod:`jqlora.train.grpo`).

Rows are right-padded, one sequence per row from position 0 (plain causal attention, no segment
mask). The LM head runs on chunks of the sequence inside a ``lax.scan`` (each chunk's logits
recomputed in the backward pass), as :func:`jqlora.train.step.chunked_cross_entropy` does, so the
(B, T, vocab) logits never exist at once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .step import LOSS_CHUNK

__all__ = ["token_logps", "right_padded_rows"]


def _logps(logits, targets, temperature):
    logits = logits.astype(jnp.float32)
    if temperature != 1.0:
        logits = logits / jnp.float32(temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - lse


def token_logps(model, batch, *, temperature: float = 1.0, chunk: int = LOSS_CHUNK):
    """(B, T) float32: ``log softmax(logits / temperature)[targets]`` at every slot, times
    ``loss_mask`` (0 where the mask is 0).

    Args:
      model: a jqlora CausalLM (chunked LM head) or any model ``model(ids, positions=...) ->
        (B, T, V)`` logits.
      batch: ``input_ids``, ``targets``, ``loss_mask``, ``positions``, all (B, T).
      temperature: the sampling temperature the tokens were drawn at (GRPO), 1 otherwise.
    """
    ids, targets, mask = batch["input_ids"], batch["targets"], batch["loss_mask"]
    mask = mask.astype(jnp.float32)
    if not hasattr(model, "lm_logits"):
        return _logps(model(ids, positions=batch["positions"]), targets, temperature) * mask
    h = model(ids, positions=batch["positions"], return_hidden=True)
    b, t = targets.shape
    if t <= chunk:
        return _logps(model.lm_logits(h), targets, temperature) * mask
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    chunks = lambda a: jnp.swapaxes(a.reshape(b, n, chunk, *a.shape[2:]), 0, 1)  # noqa: E731

    @jax.checkpoint
    def part(hc, tc):
        return _logps(model.lm_logits(hc), tc, temperature)

    _, out = jax.lax.scan(lambda c, xs: (c, part(*xs)), None, (chunks(h), chunks(targets)))
    return jnp.swapaxes(out, 0, 1).reshape(b, n * chunk)[:, :t] * mask


def right_padded_rows(seqs, trained, seq_len: int, pad_id: int = 0):
    """A numpy batch of right-padded rows, as SFT's unpacked rows: ``seqs`` (token id lists, each
    at most ``seq_len + 1`` long) and ``trained`` (per token: is it scored) -> ``input_ids =
    ids[:-1]``, ``targets = ids[1:]``, ``loss_mask = trained[1:]`` and ``positions``, each
    ``(len(seqs), seq_len)``."""
    import numpy as np

    n, width = len(seqs), seq_len
    ids = np.full((n, width), pad_id, np.int32)
    tgt = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), np.float32)
    for i, (s, tr) in enumerate(zip(seqs, trained)):
        s = np.asarray(s, np.int32)
        k = len(s) - 1
        if k > width:
            raise ValueError(f"row {i}: {len(s)} tokens do not fit in seq_len={seq_len}")
        ids[i, :k] = s[:-1]
        tgt[i, :k] = s[1:]
        mask[i, :k] = np.asarray(tr[1:], np.float32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (n, width)).copy()
    return {"input_ids": ids, "targets": tgt, "loss_mask": mask, "positions": positions}
