"""Gradients of the LoRA parameters on one batch: jqlora vs PEFT + transformers + bitsandbytes (torch, CPU).

Both sides load the same tiny bitsandbytes Llama checkpoint (checkpoint_factory: hidden 64,
2 layers, nf4 double quant with in_features multiples of the blocksize 64, or LLM.int8), put LoRA
(r=4, alpha=8, all 7 projections, dropout 0) with the same random NON-zero A and B on every
projection, compute the masked mean next-token cross-entropy (fp32) of a fixed batch (B=2, T=12)
and differentiate it w.r.t. every lora_A / lora_B. The gradients are compared per tensor by HF
module name with  rel = max|g_jax - g_torch| / max|g_torch|.

The torch model is kept in train mode (dropout is 0 everywhere): that picks bitsandbytes' CPU
training paths, which dequantize the base weight to the activation dtype and run F.linear
(4-bit: MatMul4Bit; 8-bit: MatMul8bitFp = linear(x, CB * SCB / 127)), i.e. exactly jqlora's
weight-only numerics. In eval mode on an AVX512-BF16 CPU bitsandbytes' fused 4-bit kernel runs in
bf16 and 8-bit runs LLM.int8 activation quantization, neither of which is what we compare here.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jqlora import lora, models  # noqa: E402
from jqlora.train.step import masked_cross_entropy  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.torch

RANK, ALPHA = 4, 8
B, T, VOCAB = 2, 12, 128
FP32_TOL = 1e-4
LOSS_TOL = 1e-5
BF16_TOL = 0.15  # see test_lora_grads_match_peft_bf16_nf4


# ------------------------------------------------------------------ fixtures / shared data
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    over = {"initializer_range": 0.1}  # same kwargs as tests/models/test_models.py: shares its cached builds
    out = {q: checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant=q, config_overrides=over)
           for q in ("nf4", "int8")}
    # bf16 model dtype + bnb_4bit_compute_dtype=bf16: transformers loads it as a bf16 model
    out["nf4_bf16"] = checkpoint_factory.cached_llama_checkpoint(
        tmp_path_factory, quant="nf4", dtype=torch.bfloat16, compute_dtype=torch.bfloat16, config_overrides=over)
    return out


def _batch():
    """Fixed random ids (B, T), targets = ids[:, 1:], and a loss mask (B, T-1) with zeros
    (a masked prompt prefix on row 0, a padded tail on row 1, and a few random holes)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (B, T)).astype(np.int64)
    mask = (rng.random((B, T - 1)) > 0.2).astype(np.float32)
    mask[0, :4] = 0.0
    mask[1, -3:] = 0.0
    assert 0 < mask.sum() < mask.size
    return ids, ids[:, 1:], mask


def _lora_values(shapes):
    """{module: {"lora_A", "lora_B"}} random non-zero fp32 values (B non-zero so that both A's and
    B's gradients are non-trivial), deterministic per module name order."""
    rng = np.random.default_rng(1)
    out = {}
    for name in sorted(shapes):
        (r, fin), (fout, _) = shapes[name]["lora_A"], shapes[name]["lora_B"]
        out[name] = {"lora_A": (rng.standard_normal((r, fin)) / np.sqrt(fin)).astype(np.float32),
                     "lora_B": (0.3 * rng.standard_normal((fout, r))).astype(np.float32)}
    return out


# ------------------------------------------------------------------ torch side
def _peft_model(path):
    import checkpoint_factory

    tm = checkpoint_factory.load_with_transformers(path)  # the checkpoint's dtype
    pcfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(lora.DEFAULT_TARGETS), lora_dropout=0.0)
    pm = peft.get_peft_model(tm, pcfg)
    pm.train()  # bitsandbytes' training path (dequantize + linear); dropout is 0 everywhere
    return pm


def _peft_lora_layers(pm):
    """{HF module name: peft LoRA layer} (prefix "base_model.model." removed)."""
    return {name.removeprefix("base_model.model."): mod for name, mod in pm.named_modules()
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {})}


