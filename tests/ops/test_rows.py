"""`jqlora.ops.rows.take_rows`: the row moves of the MoE layers, whose gradient is a gather by the
inverse map. Against `x[index]` differentiated by autodiff (the scatter-add it replaces) in float64,
on random one-to-one maps with rows that go nowhere and output rows of zeros."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jqlora.ops.rows import inverse_permutation, take_rows


def _one_to_one(rng, m: int, p: int):
    """A random one-to-one map of M source rows into P output rows (some of each left out)."""
    index = np.full(p, m, np.int32)                  # m: a zero row
    inverse = np.full(m, p, np.int32)                # p: the row went nowhere
    taken = rng.permutation(m)[: rng.integers(0, min(m, p) + 1)]
    slots = rng.permutation(p)[: taken.size]
    index[slots], inverse[taken] = taken, slots
    return index, inverse


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.integers(0, 2), st.integers(0, 2**16))
def test_take_rows_matches_the_gather_and_its_autodiff(m, p, extra_dims, seed):
    rng = np.random.default_rng(seed)
    index, inverse = _one_to_one(rng, m, p)
    shape = (m,) + (3,) * extra_dims
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal(shape))
        dy = jnp.asarray(rng.standard_normal((p,) + shape[1:]))
        reference = lambda x_: jnp.concatenate([x_, jnp.zeros((1,) + shape[1:], x_.dtype)])[index]  # noqa: E731
        got, pull = jax.vjp(lambda x_: take_rows(x_, jnp.asarray(index), jnp.asarray(inverse)), x)
        want, pull_want = jax.vjp(reference, x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(pull(dy)[0]), np.asarray(pull_want(dy)[0]))


def test_take_rows_jits_and_keeps_the_dtype():
    x = jnp.arange(12, dtype=jnp.bfloat16).reshape(4, 3)
    order = jnp.asarray([2, 0, 3, 1], jnp.int32)
    y, grad = jax.jit(lambda x_: jax.vjp(lambda z: take_rows(z, order, inverse_permutation(order)), x_))(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32)[[2, 0, 3, 1]])
    np.testing.assert_array_equal(np.asarray(grad(y)[0], np.float32), np.asarray(x, np.float32))


@pytest.mark.parametrize("n", [1, 7, 64])
def test_inverse_permutation(n):
    order = jnp.asarray(np.random.default_rng(n).permutation(n), jnp.int32)
    inverse = inverse_permutation(order)
    np.testing.assert_array_equal(np.asarray(inverse)[np.asarray(order)], np.arange(n))
