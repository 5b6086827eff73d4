"""Mixed and fp16-stored bitsandbytes checkpoints against transformers + bitsandbytes (+ PEFT)
running on the same folders.

- "mixed": unsloth-style dynamic 4-bit. `llm_int8_skip_modules` keeps layer 1's mlp.down_proj
  (and lm_head) in bf16, so the three decoder layers differ in the middle and stack as three runs.
- "every": o_proj is dense in every layer (one stack, with a dense weight kind in it).
- "fp16": quantized from fp16 weights without double quantization: quant_state dtype "float16",
  float32 absmax, every unquantized tensor in fp16; computed in float32 or bfloat16.

The float32 torch reference is transformers' model with every unquantized tensor cast to float32
and bitsandbytes' layers in their reference path (exact dequantize + F.linear, float32 compute),
as tests/models/test_models.py and tests/lora/test_lora_gradients_vs_peft.py use it.
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import checkpoint_factory as cf  # noqa: E402
from cli_runner import run_cli  # noqa: E402
from interop import CheckpointError, load_bnb_checkpoint  # noqa: E402
from jqlora import lora, models, quant  # noqa: E402
from jqlora.train.step import masked_cross_entropy  # noqa: E402
from real_models import smollm2, smollm2_dynamic  # noqa: E402,F401  (fixtures)
from test_lora_gradients_vs_peft import _jax_loss_and_grads_jit  # noqa: E402

pytestmark = pytest.mark.torch

LAYERS = 3
OVER = {"num_hidden_layers": LAYERS, "initializer_range": 0.1}
DOWN1 = "model.layers.1.mlp.down_proj"
CHECKPOINTS = {
    "mixed": dict(quant="nf4", dtype=torch.bfloat16, compute_dtype=torch.bfloat16, config_overrides=OVER,
                  skip_modules=["lm_head", DOWN1]),
    "every": dict(quant="nf4", dtype=torch.bfloat16, compute_dtype=torch.bfloat16, config_overrides=OVER,
                  skip_modules=["lm_head", "o_proj"]),
    "fp16": dict(quant="nf4", double_quant=False, dtype=torch.float16, compute_dtype=torch.float16,
                 config_overrides=OVER),
}
DENSE = {  # the linear layers each checkpoint stores unquantized (lm_head aside)
    "mixed": [DOWN1],
    "every": [f"model.layers.{i}.self_attn.o_proj" for i in range(LAYERS)],
    "fp16": [],
}
STACKS = {"mixed": [(0, 1), (1, 1), (2, 1)], "every": [(0, LAYERS)], "fp16": [(0, LAYERS)]}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
RANK, ALPHA = 4, 8
FP32_TOL = 1e-4  # tests/models/test_models.py, tests/lora/test_lora_gradients_vs_peft.py: float32 vs bitsandbytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return lambda name: cf.cached_llama_checkpoint(tmp_path_factory, **CHECKPOINTS[name])


def _batch(b=2, t=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, (b, t)).astype(np.int64)
    return ids, ids[:, 1:], np.ones((b, t - 1), np.float32)


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _module(model, name):
    """The QLoRALinear `name` ("model.layers.1.mlp.down_proj") of a jqlora model (a layer view)."""
    parts = name.split(".")
    node = model.model.layers[int(parts[2])]
    for p in parts[3:]:
        node = getattr(node, p)
    return node


# ------------------------------------------------------------------------------------------ torch
def _torch_model(path, dtype=torch.float32):
    """transformers + bitsandbytes in float32 (or `dtype`): unquantized tensors cast to it (the
    checkpoint's own dtype otherwise), Linear4bit computing in it in its reference path.

    bitsandbytes' MatMul4Bit dequantizes into the activation dtype in its forward (gemm_4bit) but
    into quant_state.dtype, the stored bf16/fp16, in its backward, so its input gradients use
    rounded weights (LoRA gradients ~2e-3 off the exact ones here). quant_state.dtype = float32
    makes both directions the exact float32 dequantization; the forward is unchanged."""
    import bitsandbytes as bnb

    tm = cf.load_with_transformers(path)
    for p in tm.parameters():
        if not isinstance(p, bnb.nn.Params4bit) and p.is_floating_point():
            p.data = p.data.to(dtype)
    for mod in tm.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.compute_dtype, mod.compute_type_is_set = dtype, True
            mod.weight.quant_state.dtype = torch.float32
    return tm.train()  # dropout is 0: train() only picks bitsandbytes' dequantize + F.linear path


def _eager():
    """bitsandbytes' CPU ops run through torch.compile, whose first call costs seconds (about 8 s
    for SmolLM2); eager runs compute the same numbers."""
    return torch.compiler.set_stance("force_eager")


def _torch_logits(tm, ids) -> np.ndarray:
    with torch.no_grad(), _eager():
        return tm(torch.as_tensor(np.array(ids))).logits.float().numpy()


def _peft_layers(pm):
    return {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}


def _lora_values(names, model):
    """Random non-zero LoRA values for `names` (B non-zero: both A and B get gradients)."""
    rng = np.random.default_rng(1)
    out = {}
    for n in sorted(names):
        m = _module(model, n)
        out[n] = {"lora_A": (rng.standard_normal((RANK, m.in_features)) / np.sqrt(m.in_features)).astype(np.float32),
                  "lora_B": (0.3 * rng.standard_normal((m.out_features, RANK))).astype(np.float32)}
    return out


def _jax_lora_model(path, compute_dtype=jnp.float32):
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(p.rsplit(".", 1)[-1] for p in PROJ))
    model = models.load_causal_lm(path, lora=cfg, compute_dtype=compute_dtype)
    names = [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in PROJ]
    values = _lora_values(names, model)
    lora.set_lora_params(model, values)
    return model, values


# ------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_skipped_linears_stay_dense_bit_for_bit(ckpt, name):
    """Each linear loads as stored: skipped ones as their bf16/fp16 tensor (not cast, not
    quantized, also under quantize="nf4"), the rest as 4-bit with the recorded stored dtype; the
    stacked layers split exactly where the structure changes."""
    path = ckpt(name)
    tensors = cf.torch_tensors(path)
    params, config = load_bnb_checkpoint(path)
    stored = "float16" if name == "fp16" else "bfloat16"
    linears = [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in PROJ]
    for m in linears:
        if m in DENSE[name]:
            assert m not in params, m
            assert cf.same_bits(params[m + ".weight"], cf.tensor_to_numpy(tensors[m + ".weight"])), m
        else:
            q = params[m]
            assert isinstance(q, quant.Weight4bit) and q.stored_dtype == stored, m
            assert q.nested == (name != "fp16") and (q.nested or np.asarray(q.absmax).dtype == np.float32)
    assert {str(v.dtype) for k, v in params.items() if not isinstance(v, quant.Weight4bit)} == {stored}
    for quantize in (None, "nf4"):
        model = models.from_params(params, config, compute_dtype=jnp.float32, quantize=quantize)
        assert [(s.start, s.size) for s in model.model.layers.stacks] == STACKS[name]
        for m in linears:
            base = _module(model, m).base.get_value()
            if m in DENSE[name]:
                assert cf.same_bits(base, cf.tensor_to_numpy(tensors[m + ".weight"])), (m, quantize)
            else:
                assert isinstance(base, quant.Weight4bit), (m, quantize)
                assert np.array_equal(np.asarray(base.packed), np.asarray(params[m].packed)), (m, quantize)


# ------------------------------------------------------------------------------------------ numerics
def _grads(path, compute_dtype, ids, targets, mask):
    model, values = _jax_lora_model(path, compute_dtype)
    loss, grads = _jax_loss_and_grads_jit(model, jnp.asarray(ids, jnp.int32), jnp.asarray(targets, jnp.int32),
                                      jnp.asarray(mask))
    return model, values, float(loss), lora.lora_state_by_module(model, grads)


def _torch_grads(path, dtype, values, ids, targets):
    """PEFT (LoRA on every projection, set to `values`) on `_torch_model(path, dtype)`:
    (loss, {module: {"lora_A", "lora_B": gradient}}, the PEFT LoRA layers)."""
    pm = peft.get_peft_model(_torch_model(path, dtype), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[p.rsplit(".", 1)[-1] for p in PROJ]))
    pm.train()
    layers = _peft_layers(pm)
    assert set(layers) == set(values)
    with torch.no_grad():
        for n, mod in layers.items():
            for k in ("lora_A", "lora_B"):
                getattr(mod, k)["default"].weight.copy_(torch.from_numpy(values[n][k]))
    with _eager():
        logits = pm(torch.as_tensor(ids)).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), torch.as_tensor(targets).reshape(-1))
        loss.backward()
    grads = {n: {k: getattr(mod, k)["default"].weight.grad.float().numpy() for k in ("lora_A", "lora_B")}
             for n, mod in layers.items()}
    return loss.item(), grads, layers


def _worst(g, ref):
    """(tensor, max |g - ref| / max |ref|) of the worst LoRA gradient tensor."""
    rel = {f"{n}.{k}": _rel(g[n][k], ref[n][k]) for n in ref for k in ("lora_A", "lora_B")}
    top = max(rel, key=rel.get)
    return top, rel[top]


def _overall(g, ref) -> float:
    """|g - ref| / |ref| over every LoRA gradient at once (2-norms)."""
    pairs = [(np.asarray(g[n][k], np.float64), np.asarray(ref[n][k], np.float64)) for n in ref for k in ref[n]]
    return float(np.sqrt(sum(np.sum((a - r) ** 2) for a, r in pairs)) / np.sqrt(sum(np.sum(r ** 2) for _, r in pairs)))


@pytest.mark.parametrize("name", ["mixed", "fp16"])
def test_lora_gradients_match_peft(ckpt, name):
    """LoRA on all seven projections, dense ones included: loss and every lora_A / lora_B gradient
    equal PEFT's on transformers + bitsandbytes, in float32. The fp16-stored checkpoint also
    trains in bfloat16 (its stored dtype is not the compute dtype): those gradients are as far
    from torch's float32 ones as torch's own bfloat16 gradients are (at most 2x)."""
    path = ckpt(name)
    ids, targets, mask = _batch()
    model, values, loss_j, g_j = _grads(path, jnp.float32, ids, targets, mask)
    assert set(lora.lora_params_by_module(model)) == set(values) and set(DENSE[name]) <= set(values)
    loss_t, g_t, layers = _torch_grads(path, torch.float32, values, ids, targets)
    for m in DENSE[name]:  # PEFT wraps the dense layer as a plain nn.Linear LoRA layer
        assert type(layers[m].base_layer) is torch.nn.Linear
    assert all(np.abs(g).max() > 0 for gs in g_t.values() for g in gs.values())
    assert abs(loss_j - loss_t) < 1e-5 * loss_t
    top, rel = _worst(g_j, g_t)
    print(f"\n[lora grads] {name} float32: worst rel {rel:.2e} at {top}")
    assert rel < FP32_TOL, (top, rel)
    if name == "fp16":
        _, _, loss16, g16 = _grads(path, jnp.bfloat16, ids, targets, mask)
        loss_t16, g_t16, _ = _torch_grads(path, torch.bfloat16, values, ids, targets)
        ours, theirs = _overall(g16, g_t), _overall(g_t16, g_t)
        print(f"[lora grads] {name} bfloat16 vs torch float32: jqlora {ours:.2e} (loss "
              f"{abs(loss16 / loss_t - 1):.1e}), torch bfloat16 {theirs:.2e} (loss {abs(loss_t16 / loss_t - 1):.1e})")
        assert ours <= 2 * theirs and abs(loss16 - loss_t) <= 2 * abs(loss_t16 - loss_t) + 1e-3 * loss_t


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_and_exported_adapter_match_transformers_and_peft(ckpt, name, tmp_path):
    """float32 logits of the base model equal transformers + bitsandbytes'; with LoRA on every
    projection (dense ones included) exported as a PEFT adapter, peft.PeftModel.from_pretrained
    on that torch model gives the logits of the jqlora model."""
    from jqlora.adapters import save_adapter

    path = ckpt(name)
    ids, _, _ = _batch(t=16)
    tm = _torch_model(path)
    base_ref = _torch_logits(tm, ids)
    base = models.load_causal_lm(path, compute_dtype=jnp.float32)(jnp.asarray(ids))
    rel_base = _rel(base, base_ref)

    model, _ = _jax_lora_model(path)
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(p.rsplit(".", 1)[-1] for p in PROJ))
    save_adapter(tmp_path / "adapter", model, cfg, base_model=str(path))
    pm = peft.PeftModel.from_pretrained(tm, str(tmp_path / "adapter")).train()  # it sets eval mode
    assert set(_peft_layers(pm)) >= set(DENSE[name])
    ref = _torch_logits(pm, ids)
    assert _rel(base_ref, ref) > 100 * FP32_TOL  # the adapter changes the logits: not a no-op
    rel = _rel(model(jnp.asarray(ids)), ref)
    print(f"\n[logits] {name} float32 vs transformers+bitsandbytes: base rel {rel_base:.2e}, "
          f"with the adapter (PEFT) rel {rel:.2e}")
    assert rel_base < FP32_TOL and rel < FP32_TOL


def test_cached_generation_matches_transformers(ckpt):
    """Greedy decoding with the KV cache through the three stacks of the mixed checkpoint (each
    writes its own cache rows): every step's logits equal transformers' on the full sequence."""
    path = ckpt("mixed")
    prompt, _, _ = _batch(b=1, t=6, seed=3)
    seqs, scores = models.generate(models.load_causal_lm(path, compute_dtype=jnp.float32), prompt, 5,
                                   return_logits=True)
    ref = _torch_logits(_torch_model(path), np.asarray(seqs))[:, 5:10]
    assert _rel(scores, ref) < FP32_TOL
    np.testing.assert_array_equal(np.asarray(seqs)[:, 6:], ref.argmax(-1))


@pytest.mark.parametrize("name, dtype", [("mixed", "float32"), ("mixed", "bfloat16"), ("fp16", "bfloat16")])
def test_crosscheck_cli_passes(ckpt, capsys, name, dtype):
    rc, out, err = run_cli(capsys, "crosscheck", ckpt(name), "--tokens", "8", "--dtype", dtype, "--json")
    assert out.startswith("{"), (rc, err[-2000:])
    rep = json.loads(out)
    assert rc == 0 and rep["passed"], out
    assert rep["weights"]["checked"] == LAYERS * len(PROJ) - len(DENSE[name])
    assert not rep["weights"]["bnb_problems"]
    if dtype == "float32":
        assert rep["logits"]["rel"] < 1e-5
    else:
        assert 0 < rep["torch_lowp_rel"] and rep["logits"]["rel"] <= 2 * rep["torch_lowp_rel"]


# ------------------------------------------------------------------------------------------ skip list
def _with_skip_list(src, dst, skip):
    out = cf.copy_checkpoint(src, dst)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["llm_int8_skip_modules"] = skip
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_skip_list_that_disagrees_with_the_tensors_is_named(ckpt, tmp_path, capsys):
    """transformers builds each layer from llm_int8_skip_modules and cannot load a folder whose
    tensors disagree with it; jqlora loads the tensors as stored and warns, naming the modules."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in CHECKPOINTS:
            load_bnb_checkpoint(ckpt(name))  # consistent: no warning
    unlisted = _with_skip_list(ckpt("mixed"), tmp_path / "unlisted", None)  # default: lm_head only
    with pytest.warns(UserWarning, match=rf"does not cover 1 linear layer\(s\) stored unquantized: {DOWN1}\."):
        params, _ = load_bnb_checkpoint(unlisted)
    assert DOWN1 + ".weight" in params
    gate = "model.layers.2.mlp.gate_proj"
    listed = _with_skip_list(ckpt("mixed"), tmp_path / "listed", ["lm_head", DOWN1, gate])
    with pytest.warns(UserWarning, match=rf"covers 1 linear layer\(s\) stored quantized: {gate}\."):
        params, _ = load_bnb_checkpoint(listed)
    assert isinstance(params[gate], quant.Weight4bit)
    for folder in (unlisted, listed):  # the torch side cannot build these: one line, exit 2
        rc, out, err = run_cli(capsys, "crosscheck", folder, "--tokens", "4", "--batch", "1")
        assert rc == 2 and "the torch side cannot load this checkpoint" in err and "Traceback" not in err, err[-800:]
    bad = _with_skip_list(ckpt("mixed"), tmp_path / "bad", "lm_head")
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config.llm_int8_skip_modules is 'lm_head'"):
        load_bnb_checkpoint(bad)
    rc, out, err = run_cli(capsys, "generate", bad, "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert rc == 2 and "llm_int8_skip_modules" in err and "Traceback" not in err


NAMES = ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.11.mlp.down_proj", "model.layers.1.mlp.gate_proj",
         "model.layers.0.self_attn.o_proj", "model.layers.12.self_attn.o_proj", "model.layers.3.self_attn.q_proj"]
