"""DPO (jqlora.train.preference): the losses, rewards and LoRA gradients against the same formulas
computed in torch on transformers + PEFT + bitsandbytes NF4 at the same weights (fp32), the
reference being the base model (LoRA off), pair data, and training through `train()`.

TRL's DPO loss is not callable on its own (it lives inside `DPOTrainer._compute_loss`, which
needs a trainer and a model), so the torch side writes TRL 1.16's formulas out: sigmoid
`-logsigmoid(beta d)`, hinge `relu(1 - beta d)`, ipo `(d_c/n_c - d_r/n_r - 1/(2 beta))^2`,
rewards `beta (logp - ref)` with the reference from `model.disable_adapter()`."""
from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jqlora import lora, models  # noqa: E402
from jqlora import train as T  # noqa: E402
from jqlora.lora import reference as R  # noqa: E402
from jqlora.train import preference as P  # noqa: E402
from jqlora.train.logps import right_padded_rows, token_logps  # noqa: E402

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

RANK, ALPHA, BETA = 4, 8, 0.3
LOSSES = ("sigmoid", "hinge", "ipo")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    return checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                      config_overrides={"initializer_range": 0.1})


def _pairs():
    """Two pairs of random ids with prompts and completions of different lengths: rows
    [chosen 0, chosen 1, rejected 0, rejected 1], their scored (completion) tokens."""
    rng = np.random.default_rng(0)
    seqs, scored = [], []
    for p, c in ((3, 5), (5, 2), (3, 4), (5, 6)):
        seqs.append(rng.integers(3, 120, p + c))
        scored.append(np.r_[np.zeros(p, bool), np.ones(c, bool)])
    return right_padded_rows(seqs, scored, 12)


def _values(model):
    rng = np.random.default_rng(1)
    out = {}
    for name, v in sorted(lora.lora_params_by_module(model).items()):
        (r, fin), (fout, _) = v["lora_A"].shape, v["lora_B"].shape
        out[name] = {"lora_A": (rng.standard_normal((r, fin)) / np.sqrt(fin)).astype(np.float32),
                     "lora_B": (0.3 * rng.standard_normal((fout, r))).astype(np.float32)}
    return out


def _torch_side(ckpt, values, batch, loss_type):
    import checkpoint_factory

    tm = checkpoint_factory.load_with_transformers(ckpt)
    pm = peft.get_peft_model(tm, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(lora.DEFAULT_TARGETS),
                                                 lora_dropout=0.0))
    pm.train()  # bitsandbytes' dequantize + linear path (fp32), as tests/lora/test_lora_gradients_vs_peft.py
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
              if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}
    with torch.no_grad():
        for name, mod in layers.items():
            for key in ("lora_A", "lora_B"):
                getattr(mod, key)["default"].weight.copy_(torch.from_numpy(values[name][key]))
    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    tgt = torch.as_tensor(batch["targets"], dtype=torch.long)
    mask = torch.as_tensor(batch["loss_mask"])

    def logps(model):
        lp = torch.log_softmax(model(ids).logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
        return (lp * mask).sum(-1)

    with torch.no_grad(), pm.disable_adapter():
        ref = logps(pm)
    pol = logps(pm)
    b = ids.shape[0] // 2
    c_lr, r_lr = pol[:b] - ref[:b], pol[b:] - ref[b:]
    d = c_lr - r_lr
    if loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(BETA * d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - BETA * d)
    else:
        n = mask.sum(-1)
        losses = (c_lr / n[:b] - r_lr / n[b:] - 1 / (2 * BETA)) ** 2
    loss = losses.mean()
    pm.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: {k: getattr(m, k)["default"].weight.grad.numpy().copy() for k in ("lora_A", "lora_B")}
             for name, m in layers.items()}
    return float(loss.detach()), (BETA * c_lr).detach().numpy(), (BETA * r_lr).detach().numpy(), grads


