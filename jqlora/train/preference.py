"""DPO (``TrainConfig.objective = "dpo"``): preference pairs, the DPO losses with TRL's definitions,
and the task :func:`jqlora.train.train` runs for them (:mod:`jqlora.train.objective_loop`).

Data: one row per pair, ``{"prompt", "chosen", "rejected"}``, either strings (the sequence is
BOS + prompt + completion + EOS) or conversations: ``prompt`` a list of messages, ``chosen`` and
``rejected`` lists of assistant messages (or strings, taken as one assistant message), rendered
with the tokenizer's chat template. Only the completion's tokens are scored (for a conversation:
its assistant tokens after the prompt rendered with the generation header). Other keys are
ignored. A sequence longer than ``seq_len + 1`` tokens is cut at the end; a pair with no
completion token left is an error naming the row.

Scores: ``logp(y|x)``, the sum of the completion tokens' log-probabilities, under the policy and
under the reference, the same model with LoRA off (:mod:`jqlora.lora.reference`): computed in
each step without gradient, or once for the whole set before step 1 (``precompute_ref``). With
``d = (logp_c - ref_c) - (logp_r - ref_r)``, per pair (TRL 1.16's ``DPOTrainer``):

* ``sigmoid``: ``-(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d)`` (``ls`` =
  ``dpo_label_smoothing``: conservative DPO; TRL's sigmoid is ``ls = 0``),
* ``hinge``: ``relu(1 - beta d)``,
* ``ipo``: ``(d_c / n_c - d_r / n_r - 1 / (2 beta))^2`` with each log-ratio divided by its
  completion's token count ``n``.

The loss is the mean over the step's pairs. Logged (TRL's names): ``rewards/chosen`` (mean of
``beta (logp_c - ref_c)``), ``rewards/rejected``, ``rewards/accuracies`` (share of pairs with a
larger chosen reward), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``. With a fresh
adapter the policy equals the reference, so the first step's sigmoid loss is ``ln 2`` and its
rewards 0, up to the last bit (the policy's pass runs inside the gradient program, the
reference's beside it, and XLA may round them differently); the log-ratios are taken token by
token, so where the two passes agree the ratio is exactly 0. A run started from an
``init_adapter`` still takes the base (LoRA off) as its reference.

Mixture-of-experts models: where the router's load-balancing loss is on
(:func:`jqlora.train.router_aux.router_aux_coef`), the step's loss adds ``coef`` times the mean over
its micro-batches of the policy forward's aux loss (chosen and rejected rows together), as TRL's
``DPOTrainer`` adds it (:mod:`jqlora.train.router_aux`); logged as ``aux_loss``. Evaluation
reports the DPO loss alone.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .examples import DataError
from .logps import right_padded_rows, token_logps
from .objective_step import make_eval_fn, make_update_step
from .router_aux import policy_logps_and_aux, routed_rows, router_aux_coef

__all__ = ["dpo_losses", "dpo_losses_from_ratios", "PairSet", "load_pairs", "DPOTask", "METRICS"]

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def dpo_losses(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta: float,
               loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_lengths=None,
               rejected_lengths=None):
    """Per-pair DPO losses and rewards: ``(losses, chosen_rewards, rejected_rewards)``, each
    (pairs,); the rewards are ``beta * (logp - ref)`` without gradient. ``*_lengths``: completion
    token counts (``ipo`` only). See the module docstring for the formulas."""
    return dpo_losses_from_ratios(chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps,
                                  beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                                  chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)


def dpo_losses_from_ratios(chosen_lr, rejected_lr, *, beta: float, loss_type: str = "sigmoid",
                           label_smoothing: float = 0.0, chosen_lengths=None, rejected_lengths=None):
    """:func:`dpo_losses` from the log-ratios ``logp - ref`` of the chosen and rejected completions."""
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * delta)
        if label_smoothing:
            losses = (1 - label_smoothing) * losses - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * delta)
    elif loss_type == "ipo":
        ipo = chosen_lr / jnp.maximum(chosen_lengths, 1.0) - rejected_lr / jnp.maximum(rejected_lengths, 1.0)
        losses = (ipo - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    sg = jax.lax.stop_gradient
    return losses, beta * sg(chosen_lr), beta * sg(rejected_lr)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PairSet:
    """Tokenized pairs: ``seqs[i] = (chosen_ids, chosen_scored, rejected_ids, rejected_scored)``,
    ``where[i]`` names the row; ``source`` the file (or ``<data argument>``)."""

    source: str
    where: list[str]
    seqs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]

    def __len__(self) -> int:
        return len(self.seqs)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.seqs:
            for a in s:
                h.update(np.asarray(a).tobytes())
                h.update(b"|")
        return h.hexdigest()[:16]

    def summary(self) -> dict:
        return {"examples": len(self), "formats": {"pairs": len(self)},
                "tokens": int(sum(len(c) + len(r) for c, _, r, _ in self.seqs)),
                "trained_tokens": int(sum(int(cs.sum()) + int(rs.sum()) for _, cs, _, rs in self.seqs))}


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids) if text else []


def _messages(value, where: str, field: str, *, role: str | None = None) -> list[dict]:
    from .sources import json_cell

    value = json_cell(value, where, field) if isinstance(value, str) and value.lstrip().startswith("[") else value
    if isinstance(value, str):
        return [{"role": role or "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{field}' must be a string or a non-empty list of messages")
    for j, m in enumerate(value, start=1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: '{field}' message {j} must be an object with string 'role' and 'content'")
    return list(value)


def _chat_completion(tokenizer, prompt_msgs, completion_msgs, where: str, field: str):
    from jqlora.tokenizer import TokenizerError

    if not callable(getattr(tokenizer, "chat_ids_and_mask", None)):
        raise DataError(f"{where}: a conversation needs a tokenizer with a chat template "
                        "(load it with jqlora.train.load_tokenizer from its Hugging Face folder)")
    try:
        ids, assistant = tokenizer.chat_ids_and_mask(list(prompt_msgs) + list(completion_msgs))
        prompt_ids = tokenizer.apply_chat_template(prompt_msgs, add_generation_prompt=True)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    k = 0
    while k < min(len(ids), len(prompt_ids)) and ids[k] == prompt_ids[k]:
        k += 1
    scored = np.asarray(assistant, bool) & (np.arange(len(ids)) >= k)
    if not scored.any():
        raise DataError(f"{where}: '{field}' renders no assistant token after the prompt")
    return np.asarray(ids, np.int32), scored


def tokenize_pair(tokenizer, special, obj: dict, where: str, seq_len: int):
    """One row -> ``(chosen_ids, chosen_scored, rejected_ids, rejected_scored)`` (module docstring)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected'")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(repr(k) for k in missing)} (a preference "
                        f"pair needs 'prompt', 'chosen' and 'rejected'; found keys: {sorted(obj)})")
    out = []
    chat = not isinstance(obj["prompt"], str) or obj["prompt"].lstrip().startswith("[{")
    prompt_msgs = _messages(obj["prompt"], where, "prompt") if chat else None
    for field in ("chosen", "rejected"):
        value = obj[field]
        if chat:
            ids, scored = _chat_completion(tokenizer, prompt_msgs,
                                           _messages(value, where, field, role="assistant"), where, field)
        else:
            if not isinstance(value, str):
                raise DataError(f"{where}: '{field}' must be a string when 'prompt' is one, got "
                                f"{type(value).__name__}")
            if not value.strip():
                raise DataError(f"{where}: '{field}' is empty")
            bos = [special.bos_id] if special.bos_id is not None else []
            eos = [special.eos_id] if special.eos_id is not None else []
            p, c = bos + _encode(tokenizer, obj["prompt"]), _encode(tokenizer, value) + eos
            ids = np.asarray(p + c, np.int32)
            scored = np.asarray([False] * len(p) + [True] * len(c), bool)
        ids, scored = ids[:seq_len + 1], scored[:seq_len + 1]
        if not scored[1:].any():
            raise DataError(f"{where}: no '{field}' token left within seq_len={seq_len} (the prompt "
                            f"takes {int(np.argmax(scored)) if scored.any() else len(ids)} tokens); "
                            "raise seq_len or shorten the prompt")
        out += [ids, scored]
    return tuple(out)