def _torch_loss_and_grads(pm, values, ids, targets, mask):
    layers = _peft_lora_layers(pm)
    assert set(layers) == set(values)
    with torch.no_grad():
        for name, mod in layers.items():
            for key in ("lora_A", "lora_B"):
                w = getattr(mod, key)["default"].weight
                assert w.dtype == torch.float32  # PEFT keeps adapter weights in fp32 (autocast_adapter_dtype)
                w.copy_(torch.from_numpy(values[name][key]))
    pm.zero_grad(set_to_none=True)
    logits = pm(torch.as_tensor(ids)).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.as_tensor(targets).reshape(-1),
                                           reduction="none")
    m = torch.as_tensor(mask).reshape(-1)
    loss = (ce * m).sum() / m.sum()
    loss.backward()
    grads = {name: {key: getattr(mod, key)["default"].weight.grad.detach().float().numpy().copy()
                    for key in ("lora_A", "lora_B")} for name, mod in layers.items()}
    return float(loss.detach()), grads


# ------------------------------------------------------------------ jax side
@nnx.jit
def _jax_loss_and_grads_jit(model, ids, targets, mask):
    def loss_fn(m):
        s, n = masked_cross_entropy(m(ids)[:, :-1], targets, mask)
        return s / n

    return nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)


def _jax_loss_and_grads(model, ids, targets, mask):
    loss, grads = _jax_loss_and_grads_jit(model, jnp.asarray(ids, jnp.int32), jnp.asarray(targets, jnp.int32),
                                          jnp.asarray(mask))
    # by HF module name, as lora_params_by_module names the params (stacked layers split per layer)
    by_module = {name: {k: np.asarray(v, np.float64) for k, v in g.items()}
                 for name, g in lora.lora_state_by_module(model, grads).items()}
    assert set(by_module) == set(lora.lora_params_by_module(model))
    return float(loss), by_module


def _jax_model(path, values, compute_dtype):
    m = models.load_causal_lm(path, lora=lora.LoraConfig(rank=RANK, alpha=ALPHA), compute_dtype=compute_dtype)
    lora.set_lora_params(m, values)
    return m


# ------------------------------------------------------------------ comparison
def _compare(g_jax, g_torch):
    """{"module.lora_X": rel} with rel = max|g_jax - g_torch| / max|g_torch| per tensor."""
    assert set(g_jax) == set(g_torch)
    out = {}
    for name in g_torch:
        for key in ("lora_A", "lora_B"):
            ref = np.asarray(g_torch[name][key], np.float64)
            got = np.asarray(g_jax[name][key], np.float64)
            assert got.shape == ref.shape, (name, key)
            scale = np.abs(ref).max()
            assert scale > 0, f"{name}.{key}: zero torch gradient (a trivial comparison)"
            out[f"{name}.{key}"] = float(np.abs(got - ref).max() / scale)
    return out


def _worst(rel):
    name = max(rel, key=rel.get)
    return name, rel[name]


def _run_case(path, label, compute_dtype, torch_dtype):
    ids, targets, mask = _batch()
    pm = _peft_model(path)
    for n, p in pm.named_parameters():  # every float tensor of the base model is in torch_dtype
        assert p.dtype in (torch.uint8, torch.int8, torch_dtype) or "lora_" in n, (n, p.dtype)
    shapes = {n: {k: tuple(getattr(m, k)["default"].weight.shape) for k in ("lora_A", "lora_B")}
              for n, m in _peft_lora_layers(pm).items()}
    assert len(shapes) == 2 * 7
    values = _lora_values(shapes)
    loss_t, g_t = _torch_loss_and_grads(pm, values, ids, targets, mask)
    model = _jax_model(path, values, compute_dtype)
    loss_j, g_j = _jax_loss_and_grads(model, ids, targets, mask)
    rel = _compare(g_j, g_t)
    name, worst = _worst(rel)
    loss_rel = abs(loss_j - loss_t) / abs(loss_t)
    print(f"\n[lora grads] {label}: loss jax {loss_j:.7f} torch {loss_t:.7f} (rel {loss_rel:.2e}); "
          f"worst per-tensor grad rel err {worst:.3e} at {name}; median {np.median(list(rel.values())):.3e}")
    return dict(model=model, values=values, g_t=g_t, rel=rel, worst=(name, worst), loss_rel=loss_rel,
                batch=(ids, targets, mask))


def _perturbed_worst(case):
    """Scale one JAX lora_B by 1.01 and return the worst relative gradient error against torch."""
    model, values = case["model"], case["values"]
    target = "model.layers.1.self_attn.v_proj"
    bad = {n: dict(v) for n, v in values.items()}
    bad[target]["lora_B"] = values[target]["lora_B"] * np.float32(1.01)
    lora.set_lora_params(model, bad)
    try:
        _, g_bad = _jax_loss_and_grads(model, *case["batch"])
    finally:
        lora.set_lora_params(model, values)
    return _worst(_compare(g_bad, case["g_t"]))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("q", ["nf4", "int8"])
