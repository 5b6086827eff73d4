"""Int8 kernels (weight-only and LLM.int8) against their jnp references, float64 numpy and
bitsandbytes (CPU).

Kernels run in Pallas interpret mode on CPU and compiled (Triton) on a GPU backend.

Tolerances (elementwise, |got - want| <= bound):
- weight-only kernels vs reference: the reference rounds every dequantized weight to the compute
  dtype, the default kernel scales in the fp32 epilogue instead, and fp32 sums run in another
  order:  bound = u_c * (|x| @ |W|.T) + 4 * eps32 * (|x| @ |W|.T) + 1 ulp(out_dtype, |want|),
  u_c = eps(compute dtype) / 2.
- LLM.int8 kernel vs reference: identical int32 products and epilogue formula; fp32 sums in another
  order and FMA contraction:  bound = 1 ulp(out_dtype) + 8 * eps32 * (|x16| @ |W|.T).
- vs bitsandbytes 0.50.2 (CPU default ops), with out_term = 8 * eps32 * (|x_outlier_cols| @ |W|.T)
  (the fp32 outlier product is summed in another order than torch's addmm; it matters only where
  the int8 part and the outlier part cancel):
  fp16/bf16 x: 1 ulp of the output + out_term, and at least 99% of elements bitwise equal;
  fp32 x: 2 * eps32 * (|y| + |bias|) (XLA contracts acc*scale*c + bias into an FMA, torch rounds
  twice) + out_term. The dequant constant matters: with fp32 x the CUDA constant 1/16129 instead
  of the CPU op's 6.200124e-05 fails this bound (checked).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from pallas_kernels.reference import int8 as ref
from pallas_kernels import registry
from pallas_kernels.triton import int8_weight_only_gemv as mg
from pallas_kernels.triton import llm_int8_tiled as ml
from pallas_kernels.triton import matmul_int8 as mi
from pallas_kernels.registry import OPS, Variant

INTERPRET = jax.default_backend() != "gpu"
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
MS = [1, 3, 17, 64, 130]
N, K = 72, 200  # not multiples of any tile
EPS32 = float(np.finfo(np.float32).eps)
INT8_VARIANTS = (registry.for_op("matmul_int8") + registry.for_op("matmul_int8_t")
                 + registry.for_op("llm_int8"))
VARIANT = {v.name: v for v in INT8_VARIANTS}


# ----------------------------------------------------------------------------- helpers
def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def _ulp(a, dtype):
    """Spacing of `dtype` at |a| (elementwise, float64)."""
    fi = jnp.finfo(dtype)
    a = np.maximum(np.abs(np.asarray(a, np.float64)), float(fi.tiny))
    return float(fi.eps) * np.exp2(np.floor(np.log2(a)))


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _assert_within(got, want, bound, what):
    got, want = _f64(got), _f64(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    err = np.abs(got - want)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.size} elements out of tolerance; worst at {i}: "
            f"got {got[i]!r} want {want[i]!r} err {err[i]:.3g} bound {bound[i]:.3g}")


def _quantize_weight_np(w16):
    """bnb int8_vectorwise_quant of an fp16 weight (numpy float32, torch's op order)."""
    w = np.asarray(w16, np.float16).astype(np.float32)
    scb = np.abs(w).max(axis=1)
    inv = (np.float32(1.0) / scb) * np.float32(127.0)
    cb = np.round(w * inv[:, None]).astype(np.int8)  # round half to even
    return cb, scb.astype(np.float32)


def _weight(rng, n, k):
    cb, scb = _quantize_weight_np(rng.standard_normal((n, k)).astype(np.float16))
    return cb, scb


def _w64(cb, scb):
    return np.asarray(cb, np.float64) * np.asarray(scb, np.float64)[:, None] / 127.0


def _activations(rng, m, k, dtype, outliers=True):
    x = rng.standard_normal((m, k)) * 1.5
    if outliers:
        mask = rng.random((m, k)) < 0.01
        x[mask] = rng.choice([-1.0, 1.0], mask.sum()) * rng.uniform(6.0, 10.0, mask.sum())
        x[0, 5] = 7.5  # at least one outlier column
    return jnp.asarray(x, dtype)


def _wo_bound(x, cb, scb, want, compute_dtype, out_dtype, transpose=False):
    w = np.abs(_w64(cb, scb))
    ax = np.abs(_f64(x))
    absprod = ax @ w if transpose else ax @ w.T
    u = _eps(compute_dtype) / 2
    # 4 eps32 for the fp32 sums: compiled on an H200, one element of 9360 reached 1.006x a
    # 2 eps32 bound (M=130, float32): the tiled K order differs more from XLA's than interpret's.
    return (u + 4 * EPS32) * absprod + _ulp(_f64(want), out_dtype)


def _llm_bound(x, cb, scb, want, out_dtype):
    ax = np.abs(_f64(jnp.asarray(x).astype(jnp.float16)))
    absprod = ax @ np.abs(_w64(cb, scb)).T
    return _ulp(_f64(want), out_dtype) + 8 * EPS32 * absprod


# ----------------------------------------------------------------------------- registry
def test_variants_registered():
    names = {v.name for v in INT8_VARIANTS}
    assert {"int8_weight_only", "int8_weight_only_t", "llm_int8_tiled"} <= names
    assert len(names) == len(INT8_VARIANTS)
    for v in INT8_VARIANTS:
        assert isinstance(v, Variant) and v.op in OPS
        assert v.supports(1, N, K, 0)
    assert VARIANT["int8_weight_only"].op == "matmul_int8"
    assert VARIANT["int8_weight_only_t"].op == "matmul_int8_t"
    assert VARIANT["llm_int8_tiled"].op == "llm_int8"
    assert not VARIANT["int8_weight_only_splitk"].supports(65, N, K, 0)


# ----------------------------------------------------------------------------- references vs float64
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dequant_reference_is_one_rounding_of_exact(dtype):
    rng = np.random.default_rng(0)
    cb, scb = _weight(rng, N, K)
    exact = _w64(cb, scb)
    for fn in (ref.dequantize_int8_reference, ref.dequantize_int8_vectorwise_reference):
        got = fn(jnp.asarray(cb), jnp.asarray(scb), dtype)
        assert got.dtype == dtype and got.shape == (N, K)
        # fp32 math (<= 2 roundings of 2^-24) then one rounding to dtype
        _assert_within(got, exact, _ulp(exact, dtype) / 2 + 4 * EPS32 * np.abs(exact),
                       f"{fn.__name__} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_weight_only_references_vs_float64(dtype):
    rng = np.random.default_rng(1)
    cb, scb = _weight(rng, N, K)
    w = _w64(cb, scb)
    x = _activations(rng, 17, K, dtype, outliers=False)
    dy = jnp.asarray(rng.standard_normal((17, N)), dtype)
    y = ref.matmul_int8_reference(x, jnp.asarray(cb), jnp.asarray(scb), out_dtype=jnp.float32)
    _assert_within(y, _f64(x) @ w.T, _wo_bound(x, cb, scb, y, dtype, jnp.float32),
                   "matmul_int8_reference")
    dx = ref.matmul_int8_t_reference(dy, jnp.asarray(cb), jnp.asarray(scb), out_dtype=jnp.float32)
    _assert_within(dx, _f64(dy) @ w, _wo_bound(dy, cb, scb, dx, dtype, jnp.float32, True),
                   "matmul_int8_t_reference")


def _llm_int8_numpy(x, cb, scb, threshold, c, bias=None):
    """bnb's algorithm literally (gather of outlier columns, rows == 1 special case), quantization
    in numpy float32 as torch does it, everything after quantization in float64."""
    xdt = np.asarray(x).dtype
    a = np.asarray(x).astype(np.float16)
    m, _ = a.shape
    outl = np.abs(a) >= np.float16(threshold) if threshold > 0 else np.zeros(a.shape, bool)
    cols = np.nonzero(outl.any(axis=0))[0]
    a0 = np.where(outl, np.float16(0), a)
    sca = np.abs(a0).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = (np.float32(1.0) / sca) * np.float32(127.0)
        ca = np.round(a0.astype(np.float32) * inv[:, None])
    ca = np.where(sca[:, None] > 0, ca, 0).astype(np.int8)
    if m > 1 and threshold > 0:
        ca[:, cols] = 0
    acc = ca.astype(np.int64) @ np.asarray(cb).astype(np.int64).T
    y = acc * (sca.astype(np.float64)[:, None] * np.asarray(scb, np.float64)[None, :]) * c
    if bias is not None:
        y = y + np.asarray(bias, np.float64)[None, :]
    if threshold > 0 and cols.size:
        sub_a = np.asarray(x).astype(np.float64)[:, cols]
        y = y + sub_a @ _w64(cb, scb)[:, cols].T
    return y, ca, sca, cols, xdt


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m", [1, 17])
# the outlier capacity matters only where there are outlier columns (threshold > 0)
@pytest.mark.parametrize("threshold,cap", [(0.0, None), (6.0, None), (6.0, 1)],
                         ids=["0.0-cap_default", "6.0-cap_default", "6.0-cap1"])
def test_llm_int8_reference_vs_numpy_float64(dtype, m, threshold, cap):
    rng = np.random.default_rng(2 + m)
    cb, scb = _weight(rng, N, K)
    x = _activations(rng, m, K, dtype)
    bias = rng.standard_normal(N).astype(np.float32)
    xb = np.asarray(jnp.asarray(x).astype(jnp.float32))
    want, ca_np, sca_np, cols_np, _ = _llm_int8_numpy(
        xb, cb, scb, threshold, ref.CPU_DEQUANT_CONSTANT,
        bias=np.asarray(jnp.asarray(bias).astype(dtype).astype(jnp.float32)))
    ca, sca, cols = ref.quantize_activations_llm_int8(x, threshold)
    np.testing.assert_array_equal(np.asarray(ca), ca_np)
    np.testing.assert_array_equal(np.asarray(sca), sca_np)
    np.testing.assert_array_equal(np.nonzero(np.asarray(cols))[0], cols_np)
    if threshold > 0:
        assert cols_np.size > 0
    got = ref.llm_int8_matmul_reference(x, jnp.asarray(cb), jnp.asarray(scb), threshold=threshold,
                                       bias=jnp.asarray(bias), outlier_capacity=cap)
    assert got.dtype == dtype
    # two roundings to x.dtype (int8 part, then after adding the outliers), the outlier weights
    # rounded to x.dtype, fp32 epilogue
    xo = np.zeros_like(xb)
    xo[:, cols_np] = xb[:, cols_np]
    bound = (2 * _ulp(want, dtype) + _eps(dtype) * (np.abs(xo) @ np.abs(_w64(cb, scb)).T)
             + 8 * EPS32 * (np.abs(xb) @ np.abs(_w64(cb, scb)).T))
    _assert_within(got, want, bound, "llm_int8_matmul_reference")


# ----------------------------------------------------------------------------- outlier gather
@functools.partial(jax.jit, static_argnames=("threshold", "outlier_term"))
def _reference_with_outlier_term(x, cb, scb, threshold, outlier_term=None):
    """`llm_int8_matmul_reference` (default constant, no bias) with the outlier term computed by
    `outlier_term(x, cols, cb, scb)`; None = the dense masked product, written out here as the
    reference computed it before the gather (and as its fallback branch still does)."""
    ca, sca, cols = ref.quantize_activations_llm_int8(x, threshold)
    acc = lax.dot_general(ca, cb, ml._NT, preferred_element_type=jnp.int32)
    main = acc.astype(jnp.float32) * (sca[:, None] * scb.astype(jnp.float32)[None, :])
    main = main * jnp.float32(ref.CPU_DEQUANT_CONSTANT)
    if outlier_term is None:
        xo = jnp.where(cols[None, :], x, jnp.zeros((), x.dtype))
        w = lax.optimization_barrier(ref.dequantize_int8_vectorwise_reference(cb, scb, x.dtype))
        outl = lax.dot_general(xo, w, ml._NT, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    else:
        outl = outlier_term(x, cols, cb, scb)
    return ref.llm_int8_epilogue(main, outl, x.dtype, x.dtype, False, fence=lax.optimization_barrier)


@jax.jit
def _outlier_columns(x):
    """The outlier-column mask of `quantize_activations_llm_int8` at threshold 6 (jitted whole:
    one compile per shape instead of one per eagerly dispatched op)."""
    return ref.quantize_activations_llm_int8(x, 6.0)[2]


def _gather_bound(x, cols, cb, scb, want, dtype):
    """Gathered vs dense: the same nonzero fp32 terms summed in another order (8 eps32 of the
    outlier columns' |x| @ |W|.T), then one rounding to dtype that may land 1 ulp apart."""
    xo = np.abs(_f64(x)) * np.asarray(cols)[None, :]
    return _ulp(_f64(want), dtype) + 8 * EPS32 * (xo @ np.abs(_w64(cb, scb)).T)


def _planted(rng, m, k, dtype, out_cols):
    """Gaussian x kept below the threshold except one entry of +-[6, 10) per column of out_cols
    (in a random row): exactly len(out_cols) outlier columns at threshold 6."""
    x = np.clip(rng.standard_normal((m, k)) * 1.5, -5.5, 5.5)
    for c in out_cols:
        x[rng.integers(m), c] = rng.choice([-1.0, 1.0]) * rng.uniform(6.0, 10.0)
    return jnp.asarray(x, dtype)


def _check_capacity(x, cb, scb, cap, what):
    """llm_int8_matmul_reference(outlier_capacity=cap) against the dense masked product: within
    the reordering bound always; bitwise where the fallback branch runs on CPU (the same ops as
    the dense copy, compiled by the same XLA:CPU; a GPU may autotune the two dots differently)."""
    cbj, scbj = jnp.asarray(cb), jnp.asarray(scb)
    want = _reference_with_outlier_term(x, cbj, scbj, 6.0)
    got = ref.llm_int8_matmul_reference(x, cbj, scbj, threshold=6.0, outlier_capacity=cap)
    cols = _outlier_columns(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    _assert_within(got, want, _gather_bound(x, cols, cb, scb, want, x.dtype), what)
    k = x.shape[1]
    slots = min(k, 256) if cap is None else min(k, cap)
    if INTERPRET and int(cols.sum()) > slots:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


# each M and each dtype once: the property test below crosses shapes, dtypes and capacities
@pytest.mark.parametrize("m,dtype", [(1, jnp.float32), (17, jnp.bfloat16), (130, jnp.float16)],
                         ids=["1-float32", "17-bfloat16", "130-float16"])
def test_llm_int8_outlier_gather_matches_dense_masked(dtype, m):
    """Every capacity against the dense masked product: K slots (no cond), exactly `count`
    (cond, gather branch, every slot live), count - 1 and 1 (cond, dense fallback), default."""
    rng = np.random.default_rng(30 + m)
    cb, scb = _weight(rng, N, K)
    out_cols = sorted(rng.choice(K, size=12, replace=False).tolist())
    x = _planted(rng, m, K, dtype, out_cols)
    cols = np.asarray(_outlier_columns(x))
    np.testing.assert_array_equal(np.nonzero(cols)[0], out_cols)  # count = 12, both branches
    for cap in (K, 12, 11, 1, None):
        _check_capacity(x, cb, scb, cap, f"cap={cap} M={m} {jnp.dtype(dtype).name}")


def test_llm_int8_outlier_gather_tolerance_rejects_missing_fallback():
    """The checks above can fail: the gather alone, truncated to fewer slots than outlier
    columns (what a missing fallback would compute), is outside the bound; with enough slots
    it is inside."""
    rng = np.random.default_rng(31)
    cb, scb = _weight(rng, N, K)
    x = _planted(rng, 17, K, jnp.bfloat16, [3, 50, 51, 199])
    cbj, scbj = jnp.asarray(cb), jnp.asarray(scb)
    cols = _outlier_columns(x)
    assert int(cols.sum()) == 4
    want = _reference_with_outlier_term(x, cbj, scbj, 6.0)
    bound = _gather_bound(x, cols, cb, scb, want, jnp.bfloat16)
    for slots in (1, 3):
        bad = _reference_with_outlier_term(
            x, cbj, scbj, 6.0, functools.partial(ref._outlier_product_gathered, cap=slots))
        with pytest.raises(AssertionError):
            _assert_within(bad, want, bound, f"gather truncated to {slots} of 4 columns")
    ok = _reference_with_outlier_term(
        x, cbj, scbj, 6.0, functools.partial(ref._outlier_product_gathered, cap=4))
    _assert_within(ok, want, bound, "gather with 4 slots")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m", [1, 17])
def test_llm_int8_no_outlier_columns_at_threshold(dtype, m):
    """threshold 6 with no |x| >= 6: the quantization is threshold 0's, the outlier term an exact
    zero (every gather slot is padding), so the result is threshold 0's bit for bit."""
    rng = np.random.default_rng(32 + m)
    cb, scb = _weight(rng, N, K)
    x = _planted(rng, m, K, dtype, [])
    args = (x, jnp.asarray(cb), jnp.asarray(scb))
    assert not bool(ref.quantize_activations_llm_int8(x, 6.0)[2].any())
    want = np.asarray(ref.llm_int8_matmul_reference(*args, threshold=0.0))
    for cap in (None, 1, K):
        got = ref.llm_int8_matmul_reference(*args, threshold=6.0, outlier_capacity=cap)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"cap={cap}")


@pytest.mark.parametrize("cap", [0, -1, 2.5, True])
def test_llm_int8_bad_outlier_capacity(cap):
    x = jnp.zeros((3, K), jnp.bfloat16)
    cb, scb = jnp.zeros((N, K), jnp.int8), jnp.ones((N,), jnp.float32)
    with pytest.raises(ValueError, match="outlier_capacity"):
        ref.llm_int8_matmul_reference(x, cb, scb, threshold=6.0, outlier_capacity=cap)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 40), n=st.integers(1, 48), k=st.integers(1, 300),
       n_out=st.integers(0, 24), cap_offset=st.integers(-6, 6), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_property_outlier_gather_matches_dense_masked(m, n, k, n_out, cap_offset, dtype, seed):
    """Random shapes, outlier-column counts and capacities near the count (below it: fallback;
    at or above it: gather; above K on small K): the reference equals the dense masked product
    within the reordering bound."""
    rng = np.random.default_rng(seed)
    cb, scb = _weight(rng, n, k)
    n_out = min(n_out, k)
    cap = max(1, n_out + cap_offset)
    out_cols = sorted(rng.choice(k, size=n_out, replace=False).tolist())
    x = _planted(rng, m, k, dtype, out_cols)
    cols = np.asarray(_outlier_columns(x))
    np.testing.assert_array_equal(np.nonzero(cols)[0], out_cols)
    _check_capacity(x, cb, scb, cap, f"M={m} N={n} K={k} outliers={n_out} cap={cap}")


# ----------------------------------------------------------------------------- kernels vs references
# Three variants (the tiled kernel of each op: the most code paths) run every dtype at the
# smallest and largest M and each M between once, the dtype rotating; every other registered
# int8 variant (and llm_int8_tiled at threshold 0) runs each M once, the dtype rotating, to keep
# CI time down (each case compiles a kernel: ~1 s; the property test below crosses the rest).
# LLM.int8 variants run at threshold 6 (outlier columns).
_FULL = {("int8_weight_only", None), ("int8_weight_only_t", None), ("llm_int8_tiled", 6.0)}
_PARTIAL = [(v.name, 6.0 if v.op == "llm_int8" else None) for v in INT8_VARIANTS
            if v.name not in {name for name, _ in _FULL}] + [("llm_int8_tiled", 0.0)]


def _kernel_cases():
    cases = []

    def add(name, m, dt, t):
        tid = "" if t is None else f"-t{t:g}"
        cases.append(pytest.param(name, m, dt, t, id=f"{name}-M{m}-{jnp.dtype(dt).name}{tid}"))

    for name, t in sorted(_FULL, key=str):
        for i, m in enumerate(MS):
            for dt in DTYPES if m in (MS[0], MS[-1]) else [DTYPES[i % len(DTYPES)]]:
                add(name, m, dt, t)
    for j, (name, t) in enumerate(_PARTIAL):
        for i, m in enumerate(m for m in MS if VARIANT[name].supports(m, N, K, 0)):
            add(name, m, DTYPES[(i + j) % len(DTYPES)], t)
    covered = {c.values[0] for c in cases}
    assert covered == set(VARIANT), set(VARIANT) - covered
    return cases


def _run_and_check(v: Variant, m, n, k, dtype, threshold, seed, out_dtype=None, zero_row=False):
    rng = np.random.default_rng(seed)
    cb, scb = _weight(rng, n, k)
    cbj, scbj = jnp.asarray(cb), jnp.asarray(scb)
    if v.op == "matmul_int8_t":
        a = jnp.asarray(rng.standard_normal((m, n)), dtype)
    else:
        a = _activations(rng, m, k, dtype, outliers=v.op == "llm_int8")
    if zero_row:
        a = a.at[m // 2].set(0)
    od = dtype if out_dtype is None else out_dtype
    if v.op == "llm_int8":
        got = v.fn(a, cbj, scbj, threshold=threshold, out_dtype=od, interpret=INTERPRET)
        want = v.reference(a, cbj, scbj, threshold=threshold, out_dtype=od)
        bound = _llm_bound(a, cb, scb, want, od)
    else:
        got = v.fn(a, cbj, scbj, out_dtype=od, interpret=INTERPRET)
        want = v.reference(a, cbj, scbj, out_dtype=od)
        bound = _wo_bound(a, cb, scb, want, dtype, od, transpose=v.op == "matmul_int8_t")
    exp_shape = (m, k) if v.op == "matmul_int8_t" else (m, n)
    assert got.shape == exp_shape and got.dtype == jnp.dtype(od), (got.shape, got.dtype)
    _assert_within(got, want, bound, f"{v.name} M={m} N={n} K={k} {jnp.dtype(dtype).name}")
    return got, want


@pytest.mark.parametrize("name,m,dtype,threshold", _kernel_cases())
def test_kernel_matches_reference(name, m, dtype, threshold):
    _run_and_check(VARIANT[name], m, N, K, dtype, threshold, seed=10 + m)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 90), k=st.integers(1, 700), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_dequantize_int8_kernel_is_bitwise_the_reference(n, k, dtype, seed):
    """The large-M paths' transient weight is exactly the reference's W_c (ragged N and K pad)."""
    cb, scb = _weight(np.random.default_rng(seed), n, k)
    got = mi.dequantize_int8(jnp.asarray(cb), jnp.asarray(scb), out_dtype=dtype, interpret=INTERPRET)
    want = ref.dequantize_int8_reference(jnp.asarray(cb), jnp.asarray(scb), dtype)
    assert got.shape == (n, k) and got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("m,splits", [(1, 1), (1, 3), (5, 1), (5, 3)])
def test_small_m_kernels_with_and_without_k_splits(m, splits):
    """One K split scales and writes out_dtype in the kernel; several sum fp32 partials in XLA
    (K = 200 in 32-column tiles: 7 tiles, K padded to 224; 3 splits take 3, 3 and 1 tiles, the
    last one's shorter loop a dynamic trip count)."""
    rng = np.random.default_rng(20 + m + splits)
    cb, scb = _weight(rng, N, K)
    cbj, scbj = jnp.asarray(cb), jnp.asarray(scb)
    x = _activations(rng, m, K, jnp.bfloat16)
    want = ref.matmul_int8_reference(x, cbj, scbj)
    bound = _wo_bound(x, cb, scb, want, jnp.bfloat16, jnp.bfloat16)
    got = mi.int8_weight_only_splitk(x, cbj, scbj, block_k=32, splits=splits, interpret=INTERPRET)
    _assert_within(got, want, bound, f"splitk M={m} splits={splits}")
    if m <= mg.MAX_M:
        gsplits = 7 if splits == 3 else 1  # the gemv needs splits dividing the tile count
        got = mg.int8_weight_only_gemv(x, cbj, scbj, block_k=32, splits=gsplits, interpret=INTERPRET)
        _assert_within(got, want, bound, f"gemv M={m} splits={gsplits}")


@pytest.mark.parametrize("name", ["int8_weight_only", "int8_weight_only_t", "llm_int8_tiled"])
def test_out_dtype_differs_from_input(name):
    v = VARIANT[name]
    _run_and_check(v, 17, N, K, jnp.bfloat16, 6.0, seed=3, out_dtype=jnp.float32)


def test_llm_int8_tile_exact_in_interpret_mode():
    """On CPU the kernel's int32 GEMM and epilogue equal the reference bit for bit (threshold 0)."""
    if not INTERPRET:
        pytest.skip("bitwise check is for interpret mode")
    rng = np.random.default_rng(4)
    cb, scb = _weight(rng, N, K)
    x = _activations(rng, 130, K, jnp.float16)
    args = (x, jnp.asarray(cb), jnp.asarray(scb))
    got = ml.llm_int8_tiled(*args, threshold=0.0, interpret=True)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(ref.llm_int8_matmul_reference(*args, threshold=0.0)))


def test_tolerance_rejects_wrong_results():
    """The checks above can fail: a 1/128 scale, a wrong row scale, or a missing outlier part."""
    rng = np.random.default_rng(5)
    cb, scb = _weight(rng, N, K)
    cbj, scbj = jnp.asarray(cb), jnp.asarray(scb)
    x = _activations(rng, 17, K, jnp.float32, outliers=False)
    want = ref.matmul_int8_reference(x, cbj, scbj)
    bad = mi.int8_weight_only(x, cbj, scbj * (127.0 / 128.0), interpret=INTERPRET)
    with pytest.raises(AssertionError):
        _assert_within(bad, want, _wo_bound(x, cb, scb, want, jnp.float32, jnp.float32), "wrong")
    xb = _activations(rng, 17, K, jnp.bfloat16, outliers=False)
    want = ref.matmul_int8_reference(xb, cbj, scbj)
    bad = mi.int8_weight_only(xb, cbj, scbj[::-1], interpret=INTERPRET)
    with pytest.raises(AssertionError):
        _assert_within(bad, want, _wo_bound(xb, cb, scb, want, jnp.bfloat16, jnp.bfloat16), "w")
    x16 = _activations(rng, 17, K, jnp.float16)
    want = ref.llm_int8_matmul_reference(x16, cbj, scbj, threshold=6.0)
    bad = ml.llm_int8_tiled(x16, cbj, scbj, threshold=0.0, interpret=INTERPRET)
    with pytest.raises(AssertionError):
        _assert_within(bad, want, _llm_bound(x16, cb, scb, want, jnp.float16), "no outliers")


def test_input_errors_are_clear():
    cb = jnp.zeros((N, K), jnp.int8)
    scb = jnp.ones((N,), jnp.float32)
    with pytest.raises(ValueError, match="x has 7 columns"):
        mi.int8_weight_only(jnp.zeros((3, 7)), cb, scb, interpret=True)
    with pytest.raises(ValueError, match="cb must be int8"):
        mi.int8_weight_only_t(jnp.zeros((3, N)), cb.astype(jnp.float32), scb, interpret=True)
    with pytest.raises(ValueError, match="scb must have shape"):
        ml.llm_int8_tiled(jnp.zeros((3, K)), cb, scb[:5], threshold=0.0, interpret=True)
    with pytest.raises(ValueError, match="M=65 > 64"):
        mi.int8_weight_only_splitk(jnp.zeros((65, K)), cb, scb, interpret=True)
    with pytest.raises(ValueError, match="M=5 > 4"):
        mg.int8_weight_only_gemv(jnp.zeros((5, K)), cb, scb, interpret=True)
    with pytest.raises(ValueError, match="splits=3 must divide"):
        mg.int8_weight_only_gemv(jnp.zeros((1, K)), cb, scb, block_k=32, splits=3, interpret=True)
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        mg.int8_weight_only_gemv(jnp.zeros((1, K)), cb, scb, block_n=24, interpret=True)


# ----------------------------------------------------------------------------- property test
@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(VARIANT)),
    m=st.integers(1, 70),
    n=st.integers(1, 90),
    k=st.integers(1, 140),
    dtype=st.sampled_from(DTYPES),
    threshold=st.sampled_from([0.0, 2.0, 6.0]),
    zero_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_kernels_match_references(name, m, n, k, dtype, threshold, zero_row, seed):
    v = VARIANT[name]
    while not v.supports(m, n, k, 0):  # the small-M variants: halve M until supported
        m = max(1, m // 2)
    _run_and_check(v, m, n, k, dtype, threshold, seed, zero_row=zero_row)


# ----------------------------------------------------------------------------- Triton lowering
def test_kernels_lower_for_triton(lower_for_triton):
    """Lower every kernel for the CUDA platform (Pallas -> Triton IR) without a GPU: checks that the
    kernels only use ops the Triton lowering accepts (power-of-two tiles, int8 dot, ...)."""
    m, n, k = 130, 72, 320  # K/64 = 5 tiles (the flag array is not a power of two)
    dt = jnp.bfloat16
    x = jax.ShapeDtypeStruct((m, k), dt)
    xs = jax.ShapeDtypeStruct((5, k), dt)
    dy = jax.ShapeDtypeStruct((m, n), dt)
    cb = jax.ShapeDtypeStruct((n, k), jnp.int8)
    scb = jax.ShapeDtypeStruct((n,), jnp.float32)
    bias = jax.ShapeDtypeStruct((n,), dt)
    jobs = {
        "int8_weight_only": (lambda a, b, c: mi.int8_weight_only(a, b, c), (x, cb, scb)),
        "int8_weight_only_dq": (lambda a, b, c: mi.int8_weight_only(a, b, c, dequant="tile"),
                                (x, cb, scb)),
        "int8_weight_only_splitk": (lambda a, b, c: mi.int8_weight_only_splitk(a, b, c), (xs, cb, scb)),
        "int8_weight_only_weight_left": (
            lambda a, b, c: mi.int8_weight_only(a, b, c, weight_left=True), (x, cb, scb)),
        "int8_weight_only_splitk_weight_left": (
            lambda a, b, c: mi.int8_weight_only_splitk(a, b, c, splits=2, weight_left=True),
            (xs, cb, scb)),
        "int8_weight_only_gemv": (lambda a, b, c: mg.int8_weight_only_gemv(a, b, c), (jax.ShapeDtypeStruct((3, k), dt), cb, scb)),
        "int8_weight_only_gemv_splits": (
            lambda a, b, c: mg.int8_weight_only_gemv(a, b, c, block_k=64, splits=5, reduce_at_end=True),
            (jax.ShapeDtypeStruct((1, k), dt), cb, scb)),
        "int8_weight_only_t": (lambda a, b, c: mi.int8_weight_only_t(a, b, c), (dy, cb, scb)),
        "dequantize_int8": (lambda b, c: mi.dequantize_int8(b, c, out_dtype=dt), (cb, scb)),
        "llm_int8_tiled": (lambda a, b, c, d: ml.llm_int8_tiled(a, b, c, threshold=6.0, bias=d),
                           (x, cb, scb, bias)),
        "llm_int8_tiled_skip": (
            lambda a, b, c: ml.llm_int8_tiled(a, b, c, threshold=6.0, skip_clean_tiles=True,
                                              fp16_first=True), (x, cb, scb)),
        "llm_int8_t0_f32": (lambda a, b, c: ml.llm_int8_tiled(a.astype(jnp.float32), b, c),
                            (x, cb, scb)),
    }
    for label, (fn, args) in jobs.items():
        lower_for_triton(label, fn, *args)


# ----------------------------------------------------------------------------- bitsandbytes
@pytest.fixture(scope="module")
def bnb():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return torch, bnb


@pytest.mark.torch
def test_inverse_127_matches_torch_for_every_float16():
    """`127.0 / s` decides exact .5 ties of the int8 codes; torch computes it as fp32
    reciprocal * 127. Both copies of the lookup (kernels and jqlora.quant) must equal torch for
    every positive finite float16 s, jitted (the GPU's division is not correctly rounded)."""
    torch = pytest.importorskip("torch")
    from jqlora.quant.int8 import torch_style_inverse_127

    s16 = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)  # all positive finite float16
    want = (127.0 / torch.from_numpy(s16.astype(np.float32))).numpy()
    for fn in (ref.torch_inverse_127_of_f16, torch_style_inverse_127):
        got = np.asarray(jax.jit(fn)(jnp.asarray(s16)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=fn.__name__)
    # and torch's value is not the correctly rounded quotient for some s (the test has teeth)
    assert np.any((np.float32(127.0) / s16.astype(np.float32)) != want)


def _bnb_linear(torch, bnb, threshold, seed=0):
    g = torch.Generator().manual_seed(seed)
    w16 = torch.randn(N, K, generator=g).to(torch.float16)
    lin = bnb.nn.Linear8bitLt(K, N, bias=True, has_fp16_weights=False, threshold=threshold)
    lin.weight = bnb.nn.Int8Params(w16.clone(), requires_grad=False, has_fp16_weights=False)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(N, generator=g))
    lin = lin.to("cpu")  # Int8Params._quantize: CB, SCB from the fp16 weight
    lin.eval()
    cb, scb = lin.weight.CB.numpy().copy(), lin.weight.SCB.numpy().copy()
    ref_cb, ref_scb = _quantize_weight_np(w16.numpy())
    np.testing.assert_array_equal(cb, ref_cb)
    np.testing.assert_array_equal(scb, ref_scb)
    return lin, cb, scb