@nnx.jit
def _jax_side(model, batch):
    """{loss type: ((loss, (chosen rewards, rejected rewards)), LoRA gradients)}, one program."""
    graphdef, lora_state, rest = nnx.split(model, nnx.LoRAParam, ...)
    out = {}
    for loss_type in LOSSES:
        def loss_fn(l_, loss_type=loss_type):
            m = nnx.merge(graphdef, l_, rest, copy=True)
            losses, cr, rr, _, _ = P._pair_values(m, lambda: R.reference_view(graphdef, l_, rest), batch,
                                                  beta=BETA, loss_type=loss_type, label_smoothing=0.0)
            return losses.mean(), (cr, rr)

        out[loss_type] = jax.value_and_grad(loss_fn, has_aux=True)(lora_state)
    return out


def test_dpo_loss_rewards_and_grads_match_torch_peft(ckpt):
    """For each loss type: the loss, rewards and every LoRA gradient agree with torch to fp32
    round-off (rel 1e-4); a 1% change of one lora_B is seen."""
    model = models.load_causal_lm(ckpt, lora=lora.LoraConfig(rank=RANK, alpha=ALPHA), compute_dtype=jnp.float32)
    values = _values(model)
    lora.set_lora_params(model, values)
    batch = _pairs()
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    got = _jax_side(model, jb)
    target = "model.layers.1.self_attn.v_proj"
    bad = {n: dict(v) for n, v in values.items()}
    bad[target]["lora_B"] = values[target]["lora_B"] * np.float32(1.01)
    lora.set_lora_params(model, bad)
    got_bad = _jax_side(model, jb)
    for loss_type in LOSSES:
        loss_t, cr_t, rr_t, g_t = _torch_side(ckpt, values, batch, loss_type)
        (loss_j, (cr_j, rr_j)), g = got[loss_type]
        assert abs(float(loss_j) - loss_t) <= 1e-5 * max(1.0, abs(loss_t)), (loss_type, float(loss_j), loss_t)
        np.testing.assert_allclose(np.asarray(cr_j), cr_t, atol=2e-5)
        np.testing.assert_allclose(np.asarray(rr_j), rr_t, atol=2e-5)
        assert np.abs(cr_t - rr_t).max() > 1e-2  # the LoRA moves the rewards: not a trivial comparison

        def worst(gj):
            gj = lora.lora_state_by_module(model, gj)
            return max(float(np.abs(np.asarray(gj[n][k]) - g_t[n][k]).max() / np.abs(g_t[n][k]).max())
                       for n in g_t for k in ("lora_A", "lora_B"))

        assert worst(g) <= 1e-4, loss_type
        assert worst(got_bad[loss_type][1]) > 1e-4, loss_type


def test_reference_is_the_base_model(ckpt):
    """The reference view computes the base model: the same log-probs as the model with every
    lora_B zero, and not those of the model with its LoRA on."""
    model = models.load_causal_lm(ckpt, lora=lora.LoraConfig(rank=RANK, alpha=ALPHA), compute_dtype=jnp.float32)
    values = _values(model)
    lora.set_lora_params(model, values)
    batch = {k: jnp.asarray(v) for k, v in _pairs().items()}
    ref = np.asarray(P.make_eval_fn(P._ref_logps)(model, batch))
    policy = np.asarray(token_logps(model, batch).sum(-1))
    lora.set_lora_params(model, {n: {"lora_A": v["lora_A"], "lora_B": 0 * v["lora_B"]} for n, v in values.items()})
    base = np.asarray(token_logps(model, batch).sum(-1))
    np.testing.assert_allclose(ref, base, atol=1e-5)
    assert np.abs(policy - base).max() > 1e-2
    zeros = R.lora_off(nnx.state(model, nnx.LoRAParam))
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(zeros))


