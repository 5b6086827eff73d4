"""The router's load-balancing (auxiliary) loss of Qwen3-MoE and Mixtral against transformers 5, on
CPU in float32: the value on the model's own router logits (transformers' `load_balancing_loss_func`),
padding left out as transformers' attention_mask leaves it out, the train step's loss against
transformers' `outputs.loss` with `output_router_logits=True` (cross-entropy + coef * aux), the
gradients of that loss on a router LoRA against torch autograd, and when it is on.

Tiny random checkpoints: tests/support/moe_checkpoints.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moe_checkpoints as mc  # noqa: E402
from jqlora import lora, models  # noqa: E402
from jqlora.errors import SettingError  # noqa: E402
from jqlora.train import TrainConfig, train  # noqa: E402
from jqlora.train.router_aux import router_aux_coef  # noqa: E402
from jqlora.train.step import _forward_sums, router_aux_loss  # noqa: E402

pytestmark = pytest.mark.torch

KINDS = ("qwen3_moe", "mixtral")
COEF = 0.1  # large enough that a wrong aux loss shows in the total loss and the router's gradients
B, T = 2, 12
REAL = (12, 8)  # real tokens per row; the rest is right padding


def _batch(seed: int = 0) -> dict:
    """One right-padded batch as jqlora's data pipeline gives it (targets = next tokens, loss on
    every real next token, segment 1 for real tokens, 0 for padding) and transformers' view of it."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, (B, T)).astype(np.int32)
    seg = np.zeros((B, T), np.int32)
    for r, n in enumerate(REAL):
        seg[r, :n] = 1
        ids[r, n:] = 0
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, :-1] = seg[:, 1:]
    positions = np.where(seg > 0, np.arange(T)[None], 0).astype(np.int32)
    return dict(input_ids=ids, targets=targets, loss_mask=loss_mask, segment_ids=seg, positions=positions)


def _transformers(tm, batch):
    ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    mask = torch.tensor(batch["segment_ids"], dtype=torch.long)
    labels = ids.masked_fill(mask == 0, -100)
    return tm(ids, attention_mask=mask, labels=labels, output_router_logits=True)


def _pair(kind, targets=None, coef=COEF):
    tm = mc.tiny_moe(kind, router_aux_loss_coef=coef)
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in tm.state_dict().items()}
    lc = None if targets is None else lora.LoraConfig(rank=4, alpha=8, target_modules=targets)
    m = models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32, lora=lc, rngs=nnx.Rngs(0))
    return tm, m


class _Batches:
    """The same batch every step: a data iterator `train` takes as it is."""

    batch_size = B

    def __init__(self, batch):
        self.batch = batch

    def __next__(self):
        return {k: v.copy() for k, v in self.batch.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("kind", KINDS)
def test_aux_loss_on_the_model_router_logits_equals_transformers(kind):
    import importlib

    load_balancing_loss_func = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}"
                                                       ).load_balancing_loss_func
    tm, m = _pair(kind)
    batch = _batch()
    with torch.no_grad():
        out = _transformers(tm, batch)
    mask = torch.tensor(batch["segment_ids"])
    cfg = m.config
    # transformers' function on transformers' router logits = jqlora's on the same logits ...
    theirs = [jnp.asarray(x.numpy()) for x in out.router_logits]
    assert len(theirs) == sum(cfg.sparse_layers)  # Qwen3-MoE's dense layer 1 has no router
    ref = float(load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, mask))
    assert abs(float(router_aux_loss(m, theirs, batch)) - ref) < 1e-5
    assert abs(float(out.aux_loss) - ref) < 1e-6
    # ... and on jqlora's own router logits, from the real tokens only (padding rows differ)
    _, mine = m(jnp.asarray(batch["input_ids"]), positions=batch["positions"], segment_ids=batch["segment_ids"],
                return_hidden=True, return_router_logits=True)
    real = batch["segment_ids"].reshape(-1) > 0
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=1e-5, atol=1e-5)
    assert abs(float(router_aux_loss(m, mine, batch)) - ref) < 1e-5
    # the padding is left out: counted, the loss is another number
    unmasked = float(load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok))
    assert abs(unmasked - ref) > 1e-4


