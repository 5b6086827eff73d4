"""GRPO (jqlora.train.grpo, jqlora.train.rewards): group advantages against TRL's own `nanstd`,
the clipped objective with the k3 KL and each loss normalisation against TRL 1.16's
`_compute_loss` formulas in torch (on transformers + PEFT + bitsandbytes NF4 at the same weights,
fp32, for the loss and the LoRA gradients), seeded rollouts, bit-exact resume, and reward
functions that fail."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jqlora import lora, models  # noqa: E402
from jqlora import train as T  # noqa: E402
from jqlora.lora import reference as R  # noqa: E402
from jqlora.train import grpo as G  # noqa: E402
from jqlora.train import rewards as RW  # noqa: E402
from jqlora.train.logps import right_padded_rows  # noqa: E402

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
RANK, ALPHA, TEMP, L = 4, 8, 0.7, 6


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_match_trl_with_a_zero_variance_group():
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd  # trl: the dev extra (not in the GPU image)

    rewards = np.asarray([1.0, 0.0, 0.5, 0.25, 0.3, 0.3, 0.3, 0.3, 2.0, -1.0, 0.0, 1.0], np.float32)
    adv, zero = G.group_advantages(rewards, 4, "group")
    t = torch.as_tensor(rewards)
    mean = t.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(t.view(-1, 4), dim=1).repeat_interleave(4)
    want = ((t - mean) / (std + 1e-4)).numpy()
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
    assert np.all(adv[4:8] == 0.0) and zero.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    adv_b, _ = G.group_advantages(rewards, 4, "batch")
    np.testing.assert_allclose(adv_b, ((t - mean) / (nanstd(t) + 1e-4)).numpy(), rtol=1e-5, atol=1e-6)
    adv_n, _ = G.group_advantages(rewards, 4, "none")
    np.testing.assert_allclose(adv_n, (t - mean).numpy(), atol=1e-6)


def _trl_loss(logps, old, ref, adv, mask, loss_type, eps, eps_high, beta, max_len):
    """TRL 1.16 GRPOTrainer._compute_loss, token-level importance sampling, one process, no
    gradient accumulation (written out from trl/trainer/grpo_trainer.py)."""
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
    adv = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # dapo: num_items_in_batch


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_token_loss_with_clipping_matches_trl(loss_type):
    """Off-policy ratios (old logps != logps) so that both clip sides act, and the KL term."""
    rng = np.random.default_rng(0)
    n, t = 6, 7
    logps = -rng.random((n, t)).astype(np.float32) * 3
    old = logps + rng.normal(0, 0.4, (n, t)).astype(np.float32)
    ref = logps + rng.normal(0, 0.3, (n, t)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    mask = (np.arange(t)[None, :] < rng.integers(1, t + 1, n)[:, None]).astype(np.float32)
    per, kl, ratio = G.grpo_token_loss(jnp.asarray(logps), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                       epsilon=0.2, epsilon_high=0.28, beta=0.05, ref_logps=jnp.asarray(ref))
    got = G.reduce_loss(per, jnp.asarray(mask), loss_type, n_completions=float(n), n_tokens=float(mask.sum()),
                        max_completion_length=t)
    want = _trl_loss(*(torch.as_tensor(a) for a in (logps, old, ref, adv, mask)), loss_type, 0.2, 0.28, 0.05, t)
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    clipped = np.asarray(ratio < 0.8) | np.asarray(ratio > 1.28)
    assert (clipped & (mask > 0)).any()  # the clip acts somewhere: not a trivial comparison


# ----------------------------------------------------------- loss and gradients vs torch + PEFT
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    return checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                      config_overrides={"initializer_range": 0.1})


def _rollouts():
    """Fixed rollouts: 2 prompts x 2 completions of different lengths, advantages from rewards."""
    rng = np.random.default_rng(3)
    seqs, scored = [], []
    for p, c in ((3, 6), (3, 2), (4, 5), (4, 1)):
        seqs.append(rng.integers(3, 120, p + c))
        scored.append(np.r_[np.zeros(p, bool), np.ones(c, bool)])
    batch = right_padded_rows(seqs, scored, 4 + L - 1)
    batch["advantages"], _ = G.group_advantages(np.asarray([1.0, 0.0, 0.2, 0.9], np.float32), 2)
    return batch


def test_grpo_loss_and_grads_match_torch_peft(ckpt):
    """On fixed rollouts (one update per rollout batch: old logps = logps, detached), the loss of
    each normalisation and its LoRA gradients equal TRL's formulas on the PEFT model; the KL's
    reference is the model with its adapter disabled."""
    import checkpoint_factory
    import peft

    from test_dpo import _values

    model = models.load_causal_lm(ckpt, lora=lora.LoraConfig(rank=RANK, alpha=ALPHA), compute_dtype=jnp.float32)
    values = _values(model)
    lora.set_lora_params(model, values)
    batch = _rollouts()
    n = batch["input_ids"].shape[0]
    ntok = float(batch["loss_mask"].sum())
    tm = checkpoint_factory.load_with_transformers(ckpt)
    pm = peft.get_peft_model(tm, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(lora.DEFAULT_TARGETS),
                                                 lora_dropout=0.0))
    pm.train()
    layers = {k.removeprefix("base_model.model."): m for k, m in pm.named_modules()
              if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}
    with torch.no_grad():
        for name, mod in layers.items():
            for key in ("lora_A", "lora_B"):
                getattr(mod, key)["default"].weight.copy_(torch.from_numpy(values[name][key]))
    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    tgt = torch.as_tensor(batch["targets"], dtype=torch.long)
    mask = torch.as_tensor(batch["loss_mask"])

    def logps(m):
        return torch.log_softmax(m(ids).logits.float() / TEMP, -1).gather(-1, tgt[..., None])[..., 0]

    beta = 0.04
    with torch.no_grad(), pm.disable_adapter():
        ref = logps(pm)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    jb["n_completions"], jb["n_tokens"] = jnp.float32(n), jnp.float32(ntok)
    got = _jax_grpo(model, jb, beta)
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        lp = logps(pm)
        loss_t = _trl_loss(lp, lp.detach(), ref, torch.as_tensor(batch["advantages"]), mask, loss_type,
                           0.2, 0.2, beta, L)
        pm.zero_grad(set_to_none=True)
        loss_t.backward()
        g_t = {k: {x: getattr(m, x)["default"].weight.grad.numpy().copy() for x in ("lora_A", "lora_B")}
               for k, m in layers.items()}
        (loss_j, sums), g = got[loss_type]
        assert float(loss_j) == pytest.approx(loss_t.item(), rel=1e-4, abs=1e-6), loss_type
        g_j = lora.lora_state_by_module(model, g)
        worst = max(float(np.abs(np.asarray(g_j[k][x]) - g_t[k][x]).max() / np.abs(g_t[k][x]).max())
                    for k in g_t for x in ("lora_A", "lora_B"))
        assert worst <= 1e-4, (loss_type, worst)
        if beta:
            kl_t = ((torch.exp(ref - lp) - (ref - lp) - 1) * mask).sum().item()
            assert float(sums["kl"]) == pytest.approx(kl_t, rel=1e-4)
            assert kl_t > 1e-4


@nnx.jit(static_argnames=("beta",))
def _jax_grpo(model, mb, beta):
    """{loss type: ((loss, sums), LoRA gradients)}, one program."""
    graphdef, lora_state, rest = nnx.split(model, nnx.LoRAParam, ...)
    out = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        def f(l_, loss_type=loss_type):
            m = nnx.merge(graphdef, l_, rest, copy=True)
            return G._micro(m, lambda: R.reference_view(graphdef, l_, rest), mb, temperature=TEMP, beta=beta,
                            epsilon=0.2, epsilon_high=None, loss_type=loss_type, max_completion_length=L)

        out[loss_type] = jax.value_and_grad(f, has_aux=True)(lora_state)
    return out


# ------------------------------------------------------------------- rollouts, resume, rewards
REWARD_FILE = '''
def has_a(prompts, completions, target, **kw):
    return [float(c.count(t)) + sum(map(ord, c)) % 7 / 7 for c, t in zip(completions, target)]
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_train import _make_tokenizer

    root = tmp_path_factory.mktemp("grpo")
    tok = T.load_tokenizer(_make_tokenizer(root / "tok"))
    (root / "rew.py").write_text(REWARD_FILE)
    prompts = [{"prompt": w, "target": t} for w, t in (("ab", "a"), ("hello", "l"), ("xyz", "z"))]
    return root, tok, prompts


def _config(root, out, **kw):
    base = dict(objective="grpo", reward=[f"{root / 'rew.py'}:has_a"], seq_len=12, batch_size=2, num_generations=2,
                max_completion_length=5, steps=4, lr=2e-2, out_dir=str(root / out), progress=False,
                tensorboard=False, save_every=2, log_every=1, grpo_beta=0.05, seed=7)
    return T.TrainConfig(**{**base, **kw})


def test_rollouts_reproducible_with_a_seed(setup):
    from test_train import nf4_llama

    root, tok, prompts = setup
    cfg = _config(root, "roll")
    task = G.GRPOTask(nf4_llama(), cfg, prompts, tok, None)
    task.model = nf4_llama()
    key = jax.random.key_data(jax.random.key(5))
    a = task.sample([0, 1], key)[1]
    b = task.sample([0, 1], key)[1]
    c = task.sample([0, 1], jax.random.key_data(jax.random.key(6)))[1]
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    assert len(a) == 4 and all(1 <= len(x) <= 5 for x in a)


def test_resume_is_bit_exact(setup):
    """4 steps in one run equal 2 steps + resume for 2 (LoRA params, losses, rewards): the data
    position and the rollout RNG key come back from the checkpoint."""
    from test_train import lora_arrays, nf4_llama

    root, tok, prompts = setup
    model_full = nf4_llama()
    full = T.train(model_full, _config(root, "full"), data=prompts, tokenizer=tok)
    m = nf4_llama()
    first = T.train(m, _config(root, "part"), data=prompts, tokenizer=tok, on_step=lambda step, _: step < 2)
    assert first.stopped_early and first.step == 2
    m2 = nf4_llama()
    rest = T.train(m2, _config(root, "part", resume=True), data=prompts, tokenizer=tok)
    assert rest.resumed_from == 2 and rest.steps == [3, 4]
    keys = ("loss", "reward", "kl", "completions/mean_length", "grad_norm")
    got = [[x[k] for k in keys] for x in first.metrics + rest.metrics]
    assert got == [[x[k] for k in keys] for x in full.metrics]
    assert len({x["reward"] for x in full.metrics}) > 1 and all(x["grad_norm"] > 0 for x in full.metrics)
    for a, b in zip(lora_arrays(model_full), lora_arrays(m2)):
        np.testing.assert_array_equal(a, b)


def test_reward_functions_that_fail_are_named():
    def ok(prompts, completions, **kw):
        return [1.0] * len(completions)

    def raises(prompts, completions, **kw):
        raise KeyError("answer")

    def nan(prompts, completions, **kw):
        return [0.0, float("nan")]

    def none(prompts, completions, **kw):
        return [None, 1.0]

    def short(prompts, completions, **kw):
        return [1.0]

    funcs = RW.load_rewards([ok])
    assert RW.score(funcs, ["p", "q"], ["a", "b"], {}).tolist() == [[1.0], [1.0]]
    for fn, says in ((raises, "raised KeyError"), (nan, "returned nan for completion 2"),
                     (none, "returned None for completion 1"), (short, "returned 1 values for 2")):
        with pytest.raises(RW.RewardError, match=says) as e:
            RW.score(RW.load_rewards([fn]), ["p", "q"], ["a", "b"], {})
        assert fn.__name__ in str(e.value)
    with pytest.raises(RW.RewardError, match="cannot import module"):
        RW.load_reward("jqlora_no_such_module:f")
    with pytest.raises(RW.RewardError, match="no function 'nope'"):
        RW.load_reward("jqlora.train.rewards:nope")
