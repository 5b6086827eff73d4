"""The cached-decoding attention kernel (`registry.attention_variants()`: decode_attention) against
its float32 reference on random shapes (GQA groups, ragged slot blocks, splits, segments, a
sliding window, soft-capping), in Pallas interpret mode on CPU (compiled on a GPU); the reference
against the model's einsum path; the Triton lowering; errors; which path a decoding step takes.
Generation through the kernel: tests/models/test_decode_layers.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora.models.attention import einsum_attention
from jqlora.ops import cached_attention
from pallas_kernels import registry
from pallas_kernels.reference.attention import decode_attention_reference
from pallas_kernels.triton.decode_attention import decode_attention

INTERPRET = jax.default_backend() != "gpu"


def _operands(layers, b, s, kvh, groups, d, index, dtype, seed=0, holes=True):
    """q (B, h, d), caches (L, B, S, kvh, d), q_seg (B,), k_seg (B, S): slots past index unwritten
    (segment 0); with holes, row 1 left-padded (its first slots segment 0) and row 2 a second
    segment after slot index // 2 (its query is in the second)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, kvh * groups, d)), dtype)
    k = jnp.asarray(rng.normal(size=(layers, b, s, kvh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(layers, b, s, kvh, d)), dtype)
    k_seg = np.ones((b, s), np.int32)
    k_seg[:, index + 1:] = 0
    q_seg = np.ones((b,), np.int32)
    if holes and b > 1:
        k_seg[1, :min(3, index)] = 0
    if holes and b > 2:
        k_seg[2, index // 2 + 1:index + 1] = 2
        q_seg[2] = 2
    return q, k, v, jnp.asarray(q_seg), jnp.asarray(k_seg)


@settings(max_examples=10)
@given(layers=st.integers(1, 3), b=st.integers(1, 3), s=st.integers(1, 150), kvh=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 3, 4]), d=st.sampled_from([8, 16, 32]), at=st.floats(0, 1),
       block_s=st.sampled_from([8, 16, 32]), split_at=st.floats(0, 1), cap=st.sampled_from([None, 5.0]),
       window=st.sampled_from([None, 7]), data=st.data())
