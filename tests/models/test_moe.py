"""Qwen3-MoE and Mixtral against transformers 5 (eager and grouped_mm experts) and PEFT 0.21, on CPU
in float32: routing, logits and every layer's output, LoRA on attention and experts (gradients
against PEFT's `target_parameters` LoRA), greedy generation with the KV cache, the load-balancing
loss, and planted bugs (wrong expert order, renormalisation dropped) that the comparison catches.

Tiny random checkpoints: tests/support/moe_checkpoints.py (the Qwen3-MoE one has a dense MLP layer,
`mlp_only_layers=[1]`). Every expert layout on disk is tested in tests/interop/test_moe_layouts.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moe_checkpoints as mc  # noqa: E402
from real_models import smollm2  # noqa: E402,F401  (the fixture)
from jqlora import adapters, lora, models  # noqa: E402
from jqlora.errors import SettingError  # noqa: E402
from jqlora.lora.experts import QLoRAExperts, Router  # noqa: E402
from jqlora.models import moe  # noqa: E402
from jqlora.models.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.torch

KINDS = ("qwen3_moe", "mixtral")


def _ids(b=2, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, t))


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=KINDS)
def tiny(request):
    tm = mc.tiny_moe(request.param)
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    return request.param, tm, params, tm.config.to_dict()


def test_config_reads_the_moe_fields():
    q = ModelConfig.from_hf({**mc.QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert q.sparse_layers == (False, True, False, False)  # (i + 1) % 2 == 0 and not in mlp_only_layers
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (4, 2, 64)
    assert q.norm_topk_prob and not q.router_weights_f32 and q.qk_norm and q.router_aux_loss_coef == 0.001
    m = ModelConfig.from_hf(mc.MIXTRAL)
    assert m.sparse_layers == (True, True) and m.moe_intermediate_size == 64 and m.num_experts == 4
    assert m.norm_topk_prob and m.router_weights_f32 and not m.qk_norm
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**mc.MIXTRAL, "num_experts_per_tok": 5})


@pytest.mark.parametrize("kind, norm, dtype", [("qwen3_moe", True, torch.float32), ("qwen3_moe", False, torch.bfloat16),
                                               ("mixtral", True, torch.bfloat16)])
def test_routing_matches_the_transformers_router(kind, norm, dtype):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = AutoConfig.for_model(**{**mc.CONFIGS[kind], "norm_topk_prob": norm, "num_experts": 8,
                                  "num_local_experts": 8, "num_experts_per_tok": 3})
    router = (Qwen3MoeTopKRouter if kind == "qwen3_moe" else MixtralTopKRouter)(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.to(dtype)
        h = torch.randn(64, cfg.hidden_size, generator=g).to(dtype)
        logits, weights, idx = router(h)
    c = ModelConfig.from_hf(cfg.to_dict())
    w, i = moe.route(jnp.asarray(logits.float().numpy()).astype(jnp.dtype(str(dtype).split(".")[1])),
                     c.num_experts_per_tok, normalize=c.norm_topk_prob, weights_f32=c.router_weights_f32)
    # the same experts, up to exact ties of the probabilities (bf16 logits tie often; torch.topk
    # promises no order among ties, lax.top_k takes the lower index)
    probs = torch.softmax(logits.float(), -1).numpy()
    mine, theirs = np.take_along_axis(probs, np.asarray(i), 1), np.take_along_axis(probs, idx.numpy(), 1)
    np.testing.assert_array_equal(mine, theirs)
    assert (np.asarray(i) == idx.numpy()).mean() > 0.95
    assert w.dtype == (jnp.float32 if kind == "mixtral" else jnp.dtype(str(dtype).split(".")[1]))
    # float32 softmax and sum orders differ by an ulp at most (then one rounding to bf16 for Qwen3-MoE)
    ulps = 2 ** -23 if w.dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(w, np.float32), weights.float().numpy(), rtol=2 * ulps, atol=0)


def test_logits_and_every_layer_match_transformers_eager_and_grouped_mm(tiny):
    kind, tm, params, cfg = tiny
    ids = _ids()
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    logits, states = m(jnp.asarray(ids), return_states=True)
    grouped = mc.tiny_moe(kind, experts="grouped_mm")
    for ref_model in (tm, grouped):
        with torch.no_grad():
            out = ref_model(torch.tensor(ids), output_hidden_states=True)
        assert _rel(logits, out.logits.numpy()) < 2e-5, (kind, ref_model.config._experts_implementation)
        for i, h in enumerate(states["layers"][:-1]):
            assert _rel(h, out.hidden_states[i + 1].numpy()) < 2e-5, (kind, i)
    # Qwen3-MoE's layer 1 is dense (mlp_only_layers): two stacks' structures, one model
    kinds = [type(layer.mlp).__name__ for layer in m.model.layers]
    assert kinds == (["MoEBlock", "MLP", "MoEBlock"] if kind == "qwen3_moe" else ["MoEBlock"] * 2)


@pytest.mark.parametrize("bug", ["expert_order", "no_renormalisation"])
def test_planted_bugs_fail_the_comparison(tiny, monkeypatch, bug):
    kind, tm, params, cfg = tiny
    if kind != "mixtral":
        pytest.skip("the routing code is shared (both renormalise here); the smaller Mixtral plants both bugs")
    ids = _ids()
    with torch.no_grad():
        ref = tm(torch.tensor(ids)).logits.numpy()
    route = moe.route
    if bug == "expert_order":  # expert e's rows go to expert E - 1 - e
        def planted(logits, top_k, **kw):
            w, i = route(logits, top_k, **kw)
            return w, logits.shape[-1] - 1 - i
    else:
        def planted(logits, top_k, **kw):
            return route(logits, top_k, **{**kw, "normalize": False})
    monkeypatch.setattr(moe, "route", planted)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32)
    assert _rel(m(jnp.asarray(ids)), ref) > 1e-2


def _peft_pair(kind, seed=1):
    """The same random LoRA (attention + experts, every B non-zero) in jqlora and in PEFT (the
    adapter jqlora exports, loaded by `PeftModel.from_pretrained`)."""
    import tempfile

    from peft import PeftModel

    tm = mc.tiny_moe(kind, **({"mlp_only_layers": []} if kind == "qwen3_moe" else {}))
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    cfg = lora.LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    m = models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32, lora=cfg)
    rng = np.random.default_rng(seed)
    lp = {k: {"lora_A": v["lora_A"], "lora_B": jnp.asarray(rng.normal(0, 0.1, v["lora_B"].shape), jnp.float32)}
          for k, v in lora.lora_params_by_module(m).items()}
    lora.set_lora_params(m, lp)
    with tempfile.TemporaryDirectory() as d:
        adapters.save_adapter(d, m, cfg)
        pm = PeftModel.from_pretrained(tm, d, is_trainable=True)
    return m, pm, lp


@pytest.mark.parametrize("kind", [pytest.param("qwen3_moe", marks=pytest.mark.slow), "mixtral"])
def test_lora_logits_and_gradients_match_peft(kind):
    from interop.experts import to_peft_factors

    m, pm, lp = _peft_pair(kind)
    assert all(n.rsplit(".", 1)[-1] != "gate" for n in lp)  # all-linear leaves the router alone
    assert {n.rsplit(".", 1)[-1] for n in lp} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    ids = _ids()
    cot = np.random.default_rng(2).normal(size=(2, 12, 256)).astype(np.float32)
    pm.train()
    logits = pm(torch.tensor(ids)).logits
    (logits * torch.tensor(cot)).sum().backward()
    ref_grads = {n: p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}

    graphdef, lstate, rest = nnx.split(m, nnx.LoRAParam, ...)

    def loss(s):
        return jnp.sum(nnx.merge(graphdef, s, rest)(jnp.asarray(ids)) * cot)

    val, grads = jax.jit(jax.value_and_grad(loss))(lstate)
    assert abs(float(val) - float((logits * torch.tensor(cot)).sum().detach())) < 1e-3 * max(1.0, abs(float(val)))
    g = lora.lora_state_by_module(m, grads)
    checked = 0
    for name, pair in g.items():
        if pair["lora_A"].ndim == 3:
            a, b = to_peft_factors(pair["lora_A"], pair["lora_B"])
            where = "base_layer." if name.endswith("gate_up_proj") else ""
            key = f"base_model.model.{name.rsplit('.', 1)[0]}.{where}lora_%s.default.weight"
        else:
            a, b = np.asarray(pair["lora_A"]), np.asarray(pair["lora_B"])
            key = f"base_model.model.{name}.lora_%s.default.weight"
        for got, ab in ((a, "A"), (b, "B")):
            assert _rel(got, ref_grads[key % ab]) < 1e-4, (name, ab)
            checked += 1
    assert checked == len(ref_grads)


@pytest.mark.parametrize("decode_layers", ["scanned", "hoisted"])
def test_greedy_generation_with_the_cache_matches_transformers(decode_layers):
    """hoisted: attention's q|k|v and the dense layer's gate|up fused, the experts apart."""
    from jqlora.models.generate import generate

    tm = mc.tiny_moe("qwen3_moe")
    params = {k: jnp.asarray(v.numpy()) for k, v in tm.state_dict().items()}
    m = models.from_params(params, tm.config.to_dict(), compute_dtype=jnp.float32)
    prompt = _ids(b=1, t=6, seed=3)
    out = np.asarray(generate(m, prompt, 8, decode_layers=decode_layers))
    with torch.no_grad():
        ref = tm.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, min_new_tokens=8).numpy()
    np.testing.assert_array_equal(out, ref)


def test_lora_targets_on_a_moe_model(tiny):
    kind, _, params, cfg = tiny
    if kind != "qwen3_moe":
        pytest.skip("target matching does not depend on the family")

    def targeted(targets, **kw):
        m = models.from_params(params, cfg, compute_dtype=jnp.float32,
                               lora=lora.LoraConfig(rank=2, target_modules=targets, **kw))
        return {n.split(".", 3)[-1] for n in lora.lora_params_by_module(m)}

    every = targeted("all-linear")  # attention and experts: not the router, not layer 1's dense MLP
    assert every == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert targeted(["gate"]) == {"mlp.gate"}  # the router: only when named
    default = targeted(lora.DEFAULT_TARGETS)  # gate_proj / up_proj take the fused experts.gate_up_proj
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj"} <= default
    with pytest.raises(SettingError, match="dropout"):
        targeted(["down_proj"], dropout=0.1)
    m = models.from_params(params, cfg, compute_dtype=jnp.float32,
                           lora=lora.LoraConfig(rank=2, target_modules=["gate"]))
    assert isinstance(m.model.layers[0].mlp.gate, Router) and isinstance(m.model.layers[0].mlp.experts.down_proj,
                                                                         QLoRAExperts)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(24, 8)).astype(np.float32) for _ in range(3)]
    mask = (rng.random((2, 12)) > 0.3).astype(np.int64)
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), 8, 2,
                                       None if m is None else torch.tensor(m))
        got = moe.load_balancing_loss([jnp.asarray(x) for x in logits], 8, 2, None if m is None else jnp.asarray(m))
        assert abs(float(got) - float(ref)) < 1e-5 * float(ref)


def test_cli_train_generate_export_crosscheck_merge(tmp_path_factory, capsys):
    """A transformers + bitsandbytes NF4 Mixtral (experts left dense there, NF4 here) through the
    CLI: 2 training steps on attention and experts, generation with the adapter, the cross-check
    against transformers + PEFT, and the merged float32 folder, which transformers loads per expert
    and which gives PEFT's logits."""
    import shutil

    from cli_runner import run_cli
    from jqlora.demo import task
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-cli")
    base = root / "nf4"
    shutil.copytree(mc.cached(tmp_path_factory, "mixtral", "nf4"), base)
    task.save_tokenizer(base)
    data = task.write_jsonl(root / "train.jsonl", task.make_split(16, 0, seed=3).train)
    rc, out, err = run_cli(capsys, "train", "--model", base, "--data-path", data, "--steps", "2", "--seq-len", "32",
                           "--batch-size", "4", "--compute-dtype", "float32", "--target-modules", "all-linear",
                           "--rank", "4", "--lr", "0.05", "--out-dir", root / "run", "--adapter-out", root / "adapter",
                           "--keep-checkpoints", "none")
    assert rc == 0, err
    cfg = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    rc, out, err = run_cli(capsys, "generate", base, "--prompt", "ab", "--max-new-tokens", "2",
                           "--adapter", root / "adapter")
    assert rc == 0 and out.strip(), err
    rc, out, err = run_cli(capsys, "crosscheck", base, "--tokens", "8", "--adapter", root / "adapter", "--json")
    assert rc == 0, out + err
    assert json.loads(out)["passed"]
    rc, out, err = run_cli(capsys, "export-merged", root / "run", root / "merged", "--format", "float32")
    assert rc == 0, err
    ids = torch.tensor(_ids(t=8))
    mc._quiet()
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), device_map="cpu", dtype=torch.float32)
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base), device_map="cpu", dtype=torch.float32), str(root / "adapter"))
    with torch.no_grad():
        got, want = merged(ids).logits.numpy(), ref.train()(ids).logits.numpy()
    assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("layers", [4, pytest.param(None, marks=pytest.mark.slow)])
