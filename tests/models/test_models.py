"""Llama-family models (jqlora.models): logits against transformers (torch, CPU), bitsandbytes
4-bit / 8-bit checkpoints, PEFT adapters, packing, KV-cache generation and sampling."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import lora, models, quant
from jqlora.models import ModelConfig, packed_attention
from jqlora.models.config import rope_inv_freq
from jqlora.models.generate import sample_token
from jqlora.models.attention import segment_positions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
ARCHS = {
    # (config class, model class, overrides): each exercises one family-specific path.
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),  # window < T
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),  # q/k/v bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),  # qk-norm, tied
}
T = 24


def _rel(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = np.abs(ours - ref).max()
    return err, err / np.abs(ref).max()


def _report(request, name, ours, ref):
    err, rel = _rel(ours, ref)
    print(f"\n[logits] {name}: max abs {err:.3g}, rel {rel:.3g}")
    return err, rel


def _randomize(model, seed=0):
    """O(1) activations: embeddings N(0,1), linears N(0, 1/in), norms 1+N(0,.1), biases N(0,.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


def _torch_model(arch):
    cfg_cls, model_cls, over = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **over})
    torch.manual_seed(0)
    return _randomize(getattr(transformers, model_cls)(cfg).eval())


def _load(path):
    import interop
    return interop.load_bnb_checkpoint(path)


def _ids(b=2, t=T, seed=0):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], (b, t)).astype(np.int32)


def _torch_logits(model, ids, **kw):
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long), **kw).logits.float().numpy()


