"""GRPO (``TrainConfig.objective = "grpo"``): prompts, rollouts from the policy itself, rewards from
Python functions (:mod:`jqlora.train.rewards`), group-normalised advantages and the clipped-ratio
loss with TRL 1.16's definitions; the task :func:`jqlora.train.train` runs for it
(:mod:`jqlora.train.objective_loop`).

Data: one prompt per row, ``{"prompt": "..."}`` (BOS + prompt), ``{"prompt": [messages]}`` or
``{"messages": [...]}`` (rendered with the chat template and its generation header). Every other
field goes to the reward functions. A prompt longer than ``seq_len - max_completion_length``
tokens keeps its last tokens.

One step: ``batch_size * grad_accum`` prompts, ``num_generations`` completions each, sampled from
the current policy (LoRA on, eval mode) at ``temperature`` / ``top_p`` with jqlora's batched
generation (:func:`jqlora.models.generate_batch`), up to ``max_completion_length`` new tokens; a completion ends with its first EOS,
which it keeps. The rewards of each function, weighted (``reward_weights``) and summed, give
``A = (r - mean_group(r)) / (std_group(r) + 1e-4)`` (``scale_rewards="group"``; "batch": the std
of the step; "none": no division; std with Bessel's correction, as TRL), 0 for a group whose
rewards are all equal. Per completion token, with ``logp`` at ``logits / temperature``,
``ratio = exp(logp - logp_old)`` (one update per rollout batch: ``logp_old`` is ``logp``
without gradient, so the ratio is 1 and its gradient that of ``logp``)::

    l_t = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + grpo_beta * KL_t
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (k3; ref: LoRA off, no gradient)

and the step's loss is, over the completion tokens (``grpo_loss``): "grpo" the mean over
completions of each completion's token mean; "dr_grpo" the token sum over
``completions * max_completion_length``; "dapo" the token sum over the step's completion token
count. ``grpo_beta = 0`` skips the reference pass.

Logged per step (TRL's names): ``reward``, ``reward_std``, ``rewards/<function>/mean`` and
``/std``, ``frac_reward_zero_std``, ``kl`` (when ``grpo_beta > 0``), ``clip_ratio/region_mean``,
``completions/mean_length``, ``min_length``, ``max_length``, ``clipped_ratio`` (no EOS within
the limit), ``rollout_tokens_per_s`` (generated tokens over the generation's wall time), and the
step's wall time by part: ``time/rollout_s``, ``time/rewards_s``, ``time/update_s`` (the
reference pass, the policy's forward and backward and the optimizer update; the first step's
includes compilation).

Mixture-of-experts models: where the router's load-balancing loss is on
(:func:`jqlora.train.router_aux.router_aux_coef`), each micro-batch's loss adds ``coef / grad_accum``
times the aux loss of the policy's forward over its prompt + completion tokens, as TRL's
``GRPOTrainer`` adds it (:mod:`jqlora.train.router_aux`); logged as ``aux_loss`` (the mean over
the micro-batches).

Resume: the data position and the rollout RNG key are the task's state in each checkpoint; a
resumed run draws the same prompts and samples the same completions as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from .examples import DataError
from .logps import right_padded_rows, token_logps
from .objective_step import make_update_step
from .objectives import reward_weight_list
from .router_aux import policy_logps_and_aux, routed_rows, router_aux_coef

__all__ = ["PromptSet", "load_prompts", "group_advantages", "grpo_token_loss", "GRPOTask"]

STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


# ----------------------------------------------------------------------------------------------
# advantages and the loss (pure functions)
# ----------------------------------------------------------------------------------------------

def _std(x: np.ndarray, axis=None, keepdims=False) -> np.ndarray:
    """Standard deviation with Bessel's correction (TRL's nanstd, without NaNs)."""
    return np.std(x, axis=axis, ddof=1, keepdims=keepdims)


def group_advantages(rewards: np.ndarray, num_generations: int, scale: str = "group"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(advantages (N,), zero-std flags (N,)) of total rewards (N,) in consecutive groups of
    ``num_generations`` (module docstring)."""
    r = np.asarray(rewards, np.float32)
    g = r.reshape(-1, num_generations)
    mean = np.repeat(g.mean(axis=1), num_generations)
    if scale == "batch":
        std = np.full_like(r, _std(r) if r.size > 1 else 0.0)
    else:
        std = np.repeat(_std(g, axis=1), num_generations).astype(np.float32)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + np.float32(STD_EPS))
    return adv.astype(np.float32), np.isclose(std, 0.0)


