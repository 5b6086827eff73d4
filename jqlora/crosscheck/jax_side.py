"""The JAX side of the cross-check: jqlora's hidden states of a forward, and the model variants the
layer check runs (stored-rounded dense weights, FP8 base products, 8-bit numerics, a planted
perturbation)."""
from __future__ import annotations

import numpy as np

def jax_states(model, ids: np.ndarray) -> dict:
    """Same keys as `torch_states`, from a jqlora CausalLM (eval mode, no cache)."""
    import jax
    import jax.numpy as jnp
    from jqlora.train.frozen import frozen_jit

    def fwd(m, x):
        logits, states = m(x, return_states=True)
        return states["embed"], states["layers"], states["norm"], logits

    model.eval()  # no LoRA dropout (the caller's model stays in eval mode)
    embed, layers, normed, logits = frozen_jit(fwd)(model, jnp.asarray(ids, jnp.int32))
    n = len(model.model.layers)
    if len(layers) != n:
        raise RuntimeError(f"got {len(layers)} decoder-layer outputs, the model has {n} layers")
    to_np = lambda a: np.asarray(jax.device_get(a.astype(jnp.float32)))  # noqa: E731
    out = {"embed": to_np(embed)}
    for i, h in enumerate(layers):
        out[f"layer.{i}"] = to_np(h)
    out["norm"] = to_np(normed)
    out["logits"] = to_np(logits)
    return out


def torch_numerics_model(model, compute_dtype):
    """A copy of `model` whose 4-bit bases are dense: dequantized into each weight's stored dtype,
    then cast to `compute_dtype` (what bitsandbytes computes; `jqlora.crosscheck.layers`). Works for
    layers stored one by one and stacked (a stacked Weight4bit has a leading layer axis). The
    original model is not modified.

    Args:
      model: a jqlora CausalLM.
      compute_dtype: the dtype of the dense weights (the model's compute dtype).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QuantizedBase

    copy = nnx.clone(model)
    for _, var in nnx.to_flat_state(nnx.state(copy, QuantizedBase)):
        q = var.get_value()
        if not isinstance(q, quant.Weight4bit):
            continue

        def dense(w):
            return quant.dequantize(w, jnp.dtype(w.stored_dtype)).astype(compute_dtype)

        for _ in range(np.ndim(q.packed) - 1):  # one vmap per leading (layer) axis
            dense = jax.vmap(dense)
        var.set_value(jax.jit(dense)(q))
    return copy


def perturb_model(model, amount: float) -> None:
    """Scale layer 0's input RMSNorm weight by (1 + amount): a deliberate error, to show the
    checker localizes it (layer.0 and everything after it diverge; embed stays exact)."""
    import jax.numpy as jnp

    w = model.model.layers[0].input_layernorm.weight
    w.set_value(w.get_value() * jnp.asarray(1.0 + amount, w.get_value().dtype))


def random_tokens(vocab_size: int, tokens: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, tokens), dtype=np.int64)


def with_fp8_base_products(model):
    """A copy of `model` whose 4-bit linear layers compute their base products in FP8
    (`numerics="fp8"`, what `load_causal_lm(base_matmul="fp8")` sets). The original is not modified."""
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QLoRALinear

    copy = nnx.clone(model)
    for _, layer in nnx.iter_graph(copy):
        if isinstance(layer, QLoRALinear) and isinstance(layer.base.get_value(), quant.Weight4bit):
            layer.numerics = "fp8"
    return copy


def with_int8_numerics(model, numerics: str):
    """`model` itself when its 8-bit layers (if any) already compute with `numerics`, else a copy
    whose 8-bit layers do ("weight_only" or "llm_int8": the attribute the loader sets from
    `int8_numerics`). The original model is not modified."""
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QLoRALinear

    def int8_layers(m):
        return [n for _, n in nnx.iter_graph(m)
                if isinstance(n, QLoRALinear) and isinstance(n.base.get_value(), quant.Int8Weight)]

    if all(layer.numerics == numerics for layer in int8_layers(model)):
        return model
    copy = nnx.clone(model)
    for layer in int8_layers(copy):
        layer.numerics = numerics
    return copy
