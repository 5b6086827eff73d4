"""`qmatmul_partials`: a product as terms that sum to it, for the decoding norm kernel that sums
them with the residual (`jqlora.ops.decode_norm`). On a Hopper GPU the pair-table kernels hand
over their K splits' float32 partials unsummed; elsewhere the product is one term."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jqlora import quant
from jqlora.lora import QLoRALinear
from jqlora.ops.qmatmul import qmatmul, qmatmul_partials
from pallas_kernels import registry

SM90 = registry.platform_available("sm90")


def _weight(n, k, nested=True, seed=0):
    w = jax.random.normal(jax.random.PRNGKey(seed), (n, k), jnp.float32) * 0.05
    return quant.quantize_4bit(w, "nf4", 64, nested)


def _sum(terms, dtype):
    return jnp.sum(terms.astype(jnp.float32), axis=0).astype(dtype)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_one_term_where_no_kernel_keeps_splits(backend):
    q = _weight(128, 256)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 256), jnp.bfloat16)
    terms = qmatmul_partials(x, q, backend=backend)
    assert terms.shape == (1, 1, 1, 128) and terms.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(terms[0], np.float32),
                                  np.asarray(qmatmul(x, q, backend=backend), np.float32))


@pytest.mark.skipif(not SM90, reason="the pair-table kernels need a Hopper GPU")
@pytest.mark.parametrize("nested", [True, False])
def test_pair_table_kernels_hand_over_their_splits(nested):
    """A 1B-shaped o_proj at one token: 2048 x 2048 runs with K splits; their sum is the product."""
    q = _weight(2048, 2048, nested)
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 1, 2048), jnp.bfloat16)
    terms = qmatmul_partials(x, q)
    assert terms.ndim == 4 and terms.shape[0] > 1 and terms.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(_sum(terms, jnp.bfloat16), np.float32),
                                  np.asarray(qmatmul(x, q), np.float32))
    from pallas_kernels.mosaic.mgpu_gemv_pair_table import mgpu_gemv_pair_table
    from jqlora.ops.products import kernel_operands_4bit

    packed, absmax = kernel_operands_4bit(q)
    x2 = x.reshape(1, 2048)
    gemv = mgpu_gemv_pair_table(x2, packed, absmax, q.code, blocksize=64, keep_splits=True)
    assert gemv.ndim == 3
    np.testing.assert_array_equal(np.asarray(_sum(gemv, jnp.bfloat16), np.float32),
                                  np.asarray(mgpu_gemv_pair_table(x2, packed, absmax, q.code, blocksize=64),
                                             np.float32))


def test_a_linear_sums_to_its_output_and_is_one_term_with_lora_or_bias():
    from flax import nnx

    q = _weight(128, 256)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 256), jnp.bfloat16)
    layers = {"plain": QLoRALinear(q),
              "lora": QLoRALinear(q, rank=4, rngs=nnx.Rngs(0)),
              "bias": QLoRALinear(q, bias=jnp.ones((128,), jnp.float32))}
    layers["lora"].lora_B[...] = jnp.full((128, 4), 0.5, jnp.float32)  # a LoRA term that changes y
    for name, layer in layers.items():
        terms = layer.partial_products(x)
        assert terms.shape[1:] == (2, 1, 128), name
        if name != "plain" or not SM90:
            assert terms.shape[0] == 1, name
        np.testing.assert_array_equal(np.asarray(_sum(terms, jnp.bfloat16), np.float32),
                                      np.asarray(layer(x), np.float32), err_msg=name)