def grpo_token_loss(logps, old_logps, advantages, mask, *, epsilon: float, epsilon_high: float | None = None,
                    beta: float = 0.0, ref_logps=None):
    """(per-token loss (N, T), per-token KL (N, T) or None, ratio (N, T)): the clipped objective
    plus ``beta`` times the k3 KL (module docstring); zero outside ``mask``."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1 - epsilon, 1 + eps_high)
    adv = advantages[:, None]
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        d = ref_logps - logps
        kl = jnp.exp(d) - d - 1
        per_token = per_token + beta * kl
    mask = mask.astype(per_token.dtype)
    return per_token * mask, (None if kl is None else kl * mask), ratio


def reduce_loss(per_token, mask, loss_type: str, *, n_completions, n_tokens, max_completion_length: int):
    """The share of the step's loss of these completions: per-token losses summed as
    ``loss_type`` does, divided by the step's normaliser (``n_completions`` / ``n_tokens``: the
    step's totals)."""
    if loss_type == "grpo":
        per_seq = per_token.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
        return per_seq.sum() / n_completions
    if loss_type == "dr_grpo":
        return per_token.sum() / (n_completions * max_completion_length)
    if loss_type == "dapo":
        return per_token.sum() / jnp.maximum(n_tokens, 1.0)
    raise ValueError(f"unknown GRPO loss {loss_type!r}")


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PromptSet:
    """Tokenized prompts: ``ids[i]`` (int32), ``prompts[i]`` (the row's prompt as given: a string or
    a message list), ``fields[i]`` (the row's other fields), ``where[i]``, ``chat`` (any
    conversation), ``source``."""

    source: str
    where: list[str]
    ids: list[np.ndarray]
    prompts: list
    fields: list[dict]
    chat: list[bool]

    def __len__(self) -> int:
        return len(self.ids)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for a in self.ids:
            h.update(a.tobytes())
            h.update(b"|")
        return h.hexdigest()[:16]

    def summary(self) -> dict:
        return {"examples": len(self), "formats": {"prompts": len(self)},
                "tokens": int(sum(len(a) for a in self.ids)), "trained_tokens": 0}


def _prompt_ids(tokenizer, special, obj: dict, where: str):
    from jqlora.tokenizer import TokenizerError

    from .preference import _messages

    if "prompt" in obj:
        key = "prompt"
    elif "messages" in obj:
        key = "messages"
    else:
        raise DataError(f"{where}: no 'prompt' (or 'messages') field; found keys: {sorted(obj)}")
    value = obj[key]
    if isinstance(value, str) and key == "prompt" and not value.lstrip().startswith("[{"):
        if not value.strip():
            raise DataError(f"{where}: 'prompt' is empty")
        bos = [special.bos_id] if special.bos_id is not None else []
        return key, value, bos + list(tokenizer.encode(value, add_special_tokens=False).ids), False
    msgs = _messages(value, where, key)
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise DataError(f"{where}: a conversation needs a tokenizer with a chat template")
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    return key, msgs, list(ids), True


def max_prompt_length(config) -> int:
    """The prompt tokens kept: ``seq_len - max_completion_length`` (at least 1)."""
    n = int(config.seq_len) - int(config.max_completion_length)
    if n < 1:
        from ..errors import SettingError

        raise SettingError(f"seq_len={config.seq_len} leaves no room for a prompt before "
                           f"max_completion_length={config.max_completion_length} new tokens")
    return n