def load_pairs(data, tokenizer, special, seq_len: int, *, vocab_size: int | None = None,
               split: str | None = None) -> PairSet:
    """Read and tokenize pairs: ``data`` a path (any format :func:`jqlora.train.sources.read_rows`
    reads; ``split``: the split of a ``datasets`` folder), a :class:`PairSet` (returned as is) or a
    sequence of row dicts."""
    if isinstance(data, PairSet):
        return data
    if isinstance(data, (str, os.PathLike)):
        from .sources import read_rows

        source, rows = str(data), read_rows(data, split=split)
    else:
        source = "<data argument>"
        rows = ((f"{source}, row {i}", r) for i, r in enumerate(data, start=1))
    where, seqs = [], []
    for w, obj in rows:
        pair = tokenize_pair(tokenizer, special, obj, w, seq_len)
        if vocab_size is not None:
            top = max(int(pair[0].max()), int(pair[2].max()))
            if top >= vocab_size:
                raise DataError(f"{w}: token id {top} >= the model's vocab_size {vocab_size}")
        where.append(w)
        seqs.append(pair)
    if not seqs:
        raise DataError(f"{source}: no preference pairs")
    return PairSet(source, where, seqs)


def pair_batch(pairs: PairSet, idx: Sequence[int], seq_len: int, pad_id: int, *, routed: bool = False) -> dict:
    """Rows ``[chosen of idx..., rejected of idx...]`` right-padded to ``seq_len`` slots; ``routed``:
    laid out for the router's load-balancing loss (:func:`jqlora.train.router_aux.routed_rows`)."""
    seqs = [pairs.seqs[i][0] for i in idx] + [pairs.seqs[i][2] for i in idx]
    scored = [pairs.seqs[i][1] for i in idx] + [pairs.seqs[i][3] for i in idx]
    return (routed_rows if routed else right_padded_rows)(seqs, scored, seq_len, pad_id)