def test_dpo_losses_formulas_and_label_smoothing():
    c, r = jnp.asarray([-3.0, -5.0]), jnp.asarray([-4.0, -2.0])
    rc, rr = jnp.asarray([-3.5, -4.0]), jnp.asarray([-4.5, -3.0])
    d = (c - rc) - (r - rr)
    losses, cr, rr_ = P.dpo_losses(c, r, rc, rr, beta=0.5, loss_type="sigmoid", label_smoothing=0.2)
    want = -0.8 * jax.nn.log_sigmoid(0.5 * d) - 0.2 * jax.nn.log_sigmoid(-0.5 * d)
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    np.testing.assert_allclose(cr, 0.5 * (c - rc))
    np.testing.assert_allclose(rr_, 0.5 * (r - rr))
    zero, _, _ = P.dpo_losses(c, r, c, r, beta=0.1)
    np.testing.assert_array_equal(zero, np.float32(math.log(2)))


# ---------------------------------------------------------------------------------- data
def test_pair_rows_score_completion_tokens_only(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_chat import build_tokenizer_folder

    tok = T.load_tokenizer(build_tokenizer_folder(tmp_path / "tok"))
    special = T.special_tokens(tok, tokenizer_path=tmp_path / "tok")
    conv = {"prompt": [{"role": "user", "content": "What is the capital of France?"}],
            "chosen": [{"role": "assistant", "content": "Paris."}], "rejected": "Rome."}
    ci, cs, ri, rs = P.tokenize_pair(tok, special, conv, "x, line 1", 128)
    assert tok.decode([int(t) for t in ci[cs]]).startswith("Paris.")
    assert tok.decode([int(t) for t in ri[rs]]).startswith("Rome.")
    prompt = tok.apply_chat_template(conv["prompt"], add_generation_prompt=True)
    assert list(ci[:len(prompt)]) == prompt and not cs[:len(prompt)].any()
    plain = {"prompt": "the capital of France is", "chosen": " Paris", "rejected": " Rome"}
    ci, cs, ri, rs = P.tokenize_pair(tok, special, plain, "x, line 2", 128)
    assert tok.decode([int(t) for t in ci[cs]]).strip() .startswith("Paris")
    for bad, says in (({"prompt": "a", "chosen": "b"}, "'rejected'"), ({"prompt": "a", "chosen": "b", "rejected": " "},
                                                                         "'rejected' is empty"),
                      ({"prompt": "a" * 200, "chosen": "b", "rejected": "c"}, "no 'chosen' token left")):
        with pytest.raises(T.DataError, match=says) as e:
            P.load_pairs([bad], tok, special, 16)
        assert "<data argument>, row 1" in str(e.value)


# ------------------------------------------------------------------------------ training
def test_dpo_training_starts_at_ln2_and_separates_the_pairs(tmp_path):
    """Through `train()` with the reference precomputed for the whole set (the per-batch reference
    runs in the CLI test): step 1's loss is ln 2 and its rewards 0 (the table is the policy's own
    log-probs at step 1, pair by pair), and the held-out reward accuracy reaches 1."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import _make_tokenizer, nf4_llama

    tok = T.load_tokenizer(_make_tokenizer(tmp_path / "tok"))
    pairs = [{"prompt": w, "chosen": " yes", "rejected": " no"} for w in ("ab", "cd", "hello", "xyz")]
    cfg = T.TrainConfig(objective="dpo", seq_len=12, batch_size=2, steps=4, lr=2e-2, out_dir=str(tmp_path / "r"),
                        progress=False, tensorboard=False, save_every=0, eval_every=4, precompute_ref=True, log_every=1,
                        dpo_beta=0.5)
    res = T.train(nf4_llama(), cfg, data=pairs, tokenizer=tok, eval_data=pairs)
    first = res.metrics[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # the policy's pass (inside the gradient program) and the reference's round alike up to the
    # last bit, so step 1's rewards are 0 to ~1e-6 (and its reward accuracy is that noise's)
    assert abs(first["rewards/margins"]) < 1e-5 and abs(first["rewards/chosen"]) < 1e-5
    ev = res.eval_metrics[-1][1]
    assert ev["rewards/accuracies"] == 1.0 and ev["loss"] < math.log(2)
    assert [r["step"] for r in _csv_rows(tmp_path / "r" / "loss.csv")] == ["1", "2", "3", "4"]


def _csv_rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