def load_prompts(data, tokenizer, special, max_prompt_len: int, *, vocab_size: int | None = None,
                 split: str | None = None) -> PromptSet:
    """Read and tokenize prompts: ``data`` a path (any :func:`jqlora.train.sources.read_rows`
    source; ``split``: the split of a ``datasets`` folder), a :class:`PromptSet` (returned as is)
    or a sequence of row dicts."""
    if isinstance(data, PromptSet):
        return data
    if isinstance(data, (str, os.PathLike)):
        from .sources import read_rows

        source, rows = str(data), read_rows(data, split=split)
    else:
        source = "<data argument>"
        rows = ((f"{source}, row {i}", r) for i, r in enumerate(data, start=1))
    out = PromptSet(source, [], [], [], [], [])
    for w, obj in rows:
        if not isinstance(obj, dict):
            raise DataError(f"{w}: expected an object with a 'prompt'")
        key, prompt, ids, chat = _prompt_ids(tokenizer, special, obj, w)
        if not ids:
            raise DataError(f"{w}: the prompt tokenizes to no tokens")
        ids = np.asarray(ids[-max_prompt_len:], np.int32)
        if vocab_size is not None and int(ids.max()) >= vocab_size:
            raise DataError(f"{w}: token id {int(ids.max())} >= the model's vocab_size {vocab_size}")
        out.where.append(w)
        out.ids.append(ids)
        out.prompts.append(prompt)
        out.fields.append({k: v for k, v in obj.items() if k != key})
        out.chat.append(chat)
    if not out.ids:
        raise DataError(f"{source}: no prompts")
    return out


# ----------------------------------------------------------------------------------------------
# rollouts
# ----------------------------------------------------------------------------------------------