# ----------------------------------------------------------------------------------------------
# device side
# ----------------------------------------------------------------------------------------------

def _pair_values(model, reference, mb, *, beta, loss_type, label_smoothing):
    """Per pair: (losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)."""
    return _pair_scores(token_logps(model, mb), reference, mb, beta=beta, loss_type=loss_type,
                        label_smoothing=label_smoothing)


def _pair_scores(per_token, reference, mb, *, beta, loss_type, label_smoothing):
    """:func:`_pair_values` from the policy's per-token log-probs."""
    logps = per_token.sum(-1)
    if "ref_logps" in mb:
        ratios = logps - mb["ref_logps"]
    else:  # token by token: where the policy equals the reference, the ratio is exactly 0
        ratios = (per_token - jax.lax.stop_gradient(token_logps(reference(), mb))).sum(-1)
    n = mb["loss_mask"].sum(-1)
    b = logps.shape[0] // 2
    losses, cr, rr = dpo_losses_from_ratios(ratios[:b], ratios[b:], beta=beta, loss_type=loss_type,
                                            label_smoothing=label_smoothing, chosen_lengths=n[:b],
                                            rejected_lengths=n[b:])
    sg = jax.lax.stop_gradient
    return losses, cr, rr, sg(logps[:b]), sg(logps[b:])


def _sums(losses, cr, rr, lc, lr_):
    return {"rewards/chosen": cr.sum(), "rewards/rejected": rr.sum(),
            "rewards/accuracies": (cr > rr).astype(jnp.float32).sum(), "rewards/margins": (cr - rr).sum(),
            "logps/chosen": lc.sum(), "logps/rejected": lr_.sum()}


def _micro(model, reference, mb, *, pairs_per_step, aux_coef=0.0, micro_batches=1, **kw):
    """The micro-batch's share of the step's loss: its pairs' DPO losses over the step's pairs, plus
    ``aux_coef`` times the policy forward's load-balancing loss over the step's micro-batches."""
    if not aux_coef:
        values = _pair_values(model, reference, mb, **kw)
        return values[0].sum() / pairs_per_step, _sums(*values)
    per_token, aux = policy_logps_and_aux(model, mb)
    values = _pair_scores(per_token, reference, mb, **kw)
    sums = {**_sums(*values), "aux_loss": jax.lax.stop_gradient(aux) / micro_batches}
    return values[0].sum() / pairs_per_step + (aux_coef / micro_batches) * aux, sums


def _eval_values(model, reference, mb, **kw):
    return _pair_values(model, reference, mb, **kw)


def _ref_logps(model, reference, mb):
    return token_logps(reference(), mb).sum(-1)


# ----------------------------------------------------------------------------------------------
# the task
# ----------------------------------------------------------------------------------------------