def test_kernel_matches_its_reference_on_random_shapes(layers, b, s, kvh, groups, d, at, block_s, split_at, cap,
                                                       window, data):
    index = min(s - 1, int(at * s))
    layer = data.draw(st.integers(0, layers - 1))
    q, k, v, q_seg, k_seg = _operands(layers, b, s, kvh, groups, d, index, jnp.float32, seed=s + d)
    bs = min(block_s, 1 << (s.bit_length() - 1))
    n_blocks = -(-s // bs)
    splits = 1 + int(split_at * (n_blocks - 1))
    got = decode_attention(q, k, v, layer, index, q_seg, k_seg, scale=0.3, cap=cap, window=window,
                           interpret=INTERPRET, block_s=block_s, splits=splits)
    want = decode_attention_reference(q, k, v, layer, index, q_seg, k_seg, scale=0.3, cap=cap, window=window)
    assert got.shape == want.shape == (b, kvh * groups, d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                               err_msg=f"S={s} index={index} block_s={block_s} splits={splits}")


@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_operands_at_a_decoding_shape(splits):
    """bf16 q and cache at a 1B model's head layout (32 heads over 8 kv heads, d = 64); the output
    is rounded once to bf16."""
    q, k, v, q_seg, k_seg = _operands(2, 1, 272, 8, 4, 64, 200, jnp.bfloat16, holes=False)
    got = decode_attention(q, k, v, 1, 200, q_seg, k_seg, scale=0.125, interpret=INTERPRET, splits=splits)
    want = decode_attention_reference(q, k, v, 1, 200, q_seg, k_seg, scale=0.125)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


def test_reference_is_the_einsum_path_in_float32():
    """In float32 the oracle computes what the model's einsum path computes for one query at slot
    index (its mask, its softmax): the kernel's numerics differ from the model's only by the
    probabilities' rounding to a 16-bit dtype."""
    layers, b, s, kvh, groups, d, index = 2, 3, 40, 2, 2, 16, 29
    q, k, v, q_seg, k_seg = _operands(layers, b, s, kvh, groups, d, index, jnp.float32)
    for cap, window in ((None, None), (3.0, 9)):
        want = einsum_attention(q[:, None].reshape(b, 1, kvh * groups, d), k[1], v[1],
                                jnp.full((b, 1), index, jnp.int32), jnp.broadcast_to(jnp.arange(s), (b, s)),
                                q_seg[:, None], k_seg, scale=0.3, cap=cap, window=window, dtype=jnp.float32)
        got = decode_attention_reference(q, k, v, 1, index, q_seg, k_seg, scale=0.3, cap=cap, window=window)
        np.testing.assert_allclose(np.asarray(got).reshape(b, 1, -1), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_no_key_gives_zeros():
    q, k, v, q_seg, k_seg = _operands(1, 2, 20, 1, 2, 8, 10, jnp.float32, holes=False)
    k_seg = k_seg.at[1].set(0)
    for splits in (1, 2):
        got = decode_attention(q, k, v, 0, 10, q_seg, k_seg, scale=1.0, interpret=INTERPRET, block_s=8,
                               splits=splits)
        assert np.all(np.asarray(got[1]) == 0) and np.all(np.isfinite(np.asarray(got)))


def test_errors_name_the_operand():
    q, k, v, q_seg, k_seg = _operands(1, 1, 16, 1, 2, 8, 3, jnp.float32)
    with pytest.raises(ValueError, match="`q`"):
        decode_attention(q[:, :, :4], k, v, 0, 3, q_seg, k_seg, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="k_seg"):
        decode_attention(q, k, v, 0, 3, q_seg, k_seg[:, :8], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="splits=3"):
        decode_attention(q, k, v, 0, 3, q_seg, k_seg, scale=1.0, interpret=True, block_s=8, splits=3)
    q96 = jnp.zeros((1, 2, 12)), jnp.zeros((1, 1, 16, 1, 12))
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q96[0], q96[1], q96[1], 0, 3, q_seg, k_seg, scale=1.0, interpret=True)


def test_registered_and_lowers_for_triton(lower_for_triton):
    (v,) = registry.attention_variants()
    assert registry.get("decode_attention") is v and v.status == "default" and v.numerics == "online_softmax"
    assert registry.module_of("decode_attention") == "pallas_kernels.triton.decode_attention"
    sd = jax.ShapeDtypeStruct
    for (layers, b, s, kvh, h, d, cap, window) in ((32, 1, 272, 8, 32, 128, None, None),
                                                   (16, 1, 4096, 8, 32, 64, None, None),
                                                   (4, 2, 100, 1, 4, 256, 50.0, 64)):
        cache = sd((layers, b, s, kvh, d), jnp.bfloat16)
        fn = lambda *a, cap=cap, window=window: decode_attention(*a, scale=0.1, cap=cap, window=window)  # noqa: E731
        lower_for_triton(f"decode_attention S={s} d={d}", fn, sd((b, h, d), jnp.bfloat16), cache, cache,
                         sd((), jnp.int32), sd((), jnp.int32), sd((b,), jnp.int32), sd((b, s), jnp.int32))


def test_which_path_runs():
    assert cached_attention.kernel_problem("xla", (1, 1, 4, 64), (2, 1, 16, 2, 64)) is not None
    assert cached_attention.kernel_problem("interpret", (1, 1, 4, 64), (2, 1, 16, 2, 64)) is None
    assert "new tokens" in cached_attention.kernel_problem("interpret", (1, 5, 4, 64), (2, 1, 16, 2, 64))
    assert "head_dim 96" in cached_attention.kernel_problem("pallas", (1, 1, 4, 96), (2, 1, 16, 2, 96))
    if jax.default_backend() != "gpu":
        assert cached_attention.kernel_problem("auto", (1, 1, 4, 64), (2, 1, 16, 2, 64)) == "not on a GPU"
    with pytest.raises(ValueError, match="unknown backend"):
        cached_attention.kernel_problem("triton", (1, 1, 4, 64), (2, 1, 16, 2, 64))
    assert cached_attention.decode_path("interpret", 2, 8, 64)[0] == "kernel"
    path, why = cached_attention.decode_path("pallas", 1, 32, 96)
    assert path == "einsum" and "head_dim 96" in why


def test_default_blocks_keep_the_measured_tile_size():
    """64 slots a block (measured at head_dim 64 and 128), 32 at head_dim 256 (the same number of
    values), never more slots than the cache's largest power of two."""
    from pallas_kernels.triton.decode_attention import block_slots

    assert [block_slots(272, d) for d in (64, 128, 256)] == [64, 64, 32]
    assert block_slots(40, 64) == 32 and block_slots(1, 64) == 1 and block_slots(272, 256, block_s=16) == 16
    with pytest.raises(ValueError, match="power of two"):
        block_slots(272, 64, block_s=48)
