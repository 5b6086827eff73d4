"""The decoding rows' residual add and RMSNorm kernel (`registry.norm_variants()`: rms_norm) against
its jnp reference on random shapes (partials of a K split or one delta, widths in power-of-two
pieces, both norm kinds, 16- and 32-bit rows), in Pallas interpret mode on CPU (compiled on a
GPU), to two rounding steps of the dtype; the reference against the model's RMSNorm; the Triton
lowering; errors; which path a decoding step takes. Generation through the kernel:
tests/models/test_decode_layers.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora.models.llama import RMSNorm
from jqlora.ops import decode_norm, dispatch
from pallas_kernels import registry
from pallas_kernels.reference.norm import rms_norm_reference
from pallas_kernels.triton.rms_norm import rms_norm, row_chunk, supports

INTERPRET = jax.default_backend() != "gpu"


def _operands(m, n, splits, dtype, seed=0):
    """x (M, N), delta (None, (M, N) in dtype, or (splits, M, N) float32 partials), weight (N,)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, n)) * 3, dtype)
    w = jnp.asarray(rng.normal(size=(n,)), dtype)
    if splits is None:
        delta = None
    elif splits == 0:
        delta = jnp.asarray(rng.normal(size=(m, n)), dtype)
    else:
        delta = jnp.asarray(rng.normal(size=(splits, m, n)), jnp.float32)
    return x, delta, w


def _agree(got, want):
    """Within two rounding steps of the dtype: the partials and the mean square are float32 sums,
    added in another order than jnp's, and kind "llama" rounds twice (h, then the weight times h)."""
    ulp = {2: 2.0 ** -7 if got.dtype == jnp.bfloat16 else 2.0 ** -10, 4: 2.0 ** -20}[got.dtype.itemsize]
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 4), pieces=st.sampled_from([(64, 1), (128, 5), (256, 2), (512, 4), (128, 9), (4096, 2)]),
       splits=st.sampled_from([None, 0, 1, 3, 8]), kind=st.sampled_from(["llama", "gemma"]),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
def test_kernel_matches_its_reference_on_random_shapes(m, pieces, splits, kind, dtype):
    n = pieces[0] * pieces[1]
    x, delta, w = _operands(m, n, splits, dtype)
    r, h = rms_norm(x, delta, w, eps=1e-6, kind=kind, interpret=INTERPRET)
    r_ref, h_ref = rms_norm_reference(x, delta, w, eps=1e-6, kind=kind)
    assert r.dtype == h.dtype == x.dtype and r.shape == h.shape == x.shape
    _agree(r, r_ref)
    _agree(h, h_ref)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_reference_is_the_models_add_then_norm(kind):
    """The oracle computes what the decoder layer computes without it: x + product, then RMSNorm."""
    x, delta, w = _operands(2, 640, 4, jnp.bfloat16, seed=1)
    norm = RMSNorm(w, 1e-6, kind)
    r = x + jnp.sum(delta, axis=0).astype(x.dtype)
    r_ref, h_ref = rms_norm_reference(x, delta, w, eps=1e-6, kind=kind)
    np.testing.assert_array_equal(np.asarray(r_ref, np.float32), np.asarray(r, np.float32))
    np.testing.assert_array_equal(np.asarray(h_ref, np.float32), np.asarray(norm(r), np.float32))
    assert norm.add_and_norm(x, jnp.sum(delta, axis=0).astype(x.dtype))[1].dtype == x.dtype


def test_errors_name_the_operand():
    x, delta, w = _operands(2, 256, 3, jnp.bfloat16)
    with pytest.raises(ValueError, match="`weight`"):
        rms_norm(x, delta, w[:128], eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="`delta`"):
        rms_norm(x, delta[:, :1], w, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="`x`"):
        rms_norm(x[0], None, w, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="norm kind"):
        rms_norm(x, None, w, eps=1e-6, kind="layer", interpret=True)
    x100, _, w100 = _operands(1, 100, None, jnp.bfloat16)
    with pytest.raises(ValueError, match="100 features"):
        rms_norm(x100, None, w100, eps=1e-6, interpret=True)


def test_widths_come_in_power_of_two_pieces():
    """Llama's widths are one piece; Gemma's are not powers of two (640, 1152, 2560, 5376)."""
    assert [row_chunk(n) for n in (2048, 8192, 640, 1152, 2560, 5376)] == [2048, 4096, 128, 128, 512, 256]
    assert all(supports(1, n) for n in (640, 1152, 2048, 2560, 3840, 4096, 5376, 8192, 16384))
    assert not any(supports(1, n) for n in (96, 100, 32768)) and not supports(0, 2048)


def test_registered_and_lowers_for_triton(lower_for_triton):
    (v,) = registry.norm_variants()
    assert registry.get("rms_norm") is v and v.status == "default" and v.numerics == "rms_norm"
    assert registry.module_of("rms_norm") == "pallas_kernels.triton.rms_norm"
    sd = jax.ShapeDtypeStruct
    for m, n, splits, kind in ((1, 2048, 8, "llama"), (1, 4096, 16, "llama"), (4, 8192, None, "llama"),
                               (2, 1152, 0, "gemma")):
        delta = None if splits is None else sd((splits, m, n) if splits else (m, n),
                                               jnp.float32 if splits else jnp.bfloat16)
        fn = lambda x, d, w, kind=kind: rms_norm(x, d, w, eps=1e-6, kind=kind)  # noqa: E731
        lower_for_triton(f"rms_norm {m}x{n}", fn, sd((m, n), jnp.bfloat16), delta, sd((n,), jnp.bfloat16))


def test_which_path_runs(monkeypatch):
    assert decode_norm.norm_problem("xla", (1, 1, 2048)) is not None
    assert decode_norm.norm_problem("interpret", (1, 1, 2048)) is None
    assert "new tokens" in decode_norm.norm_problem("interpret", (1, 7, 2048))
    assert "width 100" in decode_norm.norm_problem("pallas", (1, 1, 100))
    if jax.default_backend() != "gpu":
        assert decode_norm.norm_problem("auto", (1, 1, 2048)) == "not on a GPU"
    with pytest.raises(ValueError, match="unknown backend"):
        decode_norm.norm_problem("triton", (1, 1, 2048))
    # on a GPU by default: powers of two only (Gemma's widths come in pieces, slower than XLA)
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    assert [decode_norm.norm_problem("auto", (1, 1, n)) for n in (2048, 4096, 8192)] == [None] * 3
    for n in (640, 1152, 2304, 2560, 3840, 5376):
        assert "not a power of two" in decode_norm.norm_problem("auto", (1, 1, n))
        assert decode_norm.norm_problem("pallas", (1, 1, n)) is None  # forced: the kernel takes it
