"""jqlora.crosscheck on small checkpoints: the weight stage (independent decode, bitsandbytes'
CPU 2-D dequantization problem named as such), the float32 reference really in float32 for
bf16-stored checkpoints, the low-precision verdict relative to torch's own error."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

import bitsandbytes.functional as F  # noqa: E402

import checkpoint_factory as cf  # noqa: E402
from jqlora.crosscheck import crosscheck  # noqa: E402
from jqlora.crosscheck.weights import decode_4bit  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("shape, quant_type, nested", [((96, 96), "nf4", True), ((64, 144), "nf4", False),
                                                      ((32, 64), "fp4", True), ((7, 10), "nf4", False)])
def test_independent_decode_equals_bitsandbytes_torch_path(shape, quant_type, nested):
    """decode_4bit (numpy, float64) against bitsandbytes' pure-torch dequantization, rounded alike."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    p = bnb.nn.Params4bit(w, requires_grad=False, quant_type=quant_type, compress_statistics=nested)
    with torch.compiler.set_stance("force_eager"):
        p = p.to("cpu")
    ref = cf.tensor_to_numpy(cf.bnb_dequantize_4bit_reference(p.data, p.quant_state).float())
    ours = decode_4bit(p.data, p.quant_state)
    assert ours.dtype == np.float64 and ours.shape == shape
    # one float32 rounding (the product), then bf16: what bitsandbytes returns
    import ml_dtypes

    np.testing.assert_array_equal(ours.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32), ref)


@pytest.fixture(scope="module")
def wide96(tmp_path_factory):
    """NF4 checkpoint whose down_proj is 64 x 96 (in_features 96: blocks of 64 span rows)."""
    return cf.build_llama_checkpoint(tmp_path_factory.mktemp("w96"), quant="nf4", dtype=torch.bfloat16,
                                     config_overrides=dict(intermediate_size=96))


def test_bitsandbytes_2d_dequant_problem_is_reported_as_such(wide96):
    tensors = cf.torch_tensors(wide96)
    name = "model.layers.0.mlp.down_proj"
    stats = {k[len(name) + 8:]: v for k, v in tensors.items() if k.startswith(name + ".weight.")}
    qs = F.QuantState.from_dict(stats, device=torch.device("cpu"))
    good = cf.bnb_dequantize_4bit_reference(tensors[name + ".weight"], qs)
    if torch.equal(F.dequantize_4bit(tensors[name + ".weight"], qs), good):
        pytest.skip("this bitsandbytes dequantizes (64, 96) NF4 correctly on CPU")
    res = crosscheck(wide96, tokens=8)
    bad = {w.name: w for w in res.bnb_problems}
    assert set(bad) == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert bad[name].shape == (64, 96) and bad[name].bnb_rel > 10 * bad[name].bnb_rtol
    assert not res.jqlora_weight_problems and all(w.jqlora_rel < 1e-6 for w in res.weights)
    text = res.format()
    assert f"bitsandbytes problem: {name} (64, 96) nf4" in text and "Not a jqlora failure" in text
    assert "jqlora problem" not in text
    # with the torch reference corrected, jqlora agrees with it: a pass, not a false FAIL
    assert res.passed and res.logits.rel < 1e-5, text
    # jqlora's own weight, in the stored dtype, is bit for bit bitsandbytes' correct (pure-torch) decode
    import jax.numpy as jnp

    from jqlora import models, quant

    m = models.load_causal_lm(wide96, compute_dtype=jnp.float32)
    q = m.model.layers[0].mlp.down_proj.base.get_value()
    assert np.array_equal(np.asarray(quant.dequantize(q, jnp.bfloat16)).astype(np.float32),
                          cf.tensor_to_numpy(good.float()))


def test_weight_stage_blames_a_wrong_jqlora_weight(tmp_path_factory):
    import dataclasses

    import jax.numpy as jnp

    from jqlora import models

    ckpt = cf.build_llama_checkpoint(tmp_path_factory.mktemp("blame"), quant="nf4", dtype=torch.bfloat16)
    m = models.load_causal_lm(ckpt, compute_dtype=jnp.float32)
    layer = m.model.layers[1].self_attn.o_proj
    w = layer.base.get_value()
    layer.base.set_value(dataclasses.replace(w, offset=w.offset * 1.01))
    res = crosscheck(ckpt, jax_model=m, tokens=8)
    assert [x.name for x in res.jqlora_weight_problems] == ["model.layers.1.self_attn.o_proj"]
    assert not res.bnb_problems and not res.passed
    assert "jqlora problem: model.layers.1.self_attn.o_proj (64, 64) nf4" in res.format()


@pytest.fixture(scope="module")
def bf16_nf4(tmp_path_factory):
    """An NF4 checkpoint quantized from bf16 weights (quant_state dtype bf16, norms stored in bf16)."""
    return cf.build_llama_checkpoint(tmp_path_factory.mktemp("bf16nf4"), quant="nf4", dtype=torch.bfloat16)


