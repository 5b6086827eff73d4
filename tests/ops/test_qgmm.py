"""qgmm (grouped 4-bit / int8 / dense matmul for mixture-of-experts layers) and ExpertWeights:
against a float64 numpy oracle on ragged shapes, gradients, residuals, bitsandbytes agreement
of the expert layouts, and planted bugs that the checks must catch."""
from __future__ import annotations

try:  # public in newer jax; jax 0.10 keeps it private
    from jax.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover
    from jax._src.ad_checkpoint import saved_residuals

import importlib
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora import ops, quant
from jqlora.ops import dispatch, grouped_dispatch
from jqlora.quant import ExpertWeights, dequantize_experts, quantize_experts
from jqlora.quant.tables import code_4bit, dynamic_map

qgmm_mod = importlib.import_module("jqlora.ops.qgmm")  # the package attribute is the function
FORMATS = ("nf4", "fp4", "nf4-flat", "int8", "bf16", "f32")
# (E, N, K) and M of the property test: few shapes (one compilation each), any group sizes
SHAPES = ((1, 8, 64), (3, 24, 64), (5, 40, 128))
MS = (0, 13, 37)


# ------------------------------------------------------------------------------------------
# the numpy oracle: bitsandbytes' tables, per-expert float64 products
# ------------------------------------------------------------------------------------------
def numpy_dequant(ex: ExpertWeights) -> np.ndarray:
    """(E, N, K) float32 weights computed in numpy from the stored bytes, as bitsandbytes does:
    code[nibble] * absmax in float32, nested absmax = round(dyn[c] * nested_absmax) + offset."""
    e, n, k = ex.shape
    s = jax.tree_util.tree_map(np.asarray, ex.stack)
    if isinstance(s, quant.Int8Weight):
        return (s.cb.astype(np.float32) * s.scb[:, :, None] * np.float32(7.874015718698502e-3))
    if not isinstance(s, quant.Weight4bit):
        return s.astype(np.float32)
    codes = np.stack([s.packed >> 4, s.packed & 15], -1).reshape(e, n * k).astype(np.int64)
    vals = code_4bit(s.quant_type)[codes]
    absmax = s.absmax
    if s.nested:
        groups = np.arange(absmax.shape[1]) // 256
        absmax = (dynamic_map()[absmax.astype(np.int64)] * s.nested_absmax[:, groups]).astype(np.float32)
        absmax = (absmax + s.offset[:, None]).astype(np.float32)
    w = vals.reshape(e, -1, s.blocksize) * absmax[:, :, None]
    return w.astype(np.float32).reshape(e, n, k)


def numpy_grouped(a: np.ndarray, gs, w: np.ndarray, transpose: bool) -> np.ndarray:
    """float64 a @ w[e].T (transpose) or a @ w[e] per group; rows past sum(gs) zero."""
    out = np.zeros((a.shape[0], w.shape[1] if transpose else w.shape[2]))
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        we = w[e].astype(np.float64)
        out[start:start + size] = a[start:start + size].astype(np.float64) @ (we.T if transpose else we)
        start += size
    return out


def make_experts(fmt: str, e: int, n: int, k: int, seed: int = 0, blocksize: int = 64) -> ExpertWeights:
    w = jax.random.normal(jax.random.key(seed), (e, n, k), jnp.float32)
    if fmt in ("nf4", "fp4"):
        return quantize_experts(w, fmt, blocksize, double_quant=seed % 2 == 0)
    if fmt == "nf4-flat":  # one fused quantization, nested stats sliced or de-nested
        return ExpertWeights.from_fused(quant.quantize_4bit(w, "nf4", blocksize, double_quant=True))
    if fmt == "int8":
        return quantize_experts(w, "int8")
    return ExpertWeights.from_dense(w.astype(jnp.bfloat16 if fmt == "bf16" else jnp.float32))


