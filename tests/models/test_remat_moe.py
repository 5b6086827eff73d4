"""`remat="auto"`'s memory model on mixture-of-experts models: a MoE layer counts its router and its
k experts per token, not the dense MLP's `intermediate_size` (which a Qwen3-MoE config also
carries, for its dense layers only). Checked against what the backward pass really keeps
(`saved_residuals`) of tiny Qwen3-MoE and Mixtral models, next to a dense Llama's prediction."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import lora, models
from jqlora.models.config import ModelConfig
from jqlora.models.remat import KEPT_MEASURED_OVER_COUNTED, activation_bytes_per_token, remat_plan

try:  # public in newer jax; jax.ad_checkpoint.print_saved_residuals prints the same list
    from jax.ad_checkpoint import saved_residuals
except ImportError:
    from jax._src.ad_checkpoint import saved_residuals

_BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
             max_position_embeddings=64, num_hidden_layers=2)
DENSE = dict(model_type="llama", intermediate_size=128, **_BASE)
# intermediate_size far from the experts' width: a count of the dense MLP would be far off
QWEN3_MOE = dict(model_type="qwen3_moe", intermediate_size=1024, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[], **_BASE)
MIXTRAL = dict(model_type="mixtral", intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **_BASE)
T = 16


def _params(cfg: dict) -> dict:
    """Random HF-keyed params; a sparse layer's MLP replaced by a router and fused expert stacks."""
    c = ModelConfig.from_hf(cfg)
    p = models.init_params(cfg, seed=0, std=0.1)
    rng = np.random.default_rng(1)
    for i, sparse in enumerate(c.sparse_layers):
        if not sparse:
            continue
        pre = f"model.layers.{i}.mlp"
        for n in ("gate_proj", "up_proj", "down_proj"):
            del p[f"{pre}.{n}.weight"]
        e, h, m = c.num_experts, c.hidden_size, c.moe_intermediate_size
        p[f"{pre}.gate.weight"] = jnp.asarray(rng.normal(0, 0.5, (e, h)), jnp.float32)
        p[f"{pre}.experts.gate_up_proj"] = jnp.asarray(rng.normal(0, 0.1, (e, 2 * m, h)), jnp.float32)
        p[f"{pre}.experts.down_proj"] = jnp.asarray(rng.normal(0, 0.1, (e, h, m)), jnp.float32)
    return p


def _kept_per_token(cfg: dict, policy) -> float:
    """Bytes the backward keeps per token (growth from 2 to 4 rows of T tokens), NF4 weights and
    experts, LoRA r=4 on attention and experts, float32."""
    m = models.from_params(_params(cfg), cfg, quantize="nf4", compute_dtype=jnp.float32, remat=policy or False,
                           lora=lora.LoraConfig(rank=4, target_modules="all-linear"), rngs=nnx.Rngs(0))
    graphdef, state, rest = nnx.split(m, nnx.LoRAParam, ...)

    def nbytes(rows):
        ids = jnp.zeros((rows, T), jnp.int32)
        f = lambda s: jnp.sum(nnx.merge(graphdef, s, rest)(ids, return_hidden=True))  # noqa: E731
        return sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(f, state))

    return (nbytes(4) - nbytes(2)) / (2 * T)


def _counted(cfg: dict, policy) -> float:
    a = activation_bytes_per_token(ModelConfig.from_hf(cfg), policy, compute_dtype=jnp.float32,
                                   attention="einsum", seq_len=T, lora_rank=4)
    return a["kept"] / KEPT_MEASURED_OVER_COUNTED


@pytest.mark.parametrize("policy", [None, "dots_with_no_batch_dims_saveable"])
def test_moe_layers_are_counted_as_experts_not_the_dense_mlp(policy):
    dense = _counted(DENSE, policy) / _kept_per_token(DENSE, policy)
    for cfg in (QWEN3_MOE, MIXTRAL):
        ratio = _counted(cfg, policy) / _kept_per_token(cfg, policy)
        # the same share of what the backward keeps as for a dense model (CPU pads the grouped
        # product's row tiles: a little less without remat)
        assert 0.75 < ratio / dense < 1.25, (cfg["model_type"], policy, ratio, dense)


def test_moe_count_follows_the_experts():
    c = ModelConfig.from_hf(QWEN3_MOE)
    kept = lambda c: activation_bytes_per_token(c, None, seq_len=2048)["kept"]  # noqa: E731
    assert kept(dataclasses.replace(c, intermediate_size=64)) == kept(c)  # no dense layer: its width is unused
    more = dataclasses.replace(c, num_experts_per_tok=8)
    assert kept(more) > kept(c)
    # a mixed model counts each layer as what it is
    mixed = ModelConfig.from_hf({**QWEN3_MOE, "mlp_only_layers": [1]})
    assert kept(c) != kept(mixed)
    assert kept(dataclasses.replace(mixed, intermediate_size=2048)) > kept(mixed)
    # the Qwen3-30B-A3B step shape plans without error, the weights counted with the experts in NF4
    big = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
               num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
               num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=4096)
    plan = remat_plan(big, 1, 2048, device_bytes=141 * 2 ** 30)
    gib = plan.predicted["none"] / 2 ** 30
    assert 15 < gib < 60, gib  # about 15.5 GB of NF4 weights, plus activations
