"""`take_rows`: a row gather whose gradient is a gather too.

Mixture-of-experts layers move rows between orders: tokens into expert order and back, rows into
tiles of one expert each. Written as `x[index]`, each move differentiates into a scatter-add, which
a GPU runs with atomic adds; in a Qwen3-30B-A3B-shaped training step those scatter-adds took about
a seventh of the step's device time. These moves are one-to-one (a source row lands at most once),
so the transpose of the gather is the gather by the inverse map, with no atomics and no summation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _with_zero_row(x: jax.Array) -> jax.Array:
    return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows `index` of `x` (leading axis), where `index == len(x)` reads a row of zeros.

    Args:
      x: (M, ...) rows.
      index: (P,) int32 in [0, M]: the source row of each output row, M for a zero row.
      inverse: (M,) int32 in [0, P]: the output row each source row went to, P where it went
        nowhere. The map must be one-to-one: no source row taken twice (the gradient would keep
        one of its cotangents, not their sum); `index` and `inverse` must agree.

    Returns:
      (P, ...) with x's dtype. The gradient with respect to x is the cotangent's rows `inverse`
      (zeros where a row went nowhere); the integer maps get none.
    """
    return _with_zero_row(x)[index]


def _fwd(x, index, inverse):
    return take_rows(x, index, inverse), inverse


def _bwd(inverse, g):
    return _with_zero_row(g)[inverse], None, None


take_rows.defvjp(_fwd, _bwd)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """The inverse of a permutation of [0, n): `inverse[order[i]] == i`."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                 unique_indices=True)
