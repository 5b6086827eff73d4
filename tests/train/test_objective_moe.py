"""DPO and GRPO on a mixture-of-experts policy add the router's load-balancing loss as TRL 1.16's
``DPOTrainer`` / ``GRPOTrainer`` do: ``coef * aux_loss`` of the policy's forward (DPO: chosen and
rejected rows together; GRPO: prompt + completion rows), one per micro-batch, averaged over the
micro-batches; the reference pass adds nothing.

The torch side writes the objectives out (TRL's losses are not callable alone, see
tests/train/test_dpo.py) on a tiny random transformers Qwen3-MoE with the policy's router LoRA
merged into its router weights, and takes the aux loss from transformers'
`load_balancing_loss_func` on that forward's router logits, the attention mask leaving the padding
out; gradients of the total with respect to the router LoRA come from torch autograd.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moe_checkpoints as mc  # noqa: E402
from jqlora import lora, models  # noqa: E402
from jqlora import train as T  # noqa: E402
from jqlora.train import grpo as G  # noqa: E402
from jqlora.train import preference as P  # noqa: E402

pytestmark = pytest.mark.torch

COEF = 0.1  # large enough that a missing or mis-scaled aux term shows in the loss
BETA = 0.5
RANK, ALPHA = 4, 8
SCALE = ALPHA / RANK


def _tokenizer(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import _make_tokenizer

    return T.load_tokenizer(_make_tokenizer(tmp_path / "tok"))


def _pair(output_router_logits=True):
    """(transformers model, jqlora model with a random LoRA on each router, {router: (A, B)})."""
    tm = mc.tiny_moe("qwen3_moe", router_aux_loss_coef=COEF, output_router_logits=output_router_logits)
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in tm.state_dict().items()}
    m = models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                           lora=lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["gate"]))
    rng = np.random.default_rng(3)
    values = {n: {"lora_A": np.asarray(p["lora_A"]), "lora_B": rng.normal(0, 0.3, p["lora_B"].shape).astype(np.float32)}
              for n, p in lora.lora_params_by_module(m).items()}
    assert values and all(n.endswith("mlp.gate") for n in values)
    lora.set_lora_params(m, values)
    return tm, m, {n: (v["lora_A"], v["lora_B"]) for n, v in values.items()}


def _policy(tm, factors):
    """A copy of `tm` whose routers are W + scale * B A, their weights requiring gradients."""
    pol = copy.deepcopy(tm)
    mods = dict(pol.named_modules())
    for p in pol.parameters():
        p.requires_grad_(False)
    for name, (a, b) in factors.items():
        w = mods[name].weight
        with torch.no_grad():
            w.add_(SCALE * torch.from_numpy(b @ a))
        w.requires_grad_(True)
    return pol, {n: mods[n].weight for n in factors}


def _forward(model, seqs, scored, width, aux):
    """(B, width - 1) log-probs of the scored next tokens (0 elsewhere), and the load-balancing
    loss of the forward (transformers' load_balancing_loss_func on its router logits, padding
    masked) when `aux`."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    score = torch.zeros((len(seqs), width - 1))
    for i, (s, sc) in enumerate(zip(seqs, scored)):
        ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
        score[i, :len(s) - 1] = torch.as_tensor(np.asarray(sc[1:], np.float32))
    out = model(ids, attention_mask=mask, output_router_logits=aux)
    lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    logps = lp * score
    if not aux:
        return logps, None
    cfg = model.config
    return logps, load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, mask)


def _lora_grad_norm(weights, factors):
    """The norm of the LoRA gradients from the router weights' gradients G: dB = s G A^T, dA = s B^T G."""
    total = 0.0
    for name, (a, b) in factors.items():
        g = weights[name].grad.numpy()
        total += np.sum((SCALE * g @ a.T) ** 2) + np.sum((SCALE * b.T @ g) ** 2)
    return math.sqrt(total)


def _pairs():
    """Two pairs of random ids (prompt, completion lengths differ; one pair fills seq_len + 1)."""
    rng = np.random.default_rng(0)
    seqs = []
    for (pc, cc), (pr, cr) in (((3, 5), (3, 2)), ((5, 8), (5, 4))):
        row = []
        for p, c in ((pc, cc), (pr, cr)):
            row += [rng.integers(3, 256, p + c).astype(np.int32), np.r_[np.zeros(p, bool), np.ones(c, bool)]]
        seqs.append(tuple(row))
    return P.PairSet("<test>", ["pair 1", "pair 2"], seqs)