def assert_close(got, want64, a, w, dtype, what):
    """|got - want| <= accumulation error + one rounding of the output to its dtype + the
    rounding of the weight to x's dtype (the weight qgmm multiplies is round(W) in x's dtype)."""
    got = np.asarray(got, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    scale = numpy_scale(a, w)
    tol = scale * (1e-5 + eps) + np.abs(want64) * eps
    bad = np.abs(got - want64) > tol
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} entries off, max {np.abs(got - want64).max()}"


def numpy_scale(a, w):
    """|a| @ |w|-like bound per output entry, used for tolerances (rows of a against each expert's max)."""
    return np.abs(np.asarray(a, np.float64)).sum(1, keepdims=True) * np.abs(w).max()


def group_sizes_strategy(e: int, m: int):
    return st.lists(st.integers(0, m), min_size=e, max_size=e).map(
        lambda xs: _fit(xs, m))


def _fit(xs, m):
    """Scale a list of counts so they sum to at most m."""
    total = sum(xs)
    if total <= m:
        return xs
    out = [x * m // total for x in xs]
    return out


# ------------------------------------------------------------------------------------------
# forward and gradient against the oracle
# ------------------------------------------------------------------------------------------
@jax.jit
def _forward_and_grad(x, gs, c, ex):
    """y = qgmm(x), dx of sum(y * c), and the float32 dequantized experts, in one compilation."""
    y, vjp = jax.vjp(lambda x: ops.qgmm(x, gs, ex), x)
    return y, vjp(c.astype(y.dtype))[0], dequantize_experts(ex, jnp.float32)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_forward_and_grad_match_float64_on_ragged_shapes(data):
    fmt = data.draw(st.sampled_from(FORMATS), "format")
    e, n, k = data.draw(st.sampled_from(SHAPES), "E, N, K")
    m = data.draw(st.sampled_from(MS), "m")
    layout = data.draw(st.sampled_from(["random", "one takes all", "empty ends", "short"]), "layout")
    if layout == "random":
        gs = data.draw(group_sizes_strategy(e, m), "group sizes")
    elif layout == "one takes all":
        gs = [0] * e
        gs[data.draw(st.integers(0, e - 1), "which")] = m
    elif layout == "empty ends":
        gs = [0] * e
        gs[e // 2] = m
    else:  # M larger than the sum: trailing rows give zeros
        gs = data.draw(group_sizes_strategy(e, max(m - 3, 0)), "group sizes")
    dtype = jnp.float32 if fmt == "f32" else data.draw(st.sampled_from([jnp.float32, jnp.bfloat16]), "dtype")
    ex = make_experts(fmt, e, n, k, seed=e + n + k)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
    c = jax.random.normal(jax.random.key(m + 1), (m, n), jnp.float32).astype(dtype)
    y, dx, w_jnp = _forward_and_grad(x, jnp.asarray(gs, jnp.int32), c, ex)
    w32 = numpy_dequant(ex)
    np.testing.assert_array_equal(np.asarray(w_jnp), w32)
    w_used = np.asarray(jnp.asarray(w32).astype(dtype), np.float64)  # the weight rounded to x's dtype
    assert y.shape == (m, n) and y.dtype == dtype
    what = f"{fmt} E={e} N={n} K={k} M={m} gs={gs} {jnp.dtype(dtype).name}"
    assert_close(y, numpy_grouped(np.asarray(x, np.float64), gs, w_used, True), x, w_used, dtype, what)
    assert not np.asarray(y[sum(gs):], np.float64).any(), f"{what}: rows past sum(group_sizes) not zero"
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_close(dx, numpy_grouped(np.asarray(c, np.float64), gs, w_used, False), c,
                 np.swapaxes(w_used, 1, 2), dtype, what + " dx")


def _float_reference(x, gs, w):
    """A per-expert masked loop in jnp (float32): the float reference whose jax.grad qgmm's must equal."""
    rows = jnp.arange(x.shape[0])
    ends = jnp.cumsum(gs)
    starts = ends - gs
    y = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
    for e in range(w.shape[0]):
        mask = ((rows >= starts[e]) & (rows < ends[e]))[:, None]
        y = y + jnp.where(mask, x @ w[e].T, 0.0)
    return y


def test_grad_equals_jax_grad_of_the_float_reference():
    ex = make_experts("nf4", 4, 24, 64, seed=3)
    w = dequantize_experts(ex, jnp.float32)
    gs = jnp.asarray([5, 0, 9, 3], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (20, 64), jnp.float32)
    c = jax.random.normal(jax.random.key(1), (20, 24), jnp.float32)
    got = jax.jit(jax.grad(lambda x: jnp.sum(ops.qgmm(x, gs, ex) * c)))(x)
    want = jax.jit(jax.grad(lambda x: jnp.sum(_float_reference(x, gs, w) * c)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[17:]).any()


def test_out_dtype_and_jit_and_errors():
    ex = make_experts("nf4", 2, 16, 64)
    x = jnp.ones((6, 64), jnp.bfloat16)
    gs = jnp.asarray([2, 3], jnp.int32)
    y = jax.jit(lambda x, gs: ops.qgmm(x, gs, ex, out_dtype=jnp.float32))(x, gs)
    assert y.dtype == jnp.float32 and y.shape == (6, 16)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(ops.qgmm(x, gs, ex, out_dtype=jnp.float32))))(x)
    assert dx.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        ops.qgmm(jnp.ones((6, 32)), gs, ex)
    with pytest.raises(ValueError, match="group_sizes must be an integer"):
        ops.qgmm(x, jnp.asarray([2, 3, 1], jnp.int32), ex)
    with pytest.raises(ValueError, match="ExpertWeights"):
        ops.qgmm(x, gs, quant.quantize_4bit(jnp.ones((16, 64))))
    if jax.default_backend() != "gpu":
        with pytest.raises(dispatch.BackendError, match="needs a GPU"):
            ops.qgmm(x, gs, ex, backend="pallas")
    with pytest.raises(dispatch.BackendError, match="mgpu_grouped_dot"):
        ops.qgmm(x, gs, ex, backend="interpret", variant="mgpu_grouped_dot")


# ------------------------------------------------------------------------------------------
# invariant: no dense expert stack among the residuals; the backward dequantizes again
# ------------------------------------------------------------------------------------------
def residual_problems(fn, x, ex) -> list[str]:
    """What is wrong with the residuals `fn(x)` keeps for backward: a float array as large as
    one expert's dense weight, or more bytes than the packed experts + x + group sizes."""
    e, n, k = ex.shape
    avals = [aval for aval, _ in saved_residuals(fn, x)]
    problems = [f"float residual {tuple(v.shape)} as large as an expert's dense weight"
                for v in avals if jnp.issubdtype(v.dtype, jnp.floating) and int(np.prod(v.shape)) >= n * k]
    total = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in avals)
    if total > ex.nbytes * 1.05 + x.nbytes + 4 * e + 64:
        problems.append(f"residuals hold {total} bytes, more than the packed experts ({ex.nbytes})")
    return problems


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_no_dense_expert_stack_among_residuals(fmt):
    ex = make_experts(fmt, 4, 64, 256)
    gs = jnp.asarray([3, 0, 4, 1], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32)
    assert residual_problems(lambda x: jnp.sum(ops.qgmm(x, gs, ex) ** 2), x, ex) == []
    # the backward of the vjp itself dequantizes (the jaxpr of the cotangent map holds the table lookups)
    _, vjp = jax.vjp(lambda x: ops.qgmm(x, gs, ex), x)
    jaxpr = str(jax.make_jaxpr(vjp)(jnp.ones((8, 64), jnp.float32)))
    assert "ragged_dot_general" in jaxpr and "gather" in jaxpr or fmt == "int8"