_fwd = nnx.jit(lambda m, ids: m(ids))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{arch: (torch model, checkpoint dir written by save_pretrained)}."""
    out = {}
    for arch in ARCHS:
        tm = _torch_model(arch)
        d = tmp_path_factory.mktemp(arch)
        tm.save_pretrained(d)
        out[arch] = (tm, d)
    return out


@pytest.mark.torch
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers_fp32(arch, saved, request):
    tm, d = saved[arch]
    params, config = _load(d)
    cfg = ModelConfig.from_hf(config)
    if arch == "llama3":
        assert cfg.rope_type == "llama3"
        # the three llama3 frequency bands (kept, smoothed, divided) all occur for this config
        base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
        got = rope_inv_freq(cfg)
        assert np.isclose(got[0], base[0]) and np.isclose(got[-1], base[-1] / 8) and not np.isclose(got[1], base[1])
    ours = models.from_params(params, config, compute_dtype=jnp.float32)
    ids = _ids()
    y = _fwd(ours, jnp.asarray(ids))
    assert y.shape == (2, T, 128) and y.dtype == jnp.float32
    _, rel = _report(request, f"{arch} fp32", y, _torch_logits(tm, ids))
    assert rel < 1e-4


@pytest.mark.torch
def test_logits_bf16_compute_vs_transformers_bf16(saved, request):
    """Both sides compute in bf16 from the same fp32 weights (rounded to bf16 once); they differ
    only by bf16 rounding of intermediates and summation order, so ~1e-2 relative."""
    tm, d = saved["llama3"]
    params, config = _load(d)
    ours = models.from_params(params, config, compute_dtype=jnp.bfloat16)
    ids = _ids()
    y = _fwd(ours, jnp.asarray(ids))
    assert y.dtype == jnp.bfloat16
    ref32 = _torch_logits(tm, ids)
    ref16 = _torch_logits(tm.to(torch.bfloat16), ids)
    tm.to(torch.float32)
    _, rel16 = _report(request, "llama3 bf16 vs torch bf16", y, ref16)
    _, rel_torch = _report(request, "torch bf16 vs torch fp32 (scale of bf16 error)", ref16, ref32)
    _, rel32 = _report(request, "llama3 bf16 vs torch fp32", y, ref32)
    assert rel16 < 3e-2 and rel32 < 3e-2 and rel32 < 3 * rel_torch + 1e-3


@pytest.mark.torch
def test_load_causal_lm_unquantized_and_quantize_at_load(saved, request):
    tm, d = saved["qwen2"]
    ids = _ids()
    ref = _torch_logits(tm, ids)
    m = models.load_causal_lm(d, compute_dtype=jnp.float32)
    _report(request, "qwen2 load_causal_lm fp32", _fwd(m, jnp.asarray(ids)), ref)
    assert _rel(_fwd(m, jnp.asarray(ids)), ref)[1] < 1e-4
    mq = models.load_causal_lm(d, compute_dtype=jnp.float32, quantize="nf4",
                               lora=lora.LoraConfig(rank=4, target_modules=("q_proj", "v_proj")))
    q_proj = mq.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base.get_value(), quant.Weight4bit) and q_proj.has_lora
    assert not mq.model.layers[0].mlp.up_proj.has_lora
    assert not isinstance(mq.lm_head.base.get_value(), quant.Weight4bit)  # lm_head stays dense
    yq = _fwd(mq, jnp.asarray(ids))
    _report(request, "qwen2 quantized at load (nf4) vs fp32 torch (nf4 error)", yq, ref)
    # Exactly the quantization error: a dense model over the dequantized weights gives the same logits.
    params, config = _load(d)
    for name, layer in lora.named_linears(mq):
        if isinstance(layer.base.get_value(), quant.Weight4bit):
            params[name + ".weight"] = quant.dequantize(layer.base.get_value(), jnp.float32)
    ydq = _fwd(models.from_params(params, config, compute_dtype=jnp.float32), jnp.asarray(ids))
    _, rel = _report(request, "qwen2 nf4-at-load vs dense over dequantized weights", yq, ydq)
    assert rel < 1e-5


# ------------------------------------------------------------------ bitsandbytes checkpoints
@pytest.fixture(scope="module")
def bnb_ckpts(tmp_path_factory):
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    over = {"initializer_range": 0.1}
    return {q: checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant=q, config_overrides=over)
            for q in ("nf4", "int8")}


def _bnb_torch(path, train):
    import checkpoint_factory
    tm = checkpoint_factory.load_with_transformers(path)
    return tm.train() if train else tm  # dropout is 0 in these configs; train() only picks bnb's path


@pytest.mark.torch
def test_nf4_checkpoint_matches_bitsandbytes(bnb_ckpts, request):
    """4-bit: in train mode bitsandbytes' CPU gemm_4bit dequantizes to the activation dtype and
    runs F.linear, exactly what we do, so fp32 agrees to fp32 rounding. In eval mode on an
    AVX512-BF16 CPU, Linear4bit repacks the weight into its CPU layout and runs a fused kernel
    that casts activations AND absmax to bf16 (bnb backends/cpu/ops.py gemv_4bit): bf16
    numerics, ~1e-2 relative against fp32. Without AVX512-BF16, eval == train path."""
    params, config = _load(bnb_ckpts["nf4"])
    assert any(isinstance(v, quant.Weight4bit) for v in params.values())
    ids = _ids()
    ours32 = _fwd(models.from_params(params, config, compute_dtype=jnp.float32), jnp.asarray(ids))
    ref_train = _torch_logits(_bnb_torch(bnb_ckpts["nf4"], train=True), ids)
    ref_eval = _torch_logits(_bnb_torch(bnb_ckpts["nf4"], train=False), ids)
    _, rel = _report(request, "nf4 fp32 vs bnb (train-mode path: dequantize + linear)", ours32, ref_train)
    assert rel < 1e-4
    from bitsandbytes.functional import has_avx512bf16
    bf16_eval = has_avx512bf16()
    _, rel_eval = _report(request, f"nf4 fp32 vs bnb eval (avx512-bf16 kernel: {bf16_eval})", ours32, ref_eval)
    assert rel_eval < (3e-2 if bf16_eval else 1e-4)
    ours16 = _fwd(models.from_params(params, config, compute_dtype=jnp.bfloat16), jnp.asarray(ids))
    _, rel16 = _report(request, "nf4 bf16 compute vs bnb fp32 train", ours16, ref_train)
    assert rel16 < 3e-2
    _, rel16e = _report(request, "nf4 bf16 compute vs bnb eval", ours16, ref_eval)
    assert rel16e < 3e-2


@pytest.mark.torch
def test_int8_checkpoint_matches_bitsandbytes(bnb_ckpts, request):
    """8-bit: bnb on CPU in train mode runs MatMul8bitFp = linear(x, CB * SCB/127), which is our
    weight-only path (fp32: tight). In eval mode it runs MatMul8bitLt: x cast to fp16, row-wise
    int8 activations, int32 matmul, fp16 outlier columns above llm_int8_threshold (6.0); our
    int8_numerics="llm_int8" reproduces that, while weight-only differs by the activation
    quantization error (~1e-2)."""
    params, config = _load(bnb_ckpts["int8"])
    assert any(isinstance(v, quant.Int8Weight) for v in params.values())
    ids = _ids()
    ours_wo = _fwd(models.from_params(params, config, compute_dtype=jnp.float32), jnp.asarray(ids))
    ours_llm = _fwd(models.from_params(params, config, compute_dtype=jnp.float32, int8_numerics="llm_int8"),
                    jnp.asarray(ids))
    ref_train = _torch_logits(_bnb_torch(bnb_ckpts["int8"], train=True), ids)
    ref_eval = _torch_logits(_bnb_torch(bnb_ckpts["int8"], train=False), ids)
    _, rel = _report(request, "int8 weight-only fp32 vs bnb train (MatMul8bitFp)", ours_wo, ref_train)
    assert rel < 1e-4
    _, rel_llm = _report(request, "int8 llm_int8 fp32 vs bnb eval (MatMul8bitLt)", ours_llm, ref_eval)
    _, rel_wo_eval = _report(request, "int8 weight-only fp32 vs bnb eval (MatMul8bitLt)", ours_wo, ref_eval)
    assert rel_llm < 2e-3
    assert rel_wo_eval < 5e-2


@pytest.mark.torch
@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_adapter_on_nf4_matches(bnb_ckpts, use_rslora, request):
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "down_proj"] if use_rslora else list(lora.DEFAULT_TARGETS)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora)
    tm = peft.get_peft_model(_bnb_torch(bnb_ckpts["nf4"], train=True), pcfg)
    g = torch.Generator().manual_seed(1)
    by_module = {}
    with torch.no_grad():
        for name, mod in tm.named_modules():
            if hasattr(mod, "lora_B") and "default" in getattr(mod, "lora_B", {}):
                mod.lora_B["default"].weight.copy_(0.3 * torch.randn(mod.lora_B["default"].weight.shape, generator=g))
                key = name.removeprefix("base_model.model.")
                by_module[key] = {"lora_A": mod.lora_A["default"].weight.numpy().copy(),
                                  "lora_B": mod.lora_B["default"].weight.numpy().copy()}
    assert len(by_module) == 2 * len(targets)
    params, config = _load(bnb_ckpts["nf4"])
    ours = models.from_params(params, config, compute_dtype=jnp.float32, rngs=nnx.Rngs(0),
                              lora=lora.LoraConfig(rank=4, alpha=8, target_modules=targets, use_rslora=use_rslora))
    assert set(lora.lora_params_by_module(ours)) == set(by_module)
    lora.set_lora_params(ours, by_module)
    ids = _ids()
    ref = _torch_logits(tm, ids)
    _, rel = _report(request, f"PEFT LoRA (rslora={use_rslora}) on nf4, fp32", _fwd(ours, jnp.asarray(ids)), ref)
    assert rel < 1e-4


# ------------------------------------------------------------------ model-only behaviour
TINY_LLAMA = dict(model_type="llama", **TINY)


@pytest.fixture(scope="module")
def tiny():
    """Dense tiny llama with LoRA (B non-zero, dropout) on all projections and remat, in eval
    mode: generation and masking do not depend on the weight format (the quantized paths are
    covered above); remat + generate's while_loop is a combination that once broke."""
    params = models.init_params(TINY_LLAMA, seed=0, std=0.15)
    m = models.from_params(params, TINY_LLAMA, compute_dtype=jnp.float32, remat=True,
                           lora=lora.LoraConfig(rank=4, dropout=0.1), rngs=nnx.Rngs(0))
    for _, layer in lora.named_linears(m):
        if layer.has_lora:
            layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.02))
    m.eval()
    return m


