"""The per-expert LoRA product of tokens sorted by expert (`jqlora.lora.experts.grouped_lora`)
against a float64 loop over the groups, forward and both factors' gradients, on ragged groups:
empty experts, one expert taking every row, sizes off the tile, rows past the groups' sum."""
import numpy as np
import jax
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

from jqlora.lora.experts import grouped_lora


def reference(xs, sizes, a, b):
    out = np.zeros((xs.shape[0], b.shape[1]))
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = xs[start:start + n] @ a[e].T @ b[e].T
        start += n
    return out


@st.composite
def cases(draw):
    e = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 40), min_size=e, max_size=e))
    if draw(st.booleans()) and e > 1:  # one expert takes every row
        total = sum(sizes)
        sizes = [0] * e
        sizes[draw(st.integers(0, e - 1))] = total
    extra = draw(st.integers(0, 5))
    return sizes, extra, draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


@settings(max_examples=5, deadline=None)
@given(cases())
def test_grouped_lora_matches_the_loop_forward_and_grad(case):
    sizes, extra, r, seed = case
    rng = np.random.default_rng(seed)
    e, k, n = len(sizes), 12, 10
    m = max(1, sum(sizes) + extra)
    xs = rng.standard_normal((m, k))
    a = rng.standard_normal((e, r, k))
    b = rng.standard_normal((e, n, r))
    dy = rng.standard_normal((m, n))
    def loss(xs_, sizes_, a_, b_):
        return jnp.sum(grouped_lora(xs_, sizes_, a_, b_) * dy)

    # the product and its gradients jitted whole (the group sizes traced, as in a model): one
    # compile per example instead of one per eagerly dispatched op
    got, (gx, ga, gb) = jax.jit(lambda *args: (grouped_lora(*args), jax.grad(loss, argnums=(0, 2, 3))(*args)))(
        jnp.float32(xs), jnp.asarray(sizes, jnp.int32), jnp.float32(a), jnp.float32(b))
    want = reference(xs, sizes, a, b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    # analytic gradients of sum(dy * x A^T B^T) per group
    wx, wa, wb = np.zeros_like(xs), np.zeros_like(a), np.zeros_like(b)
    start = 0
    for g, cnt in enumerate(sizes):
        x_g, d_g = xs[start:start + cnt], dy[start:start + cnt]
        wx[start:start + cnt] = d_g @ b[g] @ a[g]
        wa[g] = (d_g @ b[g]).T @ x_g
        wb[g] = d_g.T @ (x_g @ a[g].T)
        start += cnt
    for got_g, want_g in ((gx, wx), (ga, wa), (gb, wb)):
        np.testing.assert_allclose(np.asarray(got_g), want_g, rtol=1e-4, atol=1e-3)