PATTERNS = ["lm_head", "o_proj", "model.layers.1.mlp", "model.layers.1", "mlp.gate", "model.layers.1.mlp.down_proj",
            "self_attn", "layers.*.q_proj", "model.layers.1[12]", "down_proj"]


def test_skip_matching_is_transformers_rule():
    from transformers.quantizers.quantizers_utils import should_convert_module

    from interop.bnb_common import is_skipped

    for name in NAMES:
        for p in PATTERNS:
            assert is_skipped(name, [p]) == (not should_convert_module(name, [p])), (name, p)


# ------------------------------------------------------------------------------------------ real model
def test_real_model_dynamic_nf4_matches_transformers(smollm2_dynamic):
    """SmolLM2-135M as an unsloth-style dynamic NF4 folder (tests/support/real_models.py DYNAMIC_SKIP):
    the dense layers load bit for bit, the 30 layers stack as four runs, and float32 logits on
    a sentence match transformers + bitsandbytes at this model's float32 floor."""
    from tokenizers import Tokenizer

    path = smollm2_dynamic
    model = models.load_causal_lm(path, compute_dtype=jnp.float32)
    assert [(s.start, s.size) for s in model.model.layers.stacks] == [(0, 1), (1, 14), (15, 1), (16, 14)]
    tensors = cf.torch_tensors(path)
    dense = ["model.layers.0.mlp.down_proj"] + [f"model.layers.15.self_attn.{p}_proj" for p in "qkvo"]
    for m in dense:
        assert cf.same_bits(_module(model, m).base.get_value(), cf.tensor_to_numpy(tensors[m + ".weight"])), m
    assert isinstance(_module(model, "model.layers.14.self_attn.o_proj").base.get_value(), quant.Weight4bit)
    ids = np.asarray([Tokenizer.from_file(str(path / "tokenizer.json")).encode(
        "The capital of France is Paris, and the capital of Peru is").ids])
    rel = _rel(model(jnp.asarray(ids)), _torch_logits(_torch_model(path), ids))
    print(f"\n[real dynamic] float32 logits rel {rel:.2e}")
    assert rel < 5e-5  # tests/models/test_real_model.py: the float32 floor of this model