class DPOTask:
    """DPO for :func:`jqlora.train.objective_loop.train_objective` (its module docstring)."""

    columns = METRICS
    eval_columns = ("loss",) + METRICS
    shown = ("rewards/accuracies", "rewards/margins")

    def __init__(self, model, config, data, tokenizer, eval_data):
        from .objective_data import resolve_tokenizer

        self.config = config
        tokenizer, self.special, vocab = resolve_tokenizer(config, tokenizer, model, data, eval_data)
        self.pairs = load_pairs(config.data_path if data is None else data, tokenizer, self.special,
                                config.seq_len, vocab_size=vocab, split=getattr(config, "data_split", None))
        ev = config.eval_data_path if eval_data is None else eval_data
        self.eval_pairs = None if ev is None else load_pairs(ev, tokenizer, self.special, config.seq_len,
                                                             vocab_size=vocab,
                                                             split=getattr(config, "eval_data_split", None))
        from .objective_data import EpochOrder

        self.batch_size = int(config.batch_size)
        self.order = EpochOrder(len(self.pairs), config.seed, config.shuffle)
        self.ref_table = None

        self.aux_coef = router_aux_coef(model, config)  # None: off (a model without routers, or config.json)
        if self.aux_coef is not None:
            self.columns = METRICS + ("aux_loss",)

    @property
    def evaluating(self) -> bool:
        return self.eval_pairs is not None

    def rows_per_epoch(self) -> int:
        return len(self.pairs)

    def state_dict(self) -> dict:
        return {**self.order.state_dict(), "fingerprint": self.pairs.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") not in (None, self.pairs.fingerprint()):
            raise DataError(f"{self.pairs.source}: the checkpoint was saved for other pairs (a changed "
                            "data file, tokenizer or seq_len)")
        self.order.load_state_dict(state)

    def _kw(self):
        c = self.config
        return dict(beta=float(c.dpo_beta), loss_type=c.dpo_loss, label_smoothing=float(c.dpo_label_smoothing))

    def bind(self, model, optimizer) -> None:
        c = self.config
        self.model = model
        n = self.batch_size * int(c.grad_accum)
        kw = tuple(sorted(self._kw().items()))
        aux = () if self.aux_coef is None else (("aux_coef", self.aux_coef), ("micro_batches", int(c.grad_accum)))
        self._step = _compiled_step(kw + (("pairs_per_step", float(n)),) + aux).bind(model, optimizer)
        self._eval_fn = _compiled_eval(kw)
        if c.precompute_ref:
            self.ref_table = self.reference_logps(self.pairs)

    def reference_logps(self, pairs: PairSet) -> np.ndarray:
        """(pairs, 2) float32: the reference's (chosen, rejected) log-probs of every pair."""
        fn = _compiled_ref().bind(self.model)
        out = np.zeros((len(pairs), 2), np.float32)
        b = self.batch_size
        for s in range(0, len(pairs), b):
            idx = list(range(s, min(s + b, len(pairs))))
            idx_full = idx + [idx[-1]] * (b - len(idx))  # a full batch: one compiled shape
            v = np.asarray(fn({k: jnp.asarray(x) for k, x in
                               pair_batch(pairs, idx_full, self.config.seq_len, self.special.pad_id).items()}))
            out[idx, 0], out[idx, 1] = v[:len(idx)], v[b:b + len(idx)]
        return out

    def step(self) -> dict:
        c = self.config
        mbs = []
        for _ in range(int(c.grad_accum)):
            idx = self.order.take(self.batch_size)
            mb = pair_batch(self.pairs, idx, c.seq_len, self.special.pad_id, routed=self.aux_coef is not None)
            if self.ref_table is not None:
                mb["ref_logps"] = np.concatenate([self.ref_table[idx, 0], self.ref_table[idx, 1]])
            mbs.append(mb)
        batch = {k: np.stack([mb[k] for mb in mbs]) for k in mbs[0]}
        tokens = int(sum(np.count_nonzero(mb["input_ids"] != self.special.pad_id) for mb in mbs))
        m = {k: v.item() for k, v in jax.device_get(self._step(batch)).items()}
        n = self.batch_size * int(c.grad_accum)
        for k in METRICS:
            m[k] /= n
        m["tokens"] = tokens
        return m

    def evaluate(self) -> dict:
        """The metrics over every held-out pair (model in eval mode)."""
        model, c = self.model, self.config
        model.eval()
        try:
            fn = self._eval_fn.bind(model)
            acc = np.zeros(7)
            b, pairs = self.batch_size, self.eval_pairs
            for s in range(0, len(pairs), b):
                idx = list(range(s, min(s + b, len(pairs))))
                k = len(idx)
                idx = idx + [idx[-1]] * (b - k)
                v = [np.asarray(x)[:k] for x in fn({key: jnp.asarray(x) for key, x in
                                                    pair_batch(pairs, idx, c.seq_len, self.special.pad_id).items()})]
                losses, cr, rr, lc, lr_ = v
                acc += [losses.sum(), cr.sum(), rr.sum(), (cr > rr).sum(), (cr - rr).sum(), lc.sum(), lr_.sum()]
        finally:
            model.train()
        acc /= len(self.eval_pairs)
        return dict(zip(self.eval_columns, acc.tolist()))


# compiled once per setting (and model structure), like the SFT step: runs of equal settings in
# one process share them
@functools.lru_cache(maxsize=8)
def _compiled_step(kw: tuple):
    return make_update_step(_bind(_micro, **dict(kw)))


@functools.lru_cache(maxsize=8)
def _compiled_eval(kw: tuple):
    return make_eval_fn(_bind(_eval_values, **dict(kw)))


@functools.lru_cache(maxsize=1)
def _compiled_ref():
    return make_eval_fn(_ref_logps)


def _bind(fn, **kw):
    """``fn`` with keyword arguments fixed, as a named function (compiled functions log names)."""
    def bound(model, reference, mb):
        return fn(model, reference, mb, **kw)

    bound.__name__ = fn.__name__.lstrip("_")
    return bound
