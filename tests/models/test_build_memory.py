"""Building a model from device arrays it may consume (`from_params(donate_params=True)`, what
`load_causal_lm` does with weights quantized at load) never holds a weight kind twice on the device:
a kind whose arrays all reach their last use is stacked on the host and moved back once."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoint_factory import tiny_llama_config
from jqlora.lora import stacked
from jqlora.models.build import from_params, init_params


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_stacking_donated_device_arrays_needs_no_second_copy(monkeypatch):
    config = tiny_llama_config(num_hidden_layers=4, hidden_size=128, intermediate_size=512).to_dict()
    host = init_params(config, seed=3)
    reference = from_params(dict(host), config, compute_dtype=jnp.float32)  # host arrays, nothing donated
    ids = jnp.asarray(np.arange(12, dtype=np.int32).reshape(1, 12) % config["vocab_size"])
    want = np.asarray(reference(ids))
    del reference

    params = {k: jnp.asarray(v) for k, v in host.items()}  # on the device, the builder's to consume
    layer_parts = [a for k, a in params.items() if k.startswith("model.layers.")]
    largest_kind = max(a.nbytes for a in layer_parts) * config["num_hidden_layers"]
    before = _live_bytes()
    seen = []
    for name in ("_stack", "_stack_through_host"):  # the device's bytes after each weight kind is stacked
        original = getattr(stacked, name)
        monkeypatch.setattr(stacked, name, lambda parts, f=original: (out := f(parts), seen.append(_live_bytes()))[0])
    model = from_params(params, config, compute_dtype=jnp.float32, donate_params=True)

    assert seen and max(seen) <= before, (
        f"stacking held {max(seen) - before} bytes beyond the params' {before} (the largest weight kind is "
        f"{largest_kind}): a kind was stacked on the device beside its parts")
    assert all(a.is_deleted() for a in layer_parts)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(nnx.state(model)))  # moved back to the device
    np.testing.assert_array_equal(np.asarray(model(ids)), want)
