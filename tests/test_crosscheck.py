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
from jqlora.crosscheck_weights import decode_4bit  # noqa: E402

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