def test_upcycled_smollm2_reproduces_smollm2(smollm2, tmp_path, layers):
    """A Mixtral whose experts are all SmolLM2's MLP (real weights, random router): routing weights
    sum to one, so its logits are SmolLM2's, in jqlora and in transformers."""
    from transformers import AutoModelForCausalLM

    root = mc.upcycled_smollm2(smollm2.bf16, tmp_path, layers=layers)
    ids = np.random.default_rng(0).integers(0, 49152, (1, 12))
    dense = models.load_causal_lm(root / "dense", compute_dtype=jnp.float32)
    upcycled = models.load_causal_lm(root / "mixtral", compute_dtype=jnp.float32)
    ref = np.asarray(dense(jnp.asarray(ids)))
    assert _rel(upcycled(jnp.asarray(ids)), ref) < 1e-5
    assert {type(layer.mlp).__name__ for layer in upcycled.model.layers} == {"MoEBlock"}
    mc._quiet()
    tm = AutoModelForCausalLM.from_pretrained(str(root / "mixtral"), device_map="cpu", dtype=torch.float32)
    with torch.no_grad():
        assert _rel(tm(torch.tensor(ids)).logits.numpy(), ref) < 1e-4


def test_gathered_experts_equal_the_grouped_product():
    """Decoding a few tokens (rows * k < experts) reads only the chosen experts: each row against
    its own gathered expert gives the grouped product's rows, LoRA and gradients included."""
    from jqlora import quant

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 0.05, (6, 32, 64)), jnp.float32)
    ex = QLoRAExperts(quant.quantize_experts(w), compute_dtype=jnp.float32)
    ex.enable_lora(4, 8, rngs=nnx.Rngs(0))
    ex.set_lora(ex.lora_A[...], jnp.asarray(rng.normal(0, 0.1, (6, 32, 4)), jnp.float32))
    ids = jnp.asarray([4, 1, 4, 0, 5], jnp.int32)
    xs = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    order = jnp.argsort(ids, stable=True)
    gs = jnp.bincount(ids, length=6).astype(jnp.int32)

    graphdef, lstate, rest = nnx.split(ex, nnx.LoRAParam, ...)

    def grouped(x, ls):
        return nnx.merge(graphdef, ls, rest)(x[order], gs)[jnp.argsort(order)]

    def gathered(x, ls):
        return nnx.merge(graphdef, ls, rest)(x, None, ids)

    np.testing.assert_allclose(jax.jit(gathered)(xs, lstate), jax.jit(grouped)(xs, lstate), rtol=1e-5, atol=1e-6)
    g1 = jax.jit(jax.grad(lambda x, ls: jnp.sum(grouped(x, ls) ** 2), argnums=(0, 1)))(xs, lstate)
    g2 = jax.jit(jax.grad(lambda x, ls: jnp.sum(gathered(x, ls) ** 2), argnums=(0, 1)))(xs, lstate)
    for p, q in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-6)
