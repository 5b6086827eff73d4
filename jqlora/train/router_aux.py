"""The router's load-balancing loss in DPO and GRPO, added as TRL 1.16's ``DPOTrainer`` and
``GRPOTrainer`` add it to a mixture-of-experts policy: ``coef * aux_loss`` of the policy's own
forward (DPO: the chosen and rejected rows together; GRPO: prompt + completion rows), per
micro-batch, so that a step adds ``coef`` times the mean of its micro-batches' aux losses. The
reference pass (LoRA off) adds nothing, as in TRL.

TRL's forward routes every token of a sequence, its last one included; jqlora's rows hold a
sequence's last token only as a target. :func:`routed_rows` lays the rows out one slot wider with
that token in its input slot (its target masked, so no log-probability changes: attention is
causal) and an ``attention_mask`` of the real tokens, which :func:`jqlora.train.step.router_aux_loss`
counts, padding left out.


`router_aux_coef` says whether a run adds it at all (SFT, DPO and GRPO alike).
"""
from __future__ import annotations

import numpy as np

from ..errors import SettingError
from .config import TrainConfig
from .logps import right_padded_rows, token_logps
from .step import router_aux_loss

__all__ = ["router_aux_coef", "routed_rows", "policy_logps_and_aux"]


def routed_rows(seqs, scored, seq_len: int, pad_id: int = 0) -> dict:
    """:func:`jqlora.train.logps.right_padded_rows` ``(seqs, scored, seq_len + 1, pad_id)`` with
    each sequence's last token also an input (target ``pad_id``, not scored) and ``attention_mask``
    (1 on each sequence's tokens, 0 on the padding)."""
    batch = right_padded_rows(seqs, scored, seq_len + 1, pad_id)
    mask = np.zeros_like(batch["input_ids"])
    for i, s in enumerate(seqs):
        n = len(s)
        batch["input_ids"][i, n - 1] = int(s[-1])
        mask[i, :n] = 1
    batch["attention_mask"] = mask
    return batch


class _Hidden:
    """A stand-in model for :func:`token_logps` whose forward is a hidden state already computed."""

    def __init__(self, hidden, lm_logits):
        self.hidden = hidden
        self.lm_logits = lm_logits

    def __call__(self, ids, **_):
        return self.hidden


def policy_logps_and_aux(model, mb, *, temperature: float = 1.0):
    """``(token_logps(model, mb), load-balancing loss)`` from one forward of a jqlora CausalLM with
    its router logits; ``mb`` needs the ``attention_mask`` of :func:`routed_rows`."""
    h, router = model(mb["input_ids"], positions=mb["positions"], return_hidden=True, return_router_logits=True)
    per_token = token_logps(_Hidden(h, model.lm_logits), mb, temperature=temperature)
    return per_token, router_aux_loss(model, router, mb)


def router_aux_coef(model, config: TrainConfig) -> float | None:
    """The coefficient of the router's load-balancing loss for this run, None when it is off:
    ``config.router_aux_loss_coef`` when set (0: off), else config.json's ``router_aux_loss_coef``
    where its ``output_router_logits`` is true (what transformers adds then).

    Raises:
      SettingError: a coefficient > 0 for a model without mixture-of-experts layers."""
    cfg = getattr(model, "config", None)
    moe = bool(getattr(cfg, "num_experts", 0)) and any(getattr(cfg, "sparse_layers", ()))
    coef = config.router_aux_loss_coef
    if coef is None:
        on = moe and cfg.output_router_logits and cfg.router_aux_loss_coef > 0
        return float(cfg.router_aux_loss_coef) if on else None
    if not coef:
        return None
    if not moe:
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise SettingError(f"TrainConfig.router_aux_loss_coef={coef:g}: the load-balancing loss is for "
                           f"mixture-of-experts models; this {kind} model has no router")
    return float(coef)