_seg_fwd = nnx.jit(lambda m, ids, seg: m(ids, segment_ids=seg))


def test_module_names_are_hf_names(tiny):
    names = [n for n, _ in lora.named_linears(tiny)]
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.1.mlp.down_proj" in names
    assert "lm_head" in names and len(names) == 2 * 7 + 1
    assert len(lora.lora_params_by_module(tiny)) == 14
    # Only LoRA matrices are Params; the frozen bases are QuantizedBase variables. The layers are
    # stored stacked: one array per weight kind with a leading layer axis (2 layers here).
    assert len(jax.tree_util.tree_leaves(nnx.state(tiny, nnx.Param))) == 14
    bases = nnx.state(tiny, lora.QuantizedBase)
    assert bases["model"]["layers"]["stacks"][0]["layer"]["self_attn"]["q_proj"]["base"].get_value().shape == (2, 64, 64)
    assert tiny.model.layers[1].self_attn.q_proj.base.get_value().shape == (64, 64)


def test_segment_ids_mask_cross_document_attention(tiny):
    """Row 0 packs doc a (5 tokens), doc b (6) and 2 padding tokens; rows of the reference batch
    hold each document alone (then padding). Every real token's logits must agree."""
    a, b = _ids(1, 5, seed=1)[0], _ids(1, 6, seed=2)[0]
    packed = np.zeros((2, 13), np.int32)
    packed[0, :11] = np.concatenate([a, b])
    seg = np.zeros((2, 13), np.int32)
    seg[0, :5], seg[0, 5:11] = 1, 2
    alone = np.zeros((2, 13), np.int32)
    alone[0, :5], alone[1, :6] = a, b
    seg_alone = np.zeros((2, 13), np.int32)
    seg_alone[0, :5], seg_alone[1, :6] = 1, 1
    y = np.asarray(_seg_fwd(tiny, jnp.asarray(packed), jnp.asarray(seg)))
    ref = np.asarray(_seg_fwd(tiny, jnp.asarray(alone), jnp.asarray(seg_alone)))
    np.testing.assert_allclose(y[0, :5], ref[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y[0, 5:11], ref[1, :6], rtol=1e-5, atol=1e-5)
    assert np.isfinite(y).all()
    # without segment ids doc b would see doc a:
    y_nomask = np.asarray(_seg_fwd(tiny, jnp.asarray(packed), jnp.ones((2, 13), jnp.int32)))
    assert not np.allclose(y_nomask[0, 5:11], ref[1, :6], atol=1e-3)
    np.testing.assert_array_equal(np.asarray(segment_positions(jnp.asarray(seg)))[0, 3:13],
                                  [3, 4, 0, 1, 2, 3, 4, 5, 0, 1])


def _prompts():
    """Row 0: a 7-token prompt; row 1: a 4-token prompt left-padded with 3 pads."""
    ids = _ids(2, 7, seed=3)
    ids[1, :3] = 0
    mask = np.ones((2, 7), np.int32)
    mask[1, :3] = 0
    return ids, mask


def test_generate_greedy_equals_recomputation_and_cache_logits(tiny):
    ids, mask = _prompts()
    seqs, scores = models.generate(tiny, ids, 6, attention_mask=mask, return_logits=True)
    assert seqs.shape == (2, 13) and scores.shape == (2, 6, 128)
    np.testing.assert_array_equal(np.asarray(seqs[:, :7]), ids)
    # Recompute the whole sequence without a cache (row 1: the pads are segment 0, never attended)
    seg = np.concatenate([mask, np.ones((2, 6), np.int32)], axis=1)
    full = np.asarray(_seg_fwd(tiny, seqs, jnp.asarray(seg)))
    # KV-cache decode logits == full-sequence forward logits at every step
    np.testing.assert_allclose(np.asarray(scores), full[:, 6:12], rtol=1e-5, atol=1e-5)
    # greedy == argmax of the recomputed logits
    np.testing.assert_array_equal(np.asarray(seqs[:, 7:]), full[:, 6:12].argmax(-1))
    # the left-padded row equals the same 4-token prompt run alone (pads change nothing)
    alone = np.zeros((2, 13), np.int32)
    alone[1, :10] = np.asarray(seqs[1, 3:])
    seg_alone = (np.arange(13) < 10).astype(np.int32)[None].repeat(2, 0)
    ref = np.asarray(_seg_fwd(tiny, jnp.asarray(alone), jnp.asarray(seg_alone)))
    np.testing.assert_allclose(full[1, 3:13], ref[1, :10], rtol=1e-5, atol=1e-5)


def test_generate_eos_and_sampling(tiny):
    ids, mask = _prompts()
    greedy, _ = models.generate(tiny, ids, 6, attention_mask=mask, return_logits=True)
    greedy = np.asarray(greedy)
    eos = int(greedy[0, 8])  # the second generated token of row 0
    out, _ = models.generate(tiny, ids, 6, attention_mask=mask, eos_token_id=eos, return_logits=True)
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0, :9], greedy[0, :9])
    assert (out[0, 9:] == eos).all()
    s1, _ = models.generate(tiny, ids, 6, attention_mask=mask, temperature=1.0, top_p=0.9, rng=jax.random.key(0),
                            return_logits=True)
    s2, _ = models.generate(tiny, ids, 6, attention_mask=mask, temperature=0.7, top_p=0.9, rng=jax.random.key(0),
                            return_logits=True)
    assert s1.shape == (2, 13) and ((0 <= np.asarray(s1)) & (np.asarray(s1) < 128)).all()
    assert s2.shape == (2, 13)
    with pytest.raises(ValueError, match="rng"):
        models.generate(tiny, ids, 2, temperature=1.0)