def _walk(jaxpr, deps: dict, found: list) -> None:
    """Propagate `deps` (var -> the set of tagged inputs it is computed from) through `jaxpr`,
    into called sub-jaxprs (pjit, custom_vjp); loops and other equations: each output from all
    inputs. Appends (equation, deps of each operand) for every ragged_dot_general."""
    def of(v):
        return set() if isinstance(v, jax.extend.core.Literal) else deps.get(v, set())

    for eqn in jaxpr.eqns:
        ins = [of(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        sub = getattr(sub, "jaxpr", sub)
        if eqn.primitive.name in ("pjit", "closed_call", "custom_vjp_call", "custom_jvp_call") and sub is not None \
                and len(sub.invars) == len(eqn.invars):
            inner = dict(zip(sub.invars, ins))
            _walk(sub, inner, found)
            for o, io in zip(eqn.outvars, sub.outvars):
                deps[o] = set() if isinstance(io, jax.extend.core.Literal) else inner.get(io, set())
            continue
        if eqn.primitive.name == "ragged_dot_general":
            found.append((eqn, ins))
        reached = set().union(*ins)
        for o in eqn.outvars:
            deps[o] = reached


def _backward_weight_depends_on_x(qgmm_fn) -> bool:
    """In the gradient of sum(qgmm(x) * r), whether the backward grouped product's weight is
    computed from x (r, the cotangent, does not depend on x)."""
    ex = make_experts("nf4", 4, 64, 256)
    gs = jnp.asarray([3, 0, 4, 1], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32)
    r = jnp.ones((8, 64), jnp.float32)
    closed = jax.make_jaxpr(jax.grad(lambda x, r: jnp.sum(qgmm_fn(x, gs, ex) * r)))(x, r)
    xv, rv = closed.jaxpr.invars
    found = []
    _walk(closed.jaxpr, {xv: {"x"}, rv: {"r"}}, found)
    backward = [ins for _, ins in found if "r" in ins[0]]
    assert len(found) == 2 and len(backward) == 1, f"expected a forward and a backward grouped product: {found}"
    return "x" in backward[0][1]


def test_backward_dequantization_waits_for_the_forward_input():
    """The experts qgmm keeps for backward are tied to x, so the backward's dense stack is made
    only once x exists: under remat, after the layer's earlier products are recomputed, not
    hoisted beside their dense stacks (the MoE step's peak held two stacks at once)."""
    assert _backward_weight_depends_on_x(ops.qgmm)


def test_planted_bug_untied_residual_is_caught(monkeypatch):
    """With the raw experts saved for backward (as before), the dependency check fails."""
    def untied_fwd(st, x, group_sizes, experts):
        return qgmm_mod._qgmm(st, x, group_sizes, experts), (group_sizes, experts)

    monkeypatch.setattr(qgmm_mod._qgmm, "fwd", untied_fwd)
    assert not _backward_weight_depends_on_x(ops.qgmm)


def test_planted_bug_dense_stack_saved_for_backward_is_caught():
    """A qgmm whose forward saves the dequantized stack (and whose backward reuses it) fails the
    residual check above."""
    ex = make_experts("nf4", 4, 64, 256)
    gs = jnp.asarray([3, 0, 4, 1], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32)

    @jax.custom_vjp
    def leaky(x):
        return qgmm_mod.ragged_reference(x, gs, dequantize_experts(ex, x.dtype), transpose=True, out_dtype=x.dtype)

    def leaky_fwd(x):
        w = dequantize_experts(ex, x.dtype)
        return qgmm_mod.ragged_reference(x, gs, w, transpose=True, out_dtype=x.dtype), w

    def leaky_bwd(w, dy):
        return (qgmm_mod.ragged_reference(dy, gs, w, transpose=False, out_dtype=dy.dtype),)

    leaky.defvjp(leaky_fwd, leaky_bwd)
    assert residual_problems(lambda x: jnp.sum(leaky(x) ** 2), x, ex)


def test_planted_bug_wrong_expert_order_is_caught(monkeypatch):
    """With the expert stack reversed inside qgmm, the oracle comparison fails."""
    ex = make_experts("nf4", 3, 24, 64)
    gs = [4, 2, 5]
    x = jax.random.normal(jax.random.key(0), (12, 64), jnp.float32)
    w = numpy_dequant(ex).astype(np.float64)
    want = numpy_grouped(np.asarray(x, np.float64), gs, w, True)
    real = qgmm_mod.dequantize_experts
    monkeypatch.setattr(qgmm_mod, "dequantize_experts", lambda ex, dt: real(ex, dt)[::-1])
    y = jax.jit(lambda x: ops.qgmm(x, jnp.asarray(gs, jnp.int32), ex))(x)
    with pytest.raises(AssertionError):
        assert_close(y, want, x, w, jnp.float32, "reversed experts")


def test_frozen_experts_get_zero_cotangent():
    ex = make_experts("nf4", 2, 16, 64)
    gs = jnp.asarray([2, 2], jnp.int32)
    x = jnp.ones((4, 64), jnp.float32)
    dex = jax.jit(lambda x, ex: jax.vjp(lambda x, ex: ops.qgmm(x, gs, ex), x, ex)[1](
        jnp.ones((4, 16), jnp.float32))[1])(x, ex)
    for leaf in jax.tree_util.tree_leaves(dex):
        assert leaf.dtype == jax.dtypes.float0 or not np.asarray(leaf).any()


# ------------------------------------------------------------------------------------------
# ExpertWeights: layouts, constructors, bitsandbytes agreement
# ------------------------------------------------------------------------------------------
def _bits(a):
    """The bit patterns of `a`, with -0.0 written as +0.0: bitsandbytes' backends disagree on the sign
    of FP4 code 8 (the CUDA kernel and torch 2.11's CPU path give -0.0, torch 2.13's CPU path +0.0),
    so only the sign of zero is left out of the comparison."""
    a = np.asarray(a)
    a = np.where(a == 0, np.zeros_like(a), a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("fp4", False)])
def test_per_expert_bitsandbytes_weights_dequantize_bit_identically(quant_type, nested):
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    from interop.torch_bridge import quant_state_to_weight

    e, n, k = 3, 32, 128
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    parts = [F.quantize_4bit(w[i].contiguous(), blocksize=64, quant_type=quant_type, compress_statistics=nested)
             for i in range(e)]
    ex = ExpertWeights.from_experts([quant_state_to_weight(p, qs) for p, qs in parts])
    assert ex.shape == (e, n, k) and ex.format == quant_type and ex.stack.nested == nested
    got = dequantize_experts(ex, jnp.bfloat16)
    for i, (p, qs) in enumerate(parts):
        want = F.dequantize_4bit(p, qs).view(torch.int16).numpy().view(np.uint16)
        want = np.where(want == 0x8000, np.uint16(0), want)  # the sign of zero: see _bits
        np.testing.assert_array_equal(_bits(got[i]), want, err_msg=f"expert {i}")


# 128 blocks per expert: nested scales de-nested at construction; 256: sliced per expert
@pytest.mark.parametrize("n,k,via", [(64, 128, "quantize_4bit"), (128, 128, "replace_parameter_4bit")])
def test_fused_3d_bitsandbytes_parameter_dequantizes_bit_identically(n, k, via):
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    from interop.torch_bridge import quant_state_to_weight

    e = 4
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    if via == "quantize_4bit":
        packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    else:
        from bitsandbytes.nn.parametrize import replace_parameter_4bit

        mod = torch.nn.Module()
        mod.gate_up_proj = torch.nn.Parameter(w.clone())
        replace_parameter_4bit(mod, "gate_up_proj", compress_statistics=True)
        packed = mod.parametrizations.gate_up_proj.original
        qs = mod.parametrizations.gate_up_proj[0].quant_state
    ex = ExpertWeights.from_fused(quant_state_to_weight(packed, qs))
    assert ex.shape == (e, n, k)
    assert ex.stack.nested == (n * k // 64 % 256 == 0)  # sliced where whole nested groups per expert
    want = F.dequantize_4bit(packed, qs).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(_bits(dequantize_experts(ex, jnp.bfloat16)), want)
    for i in range(e):  # each expert alone is an ordinary Weight4bit
        np.testing.assert_array_equal(_bits(quant.dequantize(ex.expert(i), jnp.bfloat16)), want[i])


def test_quantize_experts_equals_per_expert_quantization():
    w = jax.random.normal(jax.random.key(2), (3, 16, 128), jnp.float32)
    ex = quantize_experts(w, "nf4", 64, double_quant=True)
    for i in range(3):
        one = quant.quantize_4bit(w[i], "nf4", 64, double_quant=True)
        for a, b in zip(jax.tree_util.tree_leaves(ex.expert(i)), jax.tree_util.tree_leaves(one)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ex8 = quantize_experts(w, "int8")
    np.testing.assert_array_equal(np.asarray(ex8.expert(1).cb), np.asarray(quant.quantize_int8(w[1]).cb))


def test_bad_expert_stacks_get_clear_errors():
    w = jax.random.normal(jax.random.key(2), (2, 16, 128), jnp.float32)
    a = quant.quantize_4bit(w[0], "nf4", 64)
    b = quant.quantize_4bit(w[1], "fp4", 64)
    with pytest.raises(ValueError, match="expert 1 has format"):
        ExpertWeights.from_experts([a, b])
    with pytest.raises(ValueError, match="mix weight types"):
        ExpertWeights.from_experts([a, quant.quantize_int8(w[1])])
    with pytest.raises(ValueError, match="3-D"):
        ExpertWeights.from_fused(quant.quantize_4bit(w[0], "nf4", 64))
    with pytest.raises(ValueError, match="blocks span experts"):
        ExpertWeights.from_fused(quant.quantize_4bit(jnp.ones((2, 3, 10)), "nf4", 64))
    with pytest.raises(ValueError, match=r"\(E, N, K\)"):
        quantize_experts(w[0])
    with pytest.raises(ValueError, match="leading expert axis"):
        ExpertWeights(stack=quant.quantize_int8(w[0]), num_experts=2).validate()


def test_expert_weights_pass_through_jit_as_a_pytree():
    ex = make_experts("nf4", 2, 16, 64)
    out = jax.jit(lambda ex: dequantize_experts(ex, jnp.float32))(ex)
    np.testing.assert_array_equal(np.asarray(out), numpy_dequant(ex))


# ------------------------------------------------------------------------------------------
# dispatch: GROUPED_RULES, explain_grouped, the docs' copy of the table
# ------------------------------------------------------------------------------------------
HOPPER, GPU, CPU = dispatch.Device("gpu", sm90=True), dispatch.Device("gpu"), dispatch.Device("cpu")


def test_grouped_plans_follow_the_table():
    qwen = dict(m=16384, n=768, k=2048, experts=128)
    kernels = dispatch.Plan("pallas", "mgpu_grouped_dot", "mgpu_grouped_dot_t")
    decoding = dispatch.Plan("pallas", "mgpu_grouped_dot_4bit", "mgpu_grouped_dot_4bit_t")  # no dense stack
    # other GPUs: the Triton grouped kernels on a dequantized stack, not XLA's dense expansion
    triton_dense = dispatch.Plan("pallas", "grouped_dot", "grouped_dot_t")
    for weight in ("nf4", "fp4", "int8", "dense"):
        on_hopper = decoding if weight in ("nf4", "fp4") else kernels
        assert grouped_dispatch.explain_grouped(weight, **qwen, device=HOPPER).plan == on_hopper, weight
        assert grouped_dispatch.explain_grouped(weight, **qwen, device=GPU).plan == triton_dense, weight
        assert grouped_dispatch.explain_grouped(weight, **qwen, device=CPU).plan == dispatch.Plan("xla"), weight
        f32 = grouped_dispatch.explain_grouped(weight, **qwen, dtype="float32", device=HOPPER)
        assert f32.plan == dispatch.Plan("xla"), weight
    odd = grouped_dispatch.explain_grouped("nf4", 64, 96, 2048, 8, device=HOPPER)
    assert odd.plan == triton_dense  # a shape the Hopper kernel declines goes to the Triton one
    assert ("fwd", "mgpu_grouped_dot", "supports() declines M=64, N=96, K=2048, blocksize=64") in odd.rows
    assert ("fwd", "mgpu_grouped_dot_4bit", "supports() declines M=64, N=96, K=2048, blocksize=64") in odd.rows
    # scale blocks of 32 columns: the decoding kernel declines, the dequant pass + wgmma kernel takes them
    assert grouped_dispatch.explain_grouped("nf4", **qwen, blocksize=32, device=HOPPER).plan == kernels
    text = str(grouped_dispatch.explain_grouped("nf4", **qwen, device=HOPPER))
    assert "pallas_kernels/mosaic/grouped_mgpu_4bit.py" in text and "chosen" in text
    with pytest.raises(dispatch.BackendError, match="needs a GPU"):
        grouped_dispatch.explain_grouped("nf4", **qwen, device=CPU, backend="pallas")
    triton = dispatch.Plan("pallas", "grouped_dot_4bit", "grouped_dot_4bit_t")
    assert grouped_dispatch.explain_grouped("nf4", **qwen, device=GPU, backend="pallas").plan == triton_dense
    f32 = grouped_dispatch.explain_grouped("nf4", **qwen, dtype="float32", device=HOPPER, backend="pallas")
    assert f32.plan == triton  # 32-bit x: only the in-register decode takes it
    interp = grouped_dispatch.explain_grouped("nf4", **qwen, device=HOPPER, backend="interpret")
    assert interp.plan == dispatch.Plan("interpret", "grouped_dot", "grouped_dot_t")
    assert ("fwd", "mgpu_grouped_dot", "no interpret mode") in interp.rows
    interp_cpu = grouped_dispatch.explain_grouped("nf4", **qwen, device=CPU, backend="interpret")
    assert interp_cpu.plan == dispatch.Plan("interpret", "grouped_dot_4bit", "grouped_dot_4bit_t")
    assert grouped_dispatch.explain_grouped("dense", **qwen, device=CPU, backend="interpret").plan == dispatch.Plan(
        "interpret", "grouped_dot", "grouped_dot_t")
    with pytest.raises(ValueError, match="unknown weight"):
        grouped_dispatch.explain_grouped("llm_int8", **qwen)


def test_choose_grouped_plan_reads_the_stack_and_the_variant():
    e, n, k = 4, 256, 128  # zeros: dispatch reads shapes and formats only
    ex = ExpertWeights(stack=quant.Weight4bit(
        packed=np.zeros((e, n * k // 2), np.uint8), absmax=np.zeros((e, n * k // 64), np.float32),
        code=np.zeros((e, 16), np.float32), shape=(n, k)), num_experts=e).validate()
    plan = grouped_dispatch.choose_grouped_plan(ex, 64, "auto", dtype="bfloat16", device=HOPPER)
    assert plan.fwd == "mgpu_grouped_dot"  # K = 128: the decoding kernel would run one warpgroup, slower
    wide = ExpertWeights(stack=quant.Weight4bit(
        packed=np.zeros((e, n * 2 * k // 2), np.uint8), absmax=np.zeros((e, n * 2 * k // 64), np.float32),
        code=np.zeros((e, 16), np.float32), shape=(n, 2 * k)), num_experts=e).validate()
    assert grouped_dispatch.choose_grouped_plan(wide, 64, "auto", dtype="bfloat16", device=HOPPER).fwd == \
        "mgpu_grouped_dot_4bit"
    assert grouped_dispatch.choose_grouped_plan(ex, 64, "xla", device=HOPPER) == dispatch.Plan("xla")
    with pytest.raises(dispatch.BackendError, match="no grouped kernel variant named"):
        grouped_dispatch.choose_grouped_plan(ex, 64, "pallas", variant="dequant_dot", device=HOPPER)
    with pytest.raises(dispatch.BackendError, match="not a forward product"):
        grouped_dispatch.choose_grouped_plan(ex, 64, "pallas", variant="mgpu_grouped_dot_t", dtype="bfloat16",
                                             device=HOPPER)


def test_every_grouped_row_is_reachable():
    """Each row of GROUPED_RULES is the chosen one for some M, dtype and backend on a GPU."""
    kinds = {"4bit": "nf4", "int8": "int8", "dense": "dense"}
    for r in grouped_dispatch.GROUPED_RULES:
        e = [grouped_dispatch.explain_grouped(kinds[r.weight], m, 768, 2048, 128, blocksize=bs, dtype=dt, device=d,
                                              backend=b)
             for m in (0, 4096) for dt in ("bfloat16", "float32") for b in ("auto", "pallas") for d in (HOPPER, GPU)
             for bs in (32, 64)]
        assert any((r.product, r.variant or "xla", "chosen") in x.rows for x in e), r


def test_docs_show_the_grouped_table_as_it_is():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "kernels.md")) as f:
        doc = f.read()
    assert grouped_dispatch.grouped_markdown_table() in doc, (
        "docs/kernels.md: the grouped dispatch table differs from GROUPED_RULES; paste "
        "jqlora.ops.grouped_dispatch.grouped_markdown_table()")


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_interpret_backend_runs_the_triton_kernels_and_agrees_with_xla(fmt):
    """qgmm through the Triton grouped kernels in interpret mode (the 4-bit one decoding tiles
    itself), forward and dx, against the xla backend on ragged groups."""
    ex = make_experts(fmt, 3, 32, 128, seed=5)
    gs = jnp.asarray([9, 0, 50], jnp.int32)
    x = jax.random.normal(jax.random.key(3), (70, 128), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(4), (70, 32), jnp.float32)
    # the plan CI runs (on a GPU the "gpu and 16-bit x" rows take the dense Triton kernel instead)
    plan = ops.choose_grouped_plan(ex, 70, "interpret", dtype="bfloat16", device=dispatch.Device("cpu"))
    assert plan.fwd == ("grouped_dot_4bit" if fmt == "nf4" else "grouped_dot")

    def run(backend):
        y, vjp = jax.vjp(lambda x: ops.qgmm(x, gs, ex, backend=backend, out_dtype=jnp.float32), x)
        return y, vjp(dy)[0]

    (y, dx), (y0, dx0) = jax.jit(lambda: run("interpret"))(), jax.jit(lambda: run("xla"))()
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx0, np.float32), rtol=1e-2, atol=1e-2)
    assert not np.asarray(y[59:]).any() and not np.asarray(dx[59:], np.float32).any()


def test_explain_kernel_cli_explains_the_grouped_product(capsys):
    import json

    from cli_runner import run_cli

    argv = ("explain-kernel", "--weight", "nf4", "--m", 16384, "--n", 768, "--k", 2048, "--experts", 128,
            "--device", "hopper")
    rc, out, err = run_cli(capsys, *argv)
    want = grouped_dispatch.explain_grouped("nf4", 16384, 768, 2048, 128, device=HOPPER)
    assert rc == 0 and out == str(want) + "\n", err
    rc, out, err = run_cli(capsys, *argv, "--json")
    assert rc == 0 and json.loads(out)["fwd"] == "mgpu_grouped_dot_4bit", err
    rc, out, err = run_cli(capsys, "explain-kernel", "--weight", "dense", "--m", 8, "--n", 64, "--k", 64,
                           "--experts", 4, "--device", "cpu", "--json")
    assert rc == 0 and json.loads(out)["backend"] == "xla", err
    for argv, msg in ((("--weight", "dense"), "--weight: 'dense' is not one of"),
                      (("--weight", "nf4", "--experts", "0"), "--experts: expected a positive integer"),
                      (("--weight", "llm_int8", "--experts", "4"), "--weight: 'llm_int8' is not one of")):
        rc, out, err = run_cli(capsys, "explain-kernel", *argv, "--m", 1, "--n", 64, "--k", 64)
        assert rc == 2 and out == "" and msg in err and len(err.strip().splitlines()) == 1, (argv, err)
