"""`jqlora.lora.fuse`: layers that read one input, run as one layer, give the layers' outputs
concatenated: with LoRA on some layers only, different ranks and scales, biases on some layers,
every base format. What cannot be fused is refused with its reason."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import quant
from jqlora.lora import QLoRALinear
from jqlora.lora.fuse import fuse_linears, fusion_problem

IN = 128


def _layer(seed, out, base_format="nf4", rank=0, alpha=None, bias=False, **kw):
    w = jax.random.normal(jax.random.key(seed), (out, IN), jnp.float32) * 0.05
    base = {"nf4": lambda: quant.quantize_4bit(w, "nf4", 64, True),
            "fp4": lambda: quant.quantize_4bit(w, "fp4", 64, False),
            "int8": lambda: quant.quantize_int8(w),
            "dense": lambda: w}[base_format]()
    b = jax.random.normal(jax.random.key(seed + 100), (out,)) if bias else None
    layer = QLoRALinear(base, rank=rank, alpha=alpha, bias=b, rngs=nnx.Rngs(seed), compute_dtype=jnp.float32, **kw)
    if rank:
        layer.set_lora(layer.lora_A[...], jax.random.normal(jax.random.key(seed + 7), (out, rank)) * 0.1)
    return layer


def _x():
    return jax.random.normal(jax.random.key(99), (3, 5, IN), jnp.float32)


def _assert_fused_equals_apart(layers, rtol=2e-6, atol=2e-6):
    fused = fuse_linears(layers)
    x = _x()
    want = np.concatenate([np.asarray(m(x)) for m in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(fused(x)), want, rtol=rtol, atol=atol)
    return fused


@pytest.mark.parametrize("base_format", ["nf4", "fp4", "int8", "dense"])
def test_fused_layer_gives_the_layers_outputs_in_order(base_format):
    layers = [_layer(0, 64, base_format, rank=4, alpha=8), _layer(1, 16, base_format, rank=4, alpha=8),
              _layer(2, 16, base_format, rank=4, alpha=8)]
    fused = _assert_fused_equals_apart(layers)
    assert fused.rank == 12 and fused.scale == layers[0].scale  # one scale: B matrices unscaled
    assert fused.out_features == 96


def test_lora_on_some_layers_with_different_ranks_and_scales():
    layers = [_layer(0, 64, rank=8, alpha=16), _layer(1, 16), _layer(2, 16, rank=2, alpha=7, use_rslora=True)]
    fused = _assert_fused_equals_apart(layers)
    assert fused.rank == 10 and fused.scale == 1.0  # the scales differ: each B carries its own
    b = np.asarray(fused.lora_B[...])
    # each layer's output rows read only its own rank columns
    assert not b[64:80].any() and not b[:64, 8:].any() and not b[80:, :8].any()


def test_biases_on_some_layers():
    _assert_fused_equals_apart([_layer(0, 64, rank=4, bias=True), _layer(1, 16, rank=4), _layer(2, 16, rank=4, bias=True)])


def test_no_lora_anywhere():
    fused = _assert_fused_equals_apart([_layer(0, 64), _layer(1, 64)])
    assert fused.rank == 0


def test_fused_in_bf16_matches_the_layers_within_rounding():
    layers = [_layer(i, n, rank=4, alpha=8) for i, n in enumerate((64, 16, 16))]
    for m in layers:
        m.compute_dtype = jnp.dtype(jnp.bfloat16)
    fused = fuse_linears(layers)
    x = _x().astype(jnp.bfloat16)
    want = np.concatenate([np.asarray(m(x), np.float32) for m in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(fused(x), np.float32), want, rtol=2e-2, atol=2e-2)


def test_lora_arrays_keep_the_dtype_they_hold():
    """Rollouts cast the LoRA state to the compute dtype once, before their decode loop: the fused
    branch must not turn it back into float32 (a cast per layer and token)."""
    layers = [_layer(i, n, rank=4, alpha=8) for i, n in enumerate((64, 16))]
    for m in layers:
        m.lora_A.set_value(m.lora_A[...].astype(jnp.bfloat16))
        m.lora_B.set_value(m.lora_B[...].astype(jnp.bfloat16))
    fused = fuse_linears(layers)
    assert fused.lora_A[...].dtype == jnp.bfloat16 and fused.lora_B[...].dtype == jnp.bfloat16
    x = _x()
    want = np.concatenate([np.asarray(m(x)) for m in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(fused(x)), want, rtol=1e-6, atol=1e-6)


def test_what_cannot_be_fused_is_refused_with_its_reason():
    assert "mixed formats" in fusion_problem([_layer(0, 64, "nf4"), _layer(1, 64, "int8")])
    assert "different settings" in fusion_problem([_layer(0, 64), _layer(1, 64, backend="xla")])
    dropout = [_layer(0, 64, rank=4, dropout=0.1), _layer(1, 64, rank=4)]
    assert "dropout is active" in fusion_problem(dropout)
    for m in dropout:
        m.eval()
    assert fusion_problem(dropout) is None  # inference: dropout off
    with pytest.raises(ValueError, match="fewer than two"):
        fuse_linears([_layer(0, 64)])