def test_float32_crosscheck_of_a_bf16_stored_checkpoint(bf16_nf4, capsys):
    """The float32 reference computes in float32 although transformers keeps the checkpoint's bf16
    for the tensors it did not quantize; jqlora's own numerics match it to float32 rounding."""
    from jqlora.cli import main

    capsys.readouterr()
    rc = main(["crosscheck", str(bf16_nf4), "--tokens", "8", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["passed"] and rep["verdict_numerics"] == "own"
    assert rep["logits"]["rel"] < 1e-5 and rep["weights"]["checked"] == 14
    own, stored = rep["runs"]["own"], rep["runs"]["stored"]
    assert own[-1]["name"] == stored[-1]["name"] == "logits"


def test_bf16_verdict_is_relative_to_torch_own_error(bf16_nf4, capsys):
    from jqlora.cli import main

    capsys.readouterr()
    rc = main(["crosscheck", str(bf16_nf4), "--tokens", "8", "--dtype", "bfloat16", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["passed"] and rep["torch_lowp_rel"] > 0
    assert rep["logits"]["rel"] <= 2 * rep["torch_lowp_rel"]
    assert "x torch's own bfloat16 error" in rep["rule"]
    # the rule decides: a ratio below jqlora's error / torch's fails the same numbers
    ratio = 0.5 * rep["logits"]["rel"] / rep["torch_lowp_rel"]
    rc = main(["crosscheck", str(bf16_nf4), "--tokens", "8", "--dtype", "bfloat16", "--bf16-ratio", str(ratio)])
    assert rc == 2 and "FAIL" in capsys.readouterr().out


# ------------------------------------------------------------------------------ LLM.int8 products
def test_product_comparison_allows_one_ulp_and_float32_summation_order():
    import ml_dtypes

    from jqlora.crosscheck.products import compare_product

    ref = np.array([1.0, -3.0, 0.5, 200.0], ml_dtypes.bfloat16)
    bits = ref.view(np.uint16)
    one_ulp = (bits + np.uint16(1)).view(ml_dtypes.bfloat16)  # one ulp away from zero, each element
    two_ulp = (bits + np.array([0, 0, 2, 0], np.uint16)).view(ml_dtypes.bfloat16)
    assert compare_product("p", one_ulp, ref, ref.dtype).ok
    c = compare_product("p", two_ulp, ref, ref.dtype)
    assert not c.ok and c.beyond == 1 and c.shape == (4,)
    # float32: a small output may be off by 1e-5 of the largest (outlier product's summation order)
    ref32 = np.array([1000.0, 1e-3], np.float32)
    assert compare_product("p", ref32 + np.float32([0, 5e-3]), ref32, ref32.dtype).ok
    assert not compare_product("p", ref32 + np.float32([0, 2e-2]), ref32, ref32.dtype).ok


@pytest.fixture(scope="module")
def int8_ckpt(tmp_path_factory):
    return cf.build_llama_checkpoint(tmp_path_factory.mktemp("int8"), quant="int8")


def _plant_int8_scale(monkeypatch, scale):
    """Make every int8 scale of jqlora's LLM.int8 product `scale` x too large (the weights stay right)."""
    from pallas_kernels.reference import int8 as int8_reference

    right = int8_reference.llm_int8_matmul_reference
    monkeypatch.setattr(int8_reference, "llm_int8_matmul_reference",
                        lambda x, cb, scb, **kw: right(x, cb, scb * scale, **kw))


def test_llm_int8_bf16_products_agree_and_a_wrong_int8_scale_fails(int8_ckpt, monkeypatch):
    """jqlora's LLM.int8 products equal bitsandbytes' on the inputs torch's bf16 run gave them;
    int8 scales 1% too large fail the check, naming the products (end to end, bf16 LLM.int8
    cannot see 1%: see jqlora.crosscheck.products)."""
    res = crosscheck(int8_ckpt, tokens=8, dtype="bfloat16")
    assert res.passed, res.format()
    assert len(res.products) == 14 and not res.product_problems
    assert set(res.runs) == {"torch_lowp", "llm_int8", "own"} and res.verdict_numerics == "llm_int8"
    assert res.reference == res.references["torch_lowp"] == "torch float32 LLM.int8"
    assert "x torch's own bfloat16 LLM.int8 error" in res.rule

    _plant_int8_scale(monkeypatch, 1.01)
    bad = crosscheck(int8_ckpt, tokens=8, dtype="bfloat16")
    assert not bad.passed and len(bad.product_problems) == 14
    assert not bad.jqlora_weight_problems  # the weights are right: the product is wrong
    assert "jqlora problem: model.layers.0.self_attn.q_proj product (2, 8, 64): " in bad.format()
    assert "LLM.int8 products: 14 of 14 differ from bitsandbytes" in bad.rule


def test_llm_int8_float32_products_catch_a_tenth_of_a_percent(int8_ckpt, monkeypatch):
    """float32: the products come from the float32 reference run and resolve 1e-3 (the verdict's
    logits are the weight-only run's, which the planted error does not touch)."""
    _plant_int8_scale(monkeypatch, 1.001)
    bad = crosscheck(int8_ckpt, tokens=8)
    assert bad.verdict_numerics == "own" and bad.logits.rel < 1e-5
    assert not bad.passed and len(bad.product_problems) == 14