@pytest.mark.parametrize("kind, packing, accum", [("qwen3_moe", True, 1), ("mixtral", False, 2)])
def test_train_step_loss_and_gradient_equal_transformers_with_router_logits(kind, packing, accum, tmp_path):
    """Step 1 of `train` with the aux loss on and LoRA on the router: its loss (before the update)
    is transformers' outputs.loss (mean CE + coef * aux_loss) and its gradient norm torch's on the
    router LoRA; unpacked rows (packing off) carry their padding as attention_mask; two equal
    micro-batches give the loss of one."""
    tm, m = _pair(kind, targets=["gate"])
    a = {n: np.asarray(p["lora_A"]) for n, p in lora.lora_params_by_module(m).items()}
    batch = _batch()
    out = _transformers(tm, batch)
    out.loss.backward()
    routers = {n: mod for n, mod in tm.named_modules() if n in a}
    norm = np.sqrt(sum(np.sum((2.0 * routers[n].weight.grad.numpy() @ a[n].T) ** 2) for n in a))  # scale 8 / 4
    cfg = TrainConfig(steps=1, batch_size=B, seq_len=T, grad_accum=accum, router_aux_loss_coef=COEF, packing=packing,
                      grad_clip=None, out_dir=str(tmp_path / "run"), save_every=0, progress=False, tensorboard=False,
                      keep_checkpoints=None)
    res = train(m, cfg, data=_Batches(batch), on_ready=lambda c: None)
    assert abs(res.losses[0] - out.loss.item()) < 1e-5, (res.losses[0], out.loss.item())
    assert abs(res.grad_norms[0] - norm) < 1e-4 * norm, (res.grad_norms[0], norm)
    header, row = (tmp_path / "run" / "loss.csv").read_text().splitlines()[:2]
    assert header.split(",")[-1] == "aux_loss"
    assert abs(float(row.split(",")[-1]) - out.aux_loss.item()) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_router_lora_gradients_include_the_aux_loss(kind):
    """LoRA on the router (named `gate`): the gradients of CE + coef * aux equal torch autograd's
    on transformers' loss, with the router weight W + scale * B A in torch."""
    tm, m = _pair(kind, targets=["gate"])
    rng = np.random.default_rng(1)
    pairs = lora.lora_params_by_module(m)
    assert pairs and all(name.endswith("mlp.gate") for name in pairs)
    values = {n: {"lora_A": p["lora_A"], "lora_B": jnp.asarray(rng.normal(0, 0.2, p["lora_B"].shape), jnp.float32)}
              for n, p in pairs.items()}
    lora.set_lora_params(m, values)
    scale = 8 / 4
    routers = {n: mod for n, mod in tm.named_modules() if n.endswith("mlp.gate")}  # Mixtral's too, in v5
    with torch.no_grad():
        for name, v in values.items():
            w = routers[name].weight
            w += scale * torch.tensor(np.asarray(v["lora_B"]) @ np.asarray(v["lora_A"]))
    batch = _batch()
    out = _transformers(tm, batch)
    out.loss.backward()

    graphdef, lstate, rest = nnx.split(m, nnx.LoRAParam, ...)

    def loss(ls):
        s, n, aux = _forward_sums(nnx.merge(graphdef, ls, rest), {k: jnp.asarray(v) for k, v in batch.items()},
                                  router_aux=True)
        return s / n + COEF * aux

    value, grads = jax.value_and_grad(loss)(lstate)
    assert abs(float(value) - out.loss.item()) < 1e-5
    graph = nnx.merge(graphdef, grads, rest)
    got = lora.lora_params_by_module(graph)
    for name, v in values.items():
        gw = routers[name].weight.grad.numpy()  # dL/dW (E, H)
        a, b = np.asarray(v["lora_A"]), np.asarray(v["lora_B"])
        np.testing.assert_allclose(np.asarray(got[name]["lora_B"]), scale * gw @ a.T, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[name]["lora_A"]), scale * b.T @ gw, rtol=1e-4, atol=1e-6)
        assert np.abs(gw).max() > 0


def test_when_the_aux_loss_is_on():
    _, m = _pair("mixtral")
    cfg = m.config
    # None follows config.json: transformers adds it when output_router_logits is true
    assert router_aux_coef(m, TrainConfig()) is None
    m.config = dataclasses.replace(cfg, output_router_logits=True)
    assert router_aux_coef(m, TrainConfig()) == pytest.approx(COEF)
    assert router_aux_coef(m, TrainConfig(router_aux_loss_coef=0)) is None  # 0 turns it off
    assert router_aux_coef(m, TrainConfig(router_aux_loss_coef=0.02)) == pytest.approx(0.02)
    dense = models.from_params(models.init_params(dict(model_type="llama", hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       vocab_size=64)), dict(model_type="llama", hidden_size=32,
                                                                             intermediate_size=64, num_hidden_layers=1,
                                                                             num_attention_heads=2, vocab_size=64))
    assert router_aux_coef(dense, TrainConfig()) is None
    with pytest.raises(SettingError, match="router_aux_loss_coef=0.1: .* no router"):
        router_aux_coef(dense, TrainConfig(router_aux_loss_coef=0.1))
    for bad in (-1.0, float("nan"), "x", True):
        with pytest.raises(ValueError, match="router_aux_loss_coef"):
            TrainConfig(router_aux_loss_coef=bad).validate()
    # added to the preference and RL losses too (tests/train/test_objective_moe.py)
    TrainConfig(router_aux_loss_coef=0.1, objective="dpo").validate()