def rollout(model, prompts: list[np.ndarray], max_new_tokens: int, *, key, temperature: float, top_p: float,
            eos_ids: tuple[int, ...], pad_id: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Sample one completion per prompt with :func:`jqlora.models.generate_batch` (LoRA on, eval
    mode; one compiled program per batch, prompt-width and token bucket): ``(completions, finished)``,
    each completion cut after its first EOS (kept)."""
    from jqlora.models import generate_batch

    r = generate_batch(model, [p.tolist() for p in prompts], max_new_tokens, key=key, temperature=temperature,
                       top_p=top_p, eos_token_id=list(eos_ids) or None, pad_token_id=pad_id)
    tokens, lengths = np.asarray(r.tokens), np.asarray(r.lengths)
    return [tokens[i, :lengths[i]] for i in range(len(prompts))], np.asarray(r.finished, bool)


# ----------------------------------------------------------------------------------------------
# device side
# ----------------------------------------------------------------------------------------------

def _micro(model, reference, mb, *, temperature, beta, epsilon, epsilon_high, loss_type, max_completion_length,
           aux_coef=0.0, micro_batches=1):
    mask = mb["loss_mask"]
    if aux_coef:
        logps, aux = policy_logps_and_aux(model, mb, temperature=temperature)
    else:
        logps = token_logps(model, mb, temperature=temperature)
    ref = None
    if beta != 0.0:
        ref = jax.lax.stop_gradient(token_logps(reference(), mb, temperature=temperature))
    per_token, kl, ratio = grpo_token_loss(logps, jax.lax.stop_gradient(logps), mb["advantages"], mask,
                                           epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, ref_logps=ref)
    loss = reduce_loss(per_token, mask, loss_type, n_completions=mb["n_completions"], n_tokens=mb["n_tokens"],
                       max_completion_length=max_completion_length)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = mb["advantages"][:, None]
    clipped = (((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))).astype(jnp.float32)
    sums = {"clipped": jax.lax.stop_gradient((clipped * mask).sum())}
    if kl is not None:
        sums["kl"] = jax.lax.stop_gradient(kl.sum())
    if aux_coef:  # TRL: coef * aux / gradient accumulation steps, per micro-batch
        loss = loss + (aux_coef / micro_batches) * aux
        sums["aux_loss"] = jax.lax.stop_gradient(aux) / micro_batches
    return loss, sums


@functools.lru_cache(maxsize=8)  # once per setting (and model structure), like the SFT step
def _compiled_step(temperature, beta, epsilon, epsilon_high, loss_type, max_completion_length, aux_coef=0.0,
                   micro_batches=1):
    def grpo_micro(m, reference, mb):
        return _micro(m, reference, mb, temperature=temperature, beta=beta, epsilon=epsilon,
                      epsilon_high=epsilon_high, loss_type=loss_type, max_completion_length=max_completion_length,
                      aux_coef=aux_coef, micro_batches=micro_batches)

    return make_update_step(grpo_micro)


# ----------------------------------------------------------------------------------------------
# the task
# ----------------------------------------------------------------------------------------------

class GRPOTask:
    """GRPO for :func:`jqlora.train.objective_loop.train_objective` (its module docstring)."""

    def __init__(self, model, config, data, tokenizer, eval_data):
        from .objective_data import EpochOrder, resolve_tokenizer
        from .rewards import load_rewards

        self.config = config
        self.tokenizer, self.special, vocab = resolve_tokenizer(config, tokenizer, model)
        self.prompts = load_prompts(config.data_path if data is None else data, self.tokenizer, self.special,
                                    max_prompt_length(config), vocab_size=vocab,
                                    split=getattr(config, "data_split", None))
        self.rewards = load_rewards(config.reward)
        self.weights = np.asarray(reward_weight_list(config), np.float32)
        eos = self.special.eos_id
        self.eos_ids = () if eos is None else (int(eos),)
        self.width = max(len(p) for p in self.prompts.ids)
        self.batch_size = int(config.batch_size)
        self.order = EpochOrder(len(self.prompts), config.seed, config.shuffle)
        self.key = jax.random.key_data(jax.random.key(int(config.seed) + 1))
        self.evaluating = False
        names = []
        for f in self.rewards:  # one metric per function: a repeated name gets _2, _3, ...
            k = 1
            while (f.name if k == 1 else f"{f.name}_{k}") in names:
                k += 1
            names.append(f.name if k == 1 else f"{f.name}_{k}")
        self.reward_names = names
        self.columns = ("reward", "reward_std", *[f"rewards/{n}/{s}" for n in names for s in ("mean", "std")],
                        "frac_reward_zero_std", *(("kl",) if config.grpo_beta else ()), "clip_ratio/region_mean",
                        "completions/mean_length", "completions/min_length", "completions/max_length",
                        "completions/clipped_ratio", "rollout_tokens_per_s", "time/rollout_s", "time/rewards_s",
                        "time/update_s")
        self.eval_columns = ()
        self.shown = ("reward",)

        self.aux_coef = router_aux_coef(model, config)  # None: off (a model without routers, or config.json)
        if self.aux_coef is not None:
            self.columns += ("aux_loss",)

    def rows_per_epoch(self) -> int:
        return len(self.prompts)

    def state_dict(self) -> dict:
        return {**self.order.state_dict(), "fingerprint": self.prompts.fingerprint(),
                "rollout_key": [int(x) for x in np.asarray(self.key).ravel()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") not in (None, self.prompts.fingerprint()):
            raise DataError(f"{self.prompts.source}: the checkpoint was saved for other prompts (a changed "
                            "data file, tokenizer or seq_len)")
        self.order.load_state_dict(state)
        if "rollout_key" in state:
            self.key = jnp.asarray(np.asarray(state["rollout_key"], np.uint32).reshape(np.shape(self.key)))

    def bind(self, model, optimizer) -> None:
        c = self.config
        self.model = model

        aux = () if self.aux_coef is None else (self.aux_coef, int(c.grad_accum))
        self._step = _compiled_step(
            float(c.temperature), float(c.grpo_beta), float(c.epsilon),
            None if c.epsilon_high is None else float(c.epsilon_high), c.grpo_loss,
            int(c.max_completion_length), *aux).bind(model, optimizer)

    def sample(self, idx: list[int], key) -> tuple[list[int], list[np.ndarray], float]:
        """(prompt index per completion, completions, seconds): ``num_generations`` per prompt."""
        c = self.config
        g = int(c.num_generations)
        rows = [i for i in idx for _ in range(g)]
        t0 = time.perf_counter()
        completions, self._finished = rollout(
            self.model, [self.prompts.ids[i] for i in rows], int(c.max_completion_length),
            key=jax.random.wrap_key_data(key), temperature=float(c.temperature), top_p=float(c.top_p),
            eos_ids=self.eos_ids, pad_id=self.special.pad_id)
        return rows, completions, time.perf_counter() - t0

    def score(self, rows: list[int], completions: list[np.ndarray]) -> np.ndarray:
        """(completions, functions) rewards of the completions of prompts ``rows``."""
        from .rewards import score

        texts = [self.tokenizer.decode([int(t) for t in ids if int(t) not in self.eos_ids],
                                       skip_special_tokens=True) for ids in completions]
        p = self.prompts
        comps = [[{"role": "assistant", "content": t}] if p.chat[i] else t for i, t in zip(rows, texts)]
        keys = sorted({k for i in rows for k in p.fields[i]})
        fields = {k: [p.fields[i].get(k) for i in rows] for k in keys}
        return score(self.rewards, [p.prompts[i] for i in rows], comps, fields)

    def step(self) -> dict:
        c = self.config
        ga, g = int(c.grad_accum), int(c.num_generations)
        idx = self.order.take(self.batch_size * ga)
        self.key, sub = jax.random.split(jax.random.wrap_key_data(self.key))
        self.key = jax.random.key_data(self.key)
        rows, completions, seconds = self.sample(idx, jax.random.key_data(sub))
        t0 = time.perf_counter()
        per_func = self.score(rows, completions)
        t_rewards = time.perf_counter() - t0
        total = (per_func * self.weights[None, :]).sum(axis=1)
        adv, zero_std = group_advantages(total, g, c.scale_rewards)
        lengths = np.asarray([len(x) for x in completions])
        stacked = self.update_batches(rows, completions, adv)
        n_tok = float(stacked["n_tokens"][0])
        t0 = time.perf_counter()
        m = {k: v.item() for k, v in jax.device_get(self._step(stacked)).items()}
        m["time/update_s"] = time.perf_counter() - t0
        m["time/rollout_s"], m["time/rewards_s"] = seconds, t_rewards
        m["clip_ratio/region_mean"] = m.pop("clipped") / max(n_tok, 1.0)
        if "kl" in m:
            m["kl"] /= max(n_tok, 1.0)
        m["reward"] = float(total.mean())
        m["reward_std"] = float(_std(total))
        for j, name in enumerate(self.reward_names):
            m[f"rewards/{name}/mean"] = float(per_func[:, j].mean())
            m[f"rewards/{name}/std"] = float(_std(per_func[:, j]))
        m["frac_reward_zero_std"] = float(zero_std.mean())
        finished = self._finished
        m["completions/mean_length"] = float(lengths.mean())
        m["completions/min_length"] = float(lengths.min())
        m["completions/max_length"] = float(lengths.max())
        m["completions/clipped_ratio"] = float(1.0 - finished.mean())
        m["rollout_tokens_per_s"] = float(lengths.sum() / max(seconds, 1e-9))
        m["tokens"] = int(lengths.sum())
        self.last_rollout = {"rows": rows, "completions": completions, "rewards": per_func, "advantages": adv}
        return m

    def update_batches(self, rows: list[int], completions: list[np.ndarray], advantages: np.ndarray) -> dict:
        """The step's ``grad_accum`` micro-batches of prompt + completion rows (prompts ``rows``),
        with their advantages and the step's completion and completion-token counts."""
        ga = int(self.config.grad_accum)
        seqs = [np.concatenate([self.prompts.ids[i], comp]) for i, comp in zip(rows, completions)]
        scored = [np.r_[np.zeros(len(self.prompts.ids[i]), bool), np.ones(len(comp), bool)]
                  for i, comp in zip(rows, completions)]
        width = self.width + int(self.config.max_completion_length) - 1
        batch = (right_padded_rows if self.aux_coef is None else routed_rows)(seqs, scored, width, self.special.pad_id)
        batch["advantages"] = np.asarray(advantages, np.float32)
        n_tok = float(batch["loss_mask"].sum())
        per = len(rows) // ga
        stacked = {k: v.reshape(ga, per, *v.shape[1:]) for k, v in batch.items()}
        stacked["n_completions"] = np.full((ga,), float(len(rows)), np.float32)
        stacked["n_tokens"] = np.full((ga,), n_tok, np.float32)
        return stacked

    def evaluate(self) -> dict:  # pragma: no cover - GRPO has no held-out evaluation
        raise NotImplementedError
