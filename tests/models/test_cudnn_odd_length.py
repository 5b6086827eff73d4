"""cuDNN's attention refuses an odd sequence length in training (jax 0.11 with or without a mask;
GRPO's rows are prompt + completion - 1 slots, DPO's a user's seq_len): the fused path pads one
masked slot and slices it off. CPU: the padding through XLA's attention equals the unpadded call, values and gradients, and
the cuDNN branch of `attention.fused_attention` hands cuDNN an even length (its call stubbed by XLA's)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jqlora.models import attention


def _inputs(t, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, t, 4, 16), jnp.float32)
    k = jax.random.normal(ks[1], (2, t, 2, 16), jnp.float32)
    v = jax.random.normal(ks[2], (2, t, 2, 16), jnp.float32)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    seg = jnp.asarray([[1] * t, [1] * (t - 3) + [2] * 3])  # the second row: two documents
    mask = attention.attention_mask(slots, slots, seg, seg, None)[:, None]
    return q, k, v, mask


@pytest.mark.parametrize("t", [7, 9])
def test_padding_to_even_length_changes_nothing(t):
    q, k, v, mask = _inputs(t)

    def direct(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")

    def padded(q, k, v):
        qp, kp, vp, mp = attention.pad_to_even_length(q, k, v, mask)
        assert qp.shape[1] == t + 1 and mp.shape[-1] == t + 1
        return jax.nn.dot_product_attention(qp, kp, vp, mask=mp, is_causal=True, implementation="xla")[:, :t]

    c = jax.random.normal(jax.random.key(9), (2, t, 4, 16))

    @jax.jit  # values and gradients jitted whole: one compile instead of one per eager op
    def value_and_grads(q, k, v):
        return {f.__name__: (f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * c), argnums=(0, 1, 2))(q, k, v))
                for f in (direct, padded)}

    out = value_and_grads(q, k, v)
    (y_want, g_want), (y_got, g_got) = out["direct"], out["padded"]
    np.testing.assert_allclose(y_got, y_want, rtol=1e-6, atol=1e-6)
    for got, want in zip(g_got, g_want):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_cudnn_branch_pads_odd_lengths(monkeypatch):
    seen = []
    real = jax.nn.dot_product_attention

    def fake_cudnn(q, k, v, *, mask=None, implementation=None, **kw):
        assert implementation == "cudnn"
        seen.append(q.shape[1])
        if q.shape[1] % 2:
            raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}")  # what cuDNN says
        return real(q, k, v, mask=mask, implementation="xla", **kw)

    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", fake_cudnn)
    t = 7
    q, k, v, mask = _inputs(t)
    slots = jnp.broadcast_to(jnp.arange(t), (2, t))
    seg = jnp.asarray([[1] * t, [1] * (t - 3) + [2] * 3])
    fused = lambda plain_causal: attention.fused_attention(  # noqa: E731
        q, k, v, slots, slots, seg, seg, scale=0.25, cap=None, window=None, impl="cudnn", plain_causal=plain_causal)
    out = fused(False)
    want = real(q, k, v, mask=mask, is_causal=True, scale=0.25, implementation="xla")
    assert seen == [t + 1]
    np.testing.assert_allclose(out, want.reshape(2, t, -1), rtol=1e-6, atol=1e-6)
    out = fused(True)
    want = real(q, k, v, is_causal=True, scale=0.25, implementation="xla")
    assert seen == [t + 1, t + 1]
    np.testing.assert_allclose(out, want.reshape(2, t, -1), rtol=1e-6, atol=1e-6)