def test_dpo_step_adds_the_policy_router_aux_loss(tmp_path):
    """Step 1 of `train(objective="dpo")` (config.json's output_router_logits on, its coefficient):
    loss = mean sigmoid DPO loss + coef * aux of the policy's chosen + rejected forward, every token
    of each sequence routed; `aux_loss` logged; the gradient norm torch autograd's."""
    tm, m, factors = _pair()
    pairs = _pairs()
    seq_len = 12
    cfg = T.TrainConfig(objective="dpo", seq_len=seq_len, batch_size=2, steps=1, lr=1e-3, dpo_beta=BETA,
                        out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, save_every=0,
                        log_every=1, grad_clip=None)
    res = T.train(m, cfg, data=pairs, tokenizer=_tokenizer(tmp_path))

    seqs = [p[0] for p in pairs.seqs] + [p[2] for p in pairs.seqs]
    scored = [p[1] for p in pairs.seqs] + [p[3] for p in pairs.seqs]
    assert max(len(s) for s in seqs) == seq_len + 1
    with torch.no_grad():
        ref, _ = _forward(tm, seqs, scored, seq_len + 1, aux=False)
    pol, weights = _policy(tm, factors)
    logps, aux = _forward(pol, seqs, scored, seq_len + 1, aux=True)
    ratios = logps.sum(-1) - ref.sum(-1)
    dpo = -torch.nn.functional.logsigmoid(BETA * (ratios[:2] - ratios[2:])).mean()
    want = dpo + COEF * aux
    want.backward()

    got = res.metrics[0]
    assert abs(got["aux_loss"] - aux.item()) < 1e-5, (got["aux_loss"], aux.item())
    assert abs(got["loss"] - want.item()) < 1e-5, (got["loss"], want.item(), dpo.item())
    norm = _lora_grad_norm(weights, factors)
    assert abs(got["grad_norm"] - norm) < 1e-4 * norm, (got["grad_norm"], norm)
    header = (tmp_path / "run" / "loss.csv").read_text().splitlines()[0].split(",")
    assert "aux_loss" in header


def _grpo_setup(tmp_path, **kw):
    (tmp_path / "rew.py").write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    tm, m, factors = _pair(**kw)
    cfg = T.TrainConfig(objective="grpo", reward=[f"{tmp_path / 'rew.py'}:one"], seq_len=16, batch_size=1,
                        grad_accum=2, num_generations=2, max_completion_length=6, grpo_beta=0.0, grpo_loss="grpo",
                        lr=1e-3, steps=1, out_dir=str(tmp_path / "g"), progress=False, tensorboard=False,
                        grad_clip=None)
    task = G.GRPOTask(m, cfg, [{"prompt": "abc"}, {"prompt": "hello"}], _tokenizer(tmp_path), None)
    return tm, m, factors, cfg, task


def test_grpo_step_adds_the_mean_router_aux_loss_of_its_micro_batches(tmp_path):
    """One GRPO update on fixed completions, two micro-batches: loss = TRL's "grpo" loss (ratio 1:
    minus the mean advantage) + coef * the mean over the micro-batches of each one's aux loss."""
    tm, m, factors, cfg, task = _grpo_setup(tmp_path)
    assert task.aux_coef == pytest.approx(COEF) and "aux_loss" in task.columns
    optimizer = nnx.Optimizer(m, T.make_optimizer(cfg.lr, 0, 1, grad_clip=None), wrt=nnx.LoRAParam)
    task.bind(m, optimizer)
    rng = np.random.default_rng(5)
    rows = [0, 0, 1, 1]
    completions = [rng.integers(3, 256, n).astype(np.int32) for n in (6, 2, 4, 6)]
    adv = np.asarray([0.7, -0.2, 1.3, -0.4], np.float32)
    got = {k: float(v) for k, v in task._step(task.update_batches(rows, completions, adv)).items()}

    pol, weights = _policy(tm, factors)
    seqs = [np.concatenate([task.prompts.ids[i], c]) for i, c in zip(rows, completions)]
    scored = [np.r_[np.zeros(len(task.prompts.ids[i]), bool), np.ones(len(c), bool)] for i, c in zip(rows, completions)]
    width = max(len(s) for s in seqs)
    policy, auxes = 0.0, []
    for j in (0, 2):  # one forward per micro-batch, as TRL runs them
        lp, a = _forward(pol, seqs[j:j + 2], scored[j:j + 2], width, aux=True)
        mask = torch.zeros(lp.shape)
        for i, sc in enumerate(scored[j:j + 2]):
            mask[i, :len(sc) - 1] = torch.as_tensor(np.asarray(sc[1:], np.float32))
        ratio = torch.exp(lp - lp.detach())  # one update per rollout batch: ratio 1, gradient of logp
        per_seq = (-ratio * torch.as_tensor(adv[j:j + 2])[:, None] * mask).sum(-1) / mask.sum(-1)
        policy = policy + per_seq.sum() / len(rows)
        auxes.append(a)
    aux = (auxes[0] + auxes[1]) / 2
    assert abs(policy.item() + float(adv.mean())) < 1e-6
    want = policy + COEF * aux
    want.backward()
    assert abs(got["aux_loss"] - aux.item()) < 1e-5, (got["aux_loss"], aux.item())
    assert abs(got["loss"] - want.item()) < 1e-5, (got["loss"], want.item())
    norm = _lora_grad_norm(weights, factors)
    assert abs(got["grad_norm"] - norm) < 1e-4 * norm, (got["grad_norm"], norm)


def test_objectives_follow_config_json_when_the_coefficient_is_not_set(tmp_path):
    """TrainConfig.router_aux_loss_coef None: off where config.json's output_router_logits is false
    (the released Qwen3-MoE and Mixtral configs), as for SFT."""
    *_, task = _grpo_setup(tmp_path, output_router_logits=False)
    assert task.aux_coef is None and "aux_loss" not in task.columns