def test_top_p_samples_only_from_nucleus():
    probs = np.array([0.5, 0.25, 0.15, 0.06, 0.04])
    logits = jnp.asarray(np.log(probs)[None].repeat(4000, 0), jnp.float32)
    keys = jax.random.key(0)
    toks = np.asarray(sample_token(logits, keys, temperature=1.0, top_p=0.8))
    # nucleus for 0.8: {0, 1, 2} (0.5 + 0.25 < 0.8, adding 0.15 crosses it)
    assert set(np.unique(toks)) == {0, 1, 2}
    freq = np.bincount(toks, minlength=5)[:3] / len(toks)
    np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.03)
    assert set(np.unique(np.asarray(sample_token(logits, keys, 1.0, top_p=0.3))).tolist()) == {0}
    assert (np.asarray(sample_token(logits, None, 0.0)) == 0).all()


def test_remat_gives_same_loss_and_grads():
    cfg = {**TINY_LLAMA, "num_hidden_layers": 1}
    params = models.init_params(cfg, seed=1, std=0.1)
    ids = jnp.asarray(_ids(2, 8, seed=5))

    def grads(remat):
        m = models.from_params(params, cfg, compute_dtype=jnp.float32, remat=remat,
                               lora=lora.LoraConfig(rank=2, target_modules=("q_proj", "down_proj")), rngs=nnx.Rngs(0))
        for _, layer in lora.named_linears(m):
            if layer.has_lora:
                layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.05))

        @nnx.jit
        def f(m):
            loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids)[:, :-1]).max(-1))  # noqa: E731
            return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

        return f(m)

    (l0, g0), (l1, g1) = grads(False), grads("dots_with_no_batch_dims_saveable")
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    assert len(jax.tree_util.tree_leaves(g0)) == 4
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_config_and_loader_errors(tmp_path):
    with pytest.raises(models.UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(models.UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf({**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    with pytest.raises(models.UnsupportedModelError, match="gemma"):
        models.load_causal_lm(tmp_path)
    params = models.init_params(TINY_LLAMA)
    missing = dict(params)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        models.from_params(missing, TINY_LLAMA)
    bad = dict(params)
    bad["model.layers.0.mlp.down_proj.weight"] = params["model.layers.0.mlp.down_proj.weight"].T
    with pytest.raises(ValueError, match="down_proj.weight.*transposed"):
        models.from_params(bad, TINY_LLAMA)
    extra = {**params, "model.layers.0.self_attn.q_proj.bias": jnp.zeros(64)}
    with pytest.raises(ValueError, match="q_proj.bias"):
        models.from_params(extra, TINY_LLAMA)
    with pytest.raises(ValueError, match="matched no linear"):
        models.from_params(params, TINY_LLAMA, lora=lora.LoraConfig(target_modules=("c_attn",)))


def _attention_pair(saved, arch, dtype, impl):
    """(einsum model, `impl` model) over one checkpoint with nonzero LoRA B, plus ids, packed
    segment ids (two segments in row 0, padding in row 1), the real-token mask and a function
    giving each model's LoRA gradients of a loss over the real tokens."""
    params, config = _load(saved[arch][1])
    build = lambda attn: models.from_params(params, config, compute_dtype=dtype, remat=True, attention=attn,
                                            lora=lora.LoraConfig(rank=2), rngs=nnx.Rngs(0))
    ref, fused = build("einsum"), build(impl)
    for m in (ref, fused):
        for _, layer in lora.named_linears(m):
            if layer.has_lora:
                layer.lora_B.set_value(jnp.full(layer.lora_B.shape, 0.05))
    ids = jnp.asarray(_ids())
    seg = np.ones((2, T), np.int32)
    seg[0, 10:] = 2
    seg[1, 20:] = 0  # padding
    real = seg > 0
    runs = packed_attention.segment_runs(seg, 4)  # cuDNN's packed layout (other paths ignore it)

    def grads(m):
        loss = lambda m: jnp.mean(m(ids, segment_ids=jnp.asarray(seg), segment_runs=runs)
                                  .astype(jnp.float32)[real] ** 2)
        return [np.asarray(g, np.float32) for g in
                jax.tree_util.tree_leaves(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m))]

    return ref, fused, ids, seg, real, grads, runs


@pytest.mark.torch
# sliding window + GQA; head_dim 32 + qk-norm (slow tier: the norms run before either attention path)
@pytest.mark.parametrize("arch", ["mistral", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_fused_attention_path_matches_einsum(arch, saved):
    """attention="xla" goes through jax.nn.dot_product_attention (the call that runs cuDNN flash
    attention with "cudnn" on a GPU): same logits and LoRA gradients as the einsum path, for plain
    causal input and for packed segments."""
    ref, fused, ids, seg, real, grads, _ = _attention_pair(saved, arch, jnp.float32, "xla")
    for kw in ({}, {"segment_ids": jnp.asarray(seg)}):
        y_ref, y = nnx.jit(lambda m, x: m(x, **kw))(ref, ids), nnx.jit(lambda m, x: m(x, **kw))(fused, ids)
        keep = real if kw else np.ones_like(real)
        np.testing.assert_allclose(np.asarray(y)[keep], np.asarray(y_ref)[keep], rtol=1e-5, atol=1e-4)
    for g_ref, g in zip(grads(ref), grads(fused)):
        # fp32: the two attention paths fuse differently; error relative to the tensor's scale
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=5e-6 * np.abs(g_ref).max())
    with pytest.raises(ValueError, match="unknown attention"):
        models.from_params(*_load(saved[arch][1]), attention="flash")


@pytest.mark.torch
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("arch", ["llama3", "mistral"])  # plain causal; sliding window + GQA
def test_cudnn_attention_matches_einsum_in_bf16(arch, saved):
    """attention="cudnn" (causal flag; packed rows through cuDNN's packed layout with segment
    tables, or the segment mask without them): the same bf16 logits and LoRA gradients as the
    einsum path, up to bf16 rounding, with nothing non-finite on real tokens; a table too narrow
    for a row's segments gives NaN in that row.
    "Up to bf16 rounding" for the gradients: within 5%, or within twice the distance between the
    einsum path in bf16 and in float32 (the bf16 LM head backward rounds dlogits to bf16, as
    torch does, which alone can take one gradient just past 5%)."""
    ref, fused, ids, seg, real, grads, runs = _attention_pair(saved, arch, jnp.bfloat16, "cudnn")
    for kw in ({}, {"segment_ids": jnp.asarray(seg)}, {"segment_ids": jnp.asarray(seg), "segment_runs": runs}):
        f = nnx.jit(lambda m, x: m(x, **kw).astype(jnp.float32))
        y_ref, y = np.asarray(f(ref, ids)), np.asarray(f(fused, ids))
        keep = real if kw else np.ones_like(real)
        assert np.isfinite(y[keep]).all()
        np.testing.assert_allclose(y[keep], y_ref[keep], rtol=0.05, atol=0.05 * np.abs(y_ref).max())
    wide = _attention_pair(saved, arch, jnp.float32, "einsum")[0]
    for g_ref, g, g32 in zip(grads(ref), grads(fused), grads(wide)):
        assert np.isfinite(g).all()
        bound = max(0.05 * np.linalg.norm(g_ref), 2 * np.linalg.norm(g_ref - g32)) + 1e-6
        assert np.linalg.norm(g - g_ref) <= bound
    narrow = packed_attention.segment_runs(seg, 1)  # row 0 holds two segments
    y = np.asarray(nnx.jit(lambda m, x: m(x, segment_ids=jnp.asarray(seg), segment_runs=narrow)
                           .astype(jnp.float32))(fused, ids))
    windowed = [w is not None and w < T for w in fused.config.sliding_windows]
    if not any(windowed):
        assert np.isnan(y[0]).all() and np.isfinite(y[1][real[1]]).all()
    elif all(windowed):  # a window shorter than the row keeps the mask: the tables are not used
        y_mask = np.asarray(nnx.jit(lambda m, x: m(x, segment_ids=jnp.asarray(seg))
                                    .astype(jnp.float32))(fused, ids))
        np.testing.assert_array_equal(y, y_mask)


def test_chunked_lm_loss_equals_full_logits_loss(tiny):
    """The train loss applies the LM head chunk by chunk (never all logits at once): same loss
    and same LoRA gradients as the plain full-logits cross-entropy."""
    from jqlora.train.step import chunked_cross_entropy, masked_cross_entropy

    ids = jnp.asarray(_ids(2, T, seed=5))
    targets = jnp.roll(ids, -1, axis=1)
    mask = jnp.asarray(np.random.default_rng(0).random((2, T)) < 0.7, jnp.float32)

    def full(m):
        s, n = masked_cross_entropy(m(ids), targets, mask)
        return s / n

    def chunked(m):
        s, n = chunked_cross_entropy(m.lm_logits, m(ids, return_hidden=True), targets, mask, chunk=7)
        return s / n

    diff = nnx.DiffState(0, nnx.LoRAParam)
    (l_full, g_full), (l_chunk, g_chunk) = (nnx.value_and_grad(f, argnums=diff)(tiny) for f in (full, chunked))
    np.testing.assert_allclose(float(l_chunk), float(l_full), rtol=1e-6)
    leaves_full, leaves_chunk = jax.tree_util.tree_leaves(g_full), jax.tree_util.tree_leaves(g_chunk)
    assert len(leaves_full) == len(leaves_chunk) == 14  # stacked: (layers, ...) per weight kind
    for a, b in zip(leaves_chunk, leaves_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_load_causal_lm_docstring_example_runs():
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder(recurse=False).find(models.load_causal_lm, "load_causal_lm", globs={}):
        runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted >= 6 and failed == 0