@pytest.mark.torch
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_activation_quant_matches_bnb(bnb, m, threshold):
    torch, bnb = bnb
    rng = np.random.default_rng(6)
    x = np.asarray(_activations(rng, m, K, jnp.float16))
    CA, SCA, cols = bnb.functional.int8_vectorwise_quant(torch.from_numpy(x.copy()), threshold)
    ca, sca, mask = ref.quantize_activations_llm_int8(jnp.asarray(x), threshold)
    np.testing.assert_array_equal(np.asarray(ca), CA.numpy())
    np.testing.assert_array_equal(np.asarray(sca), SCA.numpy())
    want_cols = np.array([], np.int64) if cols is None else cols.numpy()
    np.testing.assert_array_equal(np.nonzero(np.asarray(mask))[0], want_cols)


@pytest.mark.torch
@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_llm_int8_matches_bitsandbytes_linear8bitlt(bnb, threshold, dtype):
    torch, bnb = bnb
    tdt = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16,
           jnp.float16: torch.float16}[dtype]
    lin, cb, scb = _bnb_linear(torch, bnb, threshold)
    bias = jnp.asarray(lin.bias.detach().float().numpy())
    rng = np.random.default_rng(7)
    for m in (1, 130):  # rows == 1 is a special case in bnb; 130 rows span two M tiles
        x = _activations(rng, m, K, dtype)
        xt = torch.from_numpy(np.array(x.astype(jnp.float32))).to(tdt)
        with torch.no_grad():
            y_t = lin(xt)
        assert y_t.dtype == tdt
        y_bnb = y_t.float().numpy()
        if threshold > 0:
            assert lin.state.idx is not None and lin.state.idx.numel() > 0  # outliers exercised
        args = (x, jnp.asarray(cb), jnp.asarray(scb))
        outs = {
            "kernel": ml.llm_int8_tiled(*args, threshold=threshold, bias=bias,
                                        interpret=INTERPRET),
            "reference": ref.llm_int8_matmul_reference(*args, threshold=threshold, bias=bias),
            # one slot: the dense fallback wherever the layer has >= 2 outlier columns
            "reference cap=1": ref.llm_int8_matmul_reference(*args, threshold=threshold, bias=bias,
                                                            outlier_capacity=1),
        }
        for label, y in outs.items():
            what = f"{label} vs bnb M={m} t={threshold} {jnp.dtype(dtype).name}"
            assert y.dtype == dtype
            outl = 0.0
            if threshold > 0:  # fp32 outlier product summed in another order (torch addmm)
                xo = np.abs(_f64(x)) * (np.abs(_f64(x.astype(jnp.float16))) >= threshold).any(0)
                outl = 8 * EPS32 * (xo @ np.abs(_w64(cb, scb)).T)
            if dtype == jnp.float32:
                # FMA contraction of (acc * scale * c) + bias: up to 1 ulp of the larger term
                bound = 2 * EPS32 * (np.abs(y_bnb) + np.abs(_f64(bias))[None, :]) + outl
            else:
                bound = _ulp(y_bnb, dtype) + outl
                frac = float(np.mean(_f64(y) == y_bnb))
                assert frac >= 0.99, f"{what}: only {frac:.4f} bitwise equal"
            _assert_within(y, y_bnb, bound, what)
        if dtype == jnp.float32:  # the constant is checked: the CUDA value is rejected
            y_cuda = ref.llm_int8_matmul_reference(*args, threshold=threshold, bias=bias,
                                                  dequant_constant=ref.CUDA_DEQUANT_CONSTANT)
            with pytest.raises(AssertionError):
                _assert_within(y_cuda, y_bnb, bound, "cuda constant")