def test_lora_grads_match_peft_fp32(ckpts, q):
    """fp32 compute on both sides over the same dequantized base weights: the only differences are
    fp32 summation order, so every LoRA gradient agrees to ~1e-6 relative (tolerance 1e-4).
    Also: scaling one JAX lora_B by 1% must break the agreement (the test can fail)."""
    case = _run_case(ckpts[q], f"{q} fp32", jnp.float32, torch.float32)
    name, worst = case["worst"]
    assert case["loss_rel"] <= LOSS_TOL, f"{q} fp32 loss rel err {case['loss_rel']:.3e} > {LOSS_TOL}"
    assert worst <= FP32_TOL, f"{q} fp32: worst per-tensor LoRA grad rel err {worst:.3e} at {name} > {FP32_TOL}"
    pname, pworst = _perturbed_worst(case)
    print(f"[lora grads] {q} fp32 with one lora_B scaled by 1.01: worst rel err {pworst:.3e} at {pname}")
    assert pworst > FP32_TOL, f"a 1% change of one lora_B went unnoticed: worst rel err {pworst:.3e} <= {FP32_TOL}"


def test_lora_grads_match_peft_bf16_nf4(ckpts):
    """bf16 compute, "model in bf16" on the torch side (not autocast, which would keep the
    embeddings, norm weights and residual stream in fp32, unlike jqlora). Both load one nf4
    checkpoint built in bf16 (model dtype bf16, bnb_4bit_compute_dtype=bf16): transformers loads
    it as a bf16 model (embeddings, norms, lm_head bf16; bitsandbytes dequantizes nf4 to bf16 and
    runs a bf16 linear); PEFT keeps the LoRA weights in fp32 (autocast_adapter_dtype) and runs the
    LoRA branch in fp32; loss in fp32. JAX: load_causal_lm(compute_dtype=bf16) (activations and
    matmuls in bf16 with fp32 accumulation, norms/softmax/CE in fp32, LoRA params fp32 but cast to
    bf16 inside the fused base + LoRA product).
    (Loading the fp32 checkpoint with dtype=torch.bfloat16 is NOT a bf16 model in transformers
    5.23: the unquantized tensors stay fp32 and bnb_4bit_compute_dtype=fp32 upcasts the 4-bit
    matmuls; `.to(bfloat16)` is refused for bitsandbytes models.)

    Honest tolerance: the two sides round different intermediates to bf16 (8-bit mantissa) at
    different points, and LoRA gradients are sums over all loss tokens of products of rounded
    activations and rounded upstream gradients, so they are far noisier than the loss. On this
    tiny model each bf16 side is itself 2e-2 (median) .. 9e-2 (worst tensor) away from the fp32
    gradients, so side-vs-side agreement cannot be better than that: we assert
      * jax bf16 vs torch bf16: worst per-tensor rel err <= 0.15 (measured ~7e-2);
      * jqlora's own bf16 error (vs its fp32 gradients over the same checkpoint, which the fp32
        tests pin to torch at ~1e-6) <= 2x torch's bf16 error (vs the same fp32 gradients), i.e.
        jqlora's bf16 is as accurate as torch's, up to noise (measured ratio ~1.5)."""
    case = _run_case(ckpts["nf4_bf16"], "nf4 bf16", jnp.bfloat16, torch.bfloat16)
    name, worst = case["worst"]
    assert case["loss_rel"] <= 5e-3, f"nf4 bf16 loss rel err {case['loss_rel']:.3e} > 5e-3"
    assert worst <= BF16_TOL, f"nf4 bf16: worst per-tensor LoRA grad rel err {worst:.3e} at {name} > {BF16_TOL}"
    # fp32 reference over the same (bf16) checkpoint
    _, g32 = _jax_loss_and_grads(_jax_model(ckpts["nf4_bf16"], case["values"], jnp.float32), *case["batch"])
    _, g16 = _jax_loss_and_grads(case["model"], *case["batch"])
    jname, jerr = _worst(_compare(g16, g32))
    tname, terr = _worst(_compare(case["g_t"], g32))
    print(f"[lora grads] nf4 bf16 vs fp32 gradients: jqlora {jerr:.3e} at {jname}, torch {terr:.3e} at {tname}")
    assert jerr <= 2 * terr, (f"jqlora bf16 LoRA grads are {jerr:.3e} from fp32 ({jname}), more than 2x torch's "
                              f"bf16 error {terr:.3e} ({tname})")
