"""A frozen dense (unquantized) base weight is read by the backward of a scan over layers from the
weights the step was given, not saved again per layer: without recompute (what `remat auto` picks
where memory allows) a new value made of the weight in the layer would be stacked by the scan as a
residual, a second copy of every dense weight (13 GiB for the Llama-3-8B shape)."""
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jqlora.lora import LoraConfig
from jqlora.models import from_params
from jqlora.train.optim import make_optimizer
from jqlora.train.step import train_step

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_theta=10000.0, max_position_embeddings=128, hidden_act="silu", attention_bias=False, mlp_bias=False)
SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
          "self_attn.o_proj": (64, 64), "mlp.gate_proj": (160, 64), "mlp.up_proj": (160, 64), "mlp.down_proj": (64, 160)}


def _dense_params(dtype):
    keys = iter(jax.random.split(jax.random.key(0), 64))
    p = {"model.embed_tokens.weight": jax.random.normal(next(keys), (96, 64), dtype) * 0.02,
         "lm_head.weight": jax.random.normal(next(keys), (96, 64), dtype) * 0.02,
         "model.norm.weight": jnp.ones((64,), dtype)}
    for layer in range(CONFIG["num_hidden_layers"]):
        for name, shape in SHAPES.items():
            p[f"model.layers.{layer}.{name}.weight"] = jax.random.normal(next(keys), shape, dtype) * 0.02
        for name in ("input_layernorm", "post_attention_layernorm"):
            p[f"model.layers.{layer}.{name}.weight"] = jnp.ones((64,), dtype)
    return p


@pytest.mark.parametrize("remat,weights", [(False, "bfloat16"), (True, "bfloat16"), (False, "float32")])
def test_the_step_stacks_no_copy_of_the_dense_weights(remat, weights):
    """float32 weights under bf16 compute: the cast happens inside the product, so what the backward
    keeps is still the weight the step was given."""
    model = from_params(_dense_params(jnp.dtype(weights)), CONFIG, compute_dtype=jnp.bfloat16, remat=remat,
                        lora=LoraConfig(rank=4, alpha=8, target_modules="all-linear"))
    opt = nnx.Optimizer(model, make_optimizer(1e-3, 1, 10), wrt=nnx.LoRAParam)
    seq = 16
    batch = {"input_ids": jnp.zeros((1, 1, seq), jnp.int32), "targets": jnp.ones((1, 1, seq), jnp.int32),
             "loss_mask": jnp.ones((1, 1, seq), jnp.float32),
             "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, 1, seq))}
    text = train_step.bind(model, opt).lower(batch).as_text()
    layers = CONFIG["num_hidden_layers"]
    stacked = [m.group(0) for m in re.finditer(r"tensor<(\d+)x(\d+)x(\d+)x(?:bf16|f32)>", text)
               if int(m.group(1)) == layers and (int(m.group(2)), int(m.group(3))) in SHAPES.values()]
    # the stacked weights themselves are the step's inputs; a residual copy is written slice by slice
    writes = [line for line in text.splitlines() if "dynamic_update_slice" in line
              and any(s in line for s in set(stacked))]
    assert stacked, "the weights are not stacked over the layers: the test would see nothing"
    assert writes == [], f"{len(writes)} per-layer writes into weight-shaped stacks (a residual copy)"
