"""qmatmul: shapes, dtypes, gradients, residuals, transformations, backends, and bitsandbytes agreement."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp
try:  # public in newer jax; jax 0.10 keeps it private (print_saved_residuals is its public face)
    from jax.ad_checkpoint import saved_residuals
except ImportError:
    from jax._src.ad_checkpoint import saved_residuals
from jax.test_util import check_grads

from jqlora import ops, quant
from jqlora.ops import BackendError
from pallas_kernels.reference.fourbit import denest_absmax_reference


def _weights(n=48, k=128, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32) * 0.05
    return w, {
        "nf4": quant.quantize_4bit(w, "nf4", 64, True),
        "fp4": quant.quantize_4bit(w, "fp4", 32, False),
        "int8": quant.quantize_int8(w),
    }


def _lora(n, k, r=4, seed=1):
    ka, kb = jax.random.split(jax.random.key(seed))
    return jax.random.normal(ka, (r, k)) * 0.1, jax.random.normal(kb, (n, r)) * 0.1


def _oracle(x, q, lora=None, dtype=jnp.float64):
    """float64 numpy: x @ dequant(W).T (+ s (x A^T) B^T)."""
    w = np.asarray(quant.dequantize(q, jnp.float32), np.float64)
    x = np.asarray(x, np.float64)
    y = x @ w.T
    if lora is not None:
        a, b, s = lora
        y = y + s * (x @ np.asarray(a, np.float64).T) @ np.asarray(b, np.float64).T
    return y


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("lead", [(5,), (2, 3), (2, 2, 3), (1, 2, 2, 3), ()])
def test_any_rank_in_same_rank_out(kind, lead):
    _, qs = _weights()
    q = qs[kind]
    x = jax.random.normal(jax.random.key(2), (*lead, 128), jnp.float32)
    y = ops.qmatmul(x, q, backend="xla")
    assert y.shape == (*lead, 48)
    np.testing.assert_allclose(np.asarray(y), _oracle(x.reshape(-1, 128), q).reshape(*lead, 48), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_lora_forward_matches_float64(kind):
    _, qs = _weights()
    a, b = _lora(48, 128)
    x = jax.random.normal(jax.random.key(3), (3, 7, 128), jnp.float32)
    y = ops.qmatmul(x, qs[kind], lora=(a, b, 0.5), backend="xla")
    ref = _oracle(x.reshape(-1, 128), qs[kind], (a, b, 0.5)).reshape(3, 7, 48)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


def test_compute_dtype_is_an_argument_not_the_stored_dtype():
    w, _ = _weights()
    q16 = quant.quantize_4bit(w.astype(jnp.float16), "nf4", 64, True)
    assert q16.stored_dtype == "float16"
    x = jax.random.normal(jax.random.key(4), (4, 128), jnp.bfloat16)
    y = ops.qmatmul(x, q16, backend="xla")  # fp16-stored weight, bf16 activations
    assert y.dtype == jnp.bfloat16
    y32 = ops.qmatmul(x, q16, compute_dtype=jnp.float32, backend="xla")
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y32), _oracle(x.astype(jnp.float32), q16), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y32), rtol=2e-2, atol=2e-2)


def test_bf16_then_fp16_models_in_one_process():
    """bitsandbytes once kept a global dequant buffer keyed without the dtype: a second model in
    another dtype got the first model's buffer. Here one quantized weight is used in bf16 and fp16
    in both orders, eager and jitted: each dequantization must be bit for bit the fp32 weight
    rounded once to its own dtype, and each product must match its own dtype's float64 reference
    far closer than the other dtype's (checked to differ, so a stale buffer cannot pass)."""
    bf16, fp16 = jnp.bfloat16, jnp.float16
    w, _ = _weights(n=40, k=192, seed=11)  # a shape no other test here uses: no entry from before
    q = quant.quantize_4bit(w, "nf4", 64, True)
    w32 = quant.dequantize(q, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (16, 192), jnp.float32)
    f = jax.jit(lambda x, q: ops.qmatmul(x, q, backend="xla"))

    def ref(dt):  # x and W each rounded once to dt, the product in float64
        return np.asarray(x.astype(dt), np.float64) @ np.asarray(w32.astype(dt), np.float64).T

    refs = {bf16: ref(bf16), fp16: ref(fp16)}
    y_fp = np.asarray(f(x.astype(fp16), q), np.float64)
    err = np.abs(y_fp - refs[fp16]).max()
    assert np.abs(y_fp - refs[bf16]).max() > 4 * err  # the references tell the dtypes apart
    for order in ((bf16, fp16), (fp16, bf16), (bf16, fp16)):
        for dt in order:
            wd = quant.dequantize(q, dt)
            assert wd.dtype == dt
            np.testing.assert_array_equal(np.asarray(wd, np.float32), np.asarray(w32.astype(dt), np.float32))
            for y in (f(x.astype(dt), q), ops.qmatmul(x.astype(dt), q, backend="xla")):
                assert y.dtype == dt
                other = refs[fp16 if dt == bf16 else bf16]
                mine = np.abs(np.asarray(y, np.float64) - refs[dt]).max()
                assert mine <= 2 * (err if dt == fp16 else np.abs(refs[bf16]).max() * 2.0 ** -8)
                if dt == fp16:
                    assert mine < np.abs(np.asarray(y, np.float64) - other).max() / 2


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_no_dense_weight_among_residuals(kind, with_lora):
    """Invariant 2: the backward pass keeps packed weights and scales, never a dense (N, K) array."""
    n, k = 256, 512  # N*K far larger than any legitimate residual here
    w, _ = _weights(n, k)
    q = quant.quantize_4bit(w, "nf4", 64, True) if kind == "nf4" else quant.quantize_int8(w)
    a, b = _lora(n, k)
    x = jax.random.normal(jax.random.key(6), (2, 8, k), jnp.float32)

    def loss(x, a, b):
        return jnp.sum(ops.qmatmul(x, q, lora=(a, b, 2.0) if with_lora else None, backend="xla") ** 2)

    avals = [aval for aval, _ in saved_residuals(loss, x, a, b)]
    shapes = [tuple(v.shape) for v in avals]
    assert shapes, "expected some residuals"
    for v in avals:  # the int8 weight's CB is itself (N, K) int8: the quantized weight, not a dense copy
        if jnp.issubdtype(v.dtype, jnp.floating):
            assert int(np.prod(v.shape)) < n * k, f"float residual {v.shape} is as large as the dense weight"
    total = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in avals)
    packed = q.packed.nbytes if kind == "nf4" else q.cb.nbytes
    activations = x.nbytes + 2 * a.nbytes + 2 * b.nbytes + x.size // k * 4 * 16
    assert total <= packed * 1.2 + activations, f"residuals hold {total} bytes: more than packed weights + activations"



def test_frozen_weight_gets_zero_cotangent():
    _, qs = _weights()
    x = jnp.ones((2, 128))
    g = jax.grad(lambda q: jnp.sum(ops.qmatmul(x, q, backend="xla")), allow_int=True)(qs["nf4"])
    assert g.packed.dtype == jax.dtypes.float0 and g.absmax.dtype == jax.dtypes.float0
    assert float(jnp.abs(g.nested_absmax).max()) == 0.0 and float(jnp.abs(g.code).max()) == 0.0


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_lora_bf16_output_is_the_sum_of_two_rounded_branches(kind):
    """In bf16 the base product and the LoRA term are each rounded to bf16, then added (PEFT's
    order); the gradient w.r.t. x likewise (dY B enters as a bf16 hi/lo pair). No float32
    (M, N) intermediate is formed."""
    _, qs = _weights()
    a, b = _lora(48, 128)
    x = jax.random.normal(jax.random.key(4), (6, 128), jnp.float32).astype(jnp.bfloat16)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    y = ops.qmatmul(x, qs[kind], lora=(a, b, 0.5), backend="xla")
    xa = jnp.dot(x, a16.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    term = (0.5 * jnp.dot(xa, b16.T, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
    base = ops.qmatmul(x, qs[kind], backend="xla")
    assert y.dtype == base.dtype == term.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(base + term, np.float32))
    dy = jax.random.normal(jax.random.key(5), (6, 48), jnp.float32).astype(jnp.bfloat16)
    dx = jax.vjp(lambda x: ops.qmatmul(x, qs[kind], lora=(a, b, 0.5), backend="xla"), x)[1](dy)[0]
    dx_base = jax.vjp(lambda x: ops.qmatmul(x, qs[kind], backend="xla"), x)[1](dy)[0]
    u = jnp.dot(dy, b16, preferred_element_type=jnp.float32)
    hi = u.astype(jnp.bfloat16)  # dY B as a bf16 pair: bf16 GEMMs, about 16 bits of u
    lo = (u - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    dx_term = (0.5 * (jnp.dot(hi, a16, preferred_element_type=jnp.float32)
                      + jnp.dot(lo, a16, preferred_element_type=jnp.float32))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_base + dx_term, np.float32))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_check_grads_xla_backend(kind):
    _, qs = _weights(24, 64)
    a, b = _lora(24, 64, r=3)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (5, 64), jnp.float64)
        # jitted: each of check_grads' evaluations is one compiled program, not one per eager op
        f = jax.jit(lambda x, a, b: ops.qmatmul(x, qs[kind], lora=(a, b, 1.5), backend="xla"))
        check_grads(f, (x, a.astype(jnp.float64), b.astype(jnp.float64)), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_lora_gradients_match_autodiff_of_dense_reference():
    w, qs = _weights()
    q = qs["nf4"]
    wd = quant.dequantize(q, jnp.float32)
    a, b = _lora(48, 128)
    x = jax.random.normal(jax.random.key(8), (2, 5, 128))
    f = lambda x, a, b: jnp.sum(jnp.tanh(ops.qmatmul(x, q, lora=(a, b, 2.0), backend="xla")))
    g = lambda x, a, b: jnp.sum(jnp.tanh(x @ wd.T + 2.0 * (x @ a.T) @ b.T))
    for got, want in zip(jax.grad(f, (0, 1, 2))(x, a, b), jax.grad(g, (0, 1, 2))(x, a, b)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_jit_vmap_checkpoint():
    _, qs = _weights()
    q = qs["nf4"]
    a, b = _lora(48, 128)
    xs = jax.random.normal(jax.random.key(9), (3, 4, 128))
    f = lambda x: ops.qmatmul(x, q, lora=(a, b, 1.0), backend="xla")
    want = np.stack([np.asarray(f(x)) for x in xs])
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(xs)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(f))(xs)), want, rtol=1e-5, atol=1e-5)
    loss = lambda x: jnp.sum(jax.checkpoint(f)(x) ** 2)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(loss))(xs[0])),
                               np.asarray(jax.grad(lambda x: jnp.sum(f(x) ** 2))(xs[0])), rtol=1e-5, atol=1e-5)
    # vmap over a batch of stacked weights (e.g. scanned layers)
    w2 = jax.random.normal(jax.random.key(10), (48, 128)) * 0.05
    stacked = jax.tree_util.tree_map(lambda *l: jnp.stack(l), q, quant.quantize_4bit(w2, "nf4", 64, True))
    ys = jax.vmap(lambda qq: ops.qmatmul(xs[0], qq, backend="xla"))(stacked)
    np.testing.assert_allclose(np.asarray(ys[0]), np.asarray(ops.qmatmul(xs[0], q, backend="xla")), rtol=1e-6, atol=1e-6)


def test_named_sharding_inputs():
    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip("needs 2 host devices (XLA_FLAGS set in conftest)")
    mesh = jax.sharding.Mesh(np.array(devs[:2]), ("data",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    _, qs = _weights()
    a, b = _lora(48, 128)
    x = jax.device_put(jax.random.normal(jax.random.key(11), (8, 128)), sh)
    f = jax.jit(jax.grad(lambda x, a: jnp.sum(ops.qmatmul(x, qs["nf4"], lora=(a, b, 1.0), backend="xla") ** 2), (0, 1)))
    gx, ga = f(x, a)
    gx_ref, ga_ref = jax.grad(lambda x, a: jnp.sum(ops.qmatmul(x, qs["nf4"], lora=(a, b, 1.0), backend="xla") ** 2), (0, 1))(np.asarray(x), a)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(ga_ref), rtol=1e-5, atol=1e-5)


def test_dense_weight_is_frozen_and_works():
    w, _ = _weights()
    x = jax.random.normal(jax.random.key(12), (3, 128))
    np.testing.assert_allclose(np.asarray(ops.qmatmul(x, w)), np.asarray(x @ w.T), rtol=1e-5, atol=1e-6)
    gw = jax.grad(lambda w: jnp.sum(ops.qmatmul(x, w)))(w)
    assert float(jnp.abs(gw).max()) == 0.0


def _all_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, those of its sub-jaxprs (custom_vjp, pjit, ...) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _dot_operand_dtypes(jaxpr):
    """(lhs dtype, rhs dtype, lhs shape, rhs shape) of every dot_general in `jaxpr`, sub-jaxprs included."""
    return [(a.dtype, b.dtype, a.shape, b.shape)
            for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
            for a, b in [(v.aval for v in e.invars)]]


@pytest.mark.parametrize("kind", ["dense", "nf4", "int8"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_bf16_forward_and_backward_dots_take_bf16_operands(kind, with_lora):
    """In bf16 every dot of forward and backward takes bf16 operands (float32 accumulation). Two
    paths used float32 GEMMs: autodiff of a frozen dense product (`dot(x, w, f32).astype(bf16)`
    hands the transposed dot a float32 cotangent and XLA widens W: the 8B LM head's backward ran
    at 144 TFLOP/s on an H200), and the LoRA backward's float32 dY B, which made dx's LoRA term
    and dA HIGHEST-precision float32 GEMMs over an (M, K) activation."""
    n, k = 256, 128
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.float32) * 0.05
    q = {"dense": w.astype(jnp.bfloat16), "nf4": quant.quantize_4bit(w, "nf4", 64, True),
         "int8": quant.quantize_int8(w)}[kind]
    x = jax.random.normal(jax.random.key(1), (2, 8, k), jnp.bfloat16)
    lora = (jnp.ones((4, k), jnp.bfloat16), jnp.ones((n, 4), jnp.bfloat16), 0.5) if with_lora else None

    def loss(x):
        return jnp.sum(ops.qmatmul(x, q, lora=lora, backend="xla").astype(jnp.float32) ** 2)

    dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(x))
    assert len(dots) >= (7 if with_lora else 2)  # forward and backward products
    wide = [d for d in dots if jnp.float32 in (d[0], d[1])]
    assert wide == [], f"float32 dot operands: {wide}"


def test_dense_weight_gradient_matches_float64():
    """The frozen dense product's custom backward: dx = dy @ W for bf16 and float32 operands, and
    check_grads in float64 (the LoRA path through the same function included)."""
    n, k = 96, 80
    w = jax.random.normal(jax.random.key(2), (n, k), jnp.float32) * 0.1
    x = jax.random.normal(jax.random.key(3), (5, k), jnp.float32)
    dy = jax.random.normal(jax.random.key(4), (5, n), jnp.float32)
    for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        xd, wd, dyd = x.astype(dt), w.astype(dt), dy.astype(dt)
        _, pull = jax.vjp(lambda x: ops.qmatmul(x, wd), xd)
        (dx,) = pull(dyd)
        assert dx.dtype == dt
        ref = np.asarray(dyd, np.float64) @ np.asarray(wd, np.float64)
        np.testing.assert_allclose(np.asarray(dx, np.float64), ref, rtol=tol, atol=tol)
    with jax.enable_x64(True):
        a, b = _lora(n, k)
        w64, x64 = w.astype(jnp.float64), x.astype(jnp.float64)
        check_grads(lambda x: ops.qmatmul(x, w64), (x64,), order=1, modes=["rev"])
        check_grads(lambda x, a, b: ops.qmatmul(x, w64, lora=(a, b, 0.7)), (x64, a.astype(jnp.float64),
                    b.astype(jnp.float64)), order=1, modes=["rev"])


def test_backend_errors_are_explicit():
    _, qs = _weights()
    x = jnp.ones((2, 128))
    if jax.default_backend() != "gpu":
        with pytest.raises(BackendError, match="needs a GPU"):
            ops.qmatmul(x, qs["nf4"], backend="pallas")
    with pytest.raises(BackendError, match="unknown backend"):
        ops.qmatmul(x, qs["nf4"], backend="cuda")
    odd = quant.quantize_4bit(jnp.ones((8, 96)), "nf4", 64, False)  # 96 % 64 != 0: blocks span rows
    with pytest.raises(BackendError, match="multiple of the blocksize"):
        ops.qmatmul(jnp.ones((2, 96)), odd, backend="interpret")
    y = ops.qmatmul(jnp.ones((2, 96)), odd)  # auto on CPU: the xla reference handles it
    np.testing.assert_allclose(np.asarray(y), _oracle(np.ones((2, 96)), odd), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        ops.qmatmul(jnp.ones((2, 64)), qs["nf4"])
    with pytest.raises(ValueError, match="LoRA shapes"):
        ops.qmatmul(x, qs["nf4"], lora=(jnp.ones((4, 64)), jnp.ones((48, 4)), 1.0))
    with pytest.raises(BackendError, match="dense weight"):
        ops.qmatmul(x, jnp.ones((48, 128)), backend="interpret")


# ---- kernel backend (Pallas interpret mode on CPU; compiled kernels on a GPU) -------------------

KB = "pallas" if jax.default_backend() == "gpu" else "interpret"

@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("lead", [(3,), (2, 1, 65)])  # small-M and tiled paths; 4-D input
def test_interpret_backend_gradients_agree_with_xla(kind, lead):
    w = jax.random.normal(jax.random.key(13), (72, 192)) * 0.05
    q = quant.quantize_4bit(w, "nf4", 64, True) if kind == "nf4" else quant.quantize_int8(w)
    a, b = _lora(72, 192)
    x = jax.random.normal(jax.random.key(14), (*lead, 192))
    f = lambda x, a, b, bk: jnp.sum(jnp.tanh(ops.qmatmul(x, q, lora=(a, b, 2.0), backend=bk)))
    y_i = ops.qmatmul(x, q, lora=(a, b, 2.0), backend=KB)
    assert y_i.shape == (*lead, 72)
    np.testing.assert_allclose(np.asarray(y_i), np.asarray(ops.qmatmul(x, q, lora=(a, b, 2.0), backend="xla")),
                               rtol=1e-5, atol=1e-5)
    for gi, gx in zip(jax.grad(f, (0, 1, 2))(x, a, b, KB), jax.grad(f, (0, 1, 2))(x, a, b, "xla")):
        np.testing.assert_allclose(np.asarray(gi), np.asarray(gx), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3])
def test_interpret_backend_nested_weight_small_m(m):
    """A double-quantized weight at decode sizes: the small-M kernel gets the uint8 scale codes
    and de-nests them itself (no fp32 (N, K/bs) scale array); same result as the xla path."""
    n, k = 40, 512  # 320 scale blocks: the last nested block is short; N ragged vs block_n
    w = jax.random.normal(jax.random.key(17), (n, k)) * 0.05
    q = quant.quantize_4bit(w, "nf4", 64, True)
    codes = q.absmax.reshape(n, k // 64)
    np.testing.assert_array_equal(  # the kernel package's de-nest oracle is jqlora's, bit for bit
        np.asarray(jax.jit(denest_absmax_reference)(codes, q.nested_absmax, q.nested_code, q.offset)),
        np.asarray(jax.jit(quant.absmax_f32)(q)).reshape(n, k // 64))
    x = jax.random.normal(jax.random.key(18), (m, k))
    f = lambda x: ops.qmatmul(x, q, backend=KB)
    text = str(jax.make_jaxpr(f)(x))
    assert "u8[40,8]" in text and "f32[40,8]" not in text, "nested scales were de-nested outside the kernel"
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(ops.qmatmul(x, q, backend="xla")), rtol=1e-5, atol=1e-5)


def test_interpret_backend_bf16_matches_reference():
    w = jax.random.normal(jax.random.key(15), (64, 128)) * 0.05
    q = quant.quantize_4bit(w, "fp4", 32, False)
    x = jax.random.normal(jax.random.key(16), (2, 3, 128), jnp.bfloat16)
    y = ops.qmatmul(x, q, backend=KB)
    assert y.dtype == jnp.bfloat16
    ref = _oracle(np.asarray(x, np.float32).reshape(-1, 128), q).reshape(2, 3, 64)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2e-2, atol=2e-2)


def test_auto_plan_on_a_gpu_follows_the_measured_defaults(monkeypatch):
    """What `auto` runs on a GPU (benchmarks/results): small M streams the weight once, large M
    dequantizes once per call for the vendor GEMM; LLM.int8 numerics stay on the jnp path."""
    from jqlora.ops import dispatch

    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    _, qs = _weights(64, 128)
    plan = lambda kind, m, **kw: dispatch.choose_plan(qs[kind], m, "auto", **kw)
    assert plan("nf4", 1) == dispatch.Plan("pallas", "gemv_block_scaled", "dequant_dot_t")
    assert plan("nf4", 2) == dispatch.Plan("pallas", "gemv_block_scaled", "dequant_dot_t")
    for m in (3, 4, 16, 17, 32):
        assert plan("nf4", m) == dispatch.Plan("pallas", "block_scaled_dot_prmt", "dequant_dot_t")
    for m in (33, 48, 64):
        assert plan("nf4", m) == dispatch.Plan("pallas", "decoded_dot_prmt", "dequant_dot_t")
    assert plan("nf4", 65) == dispatch.Plan("pallas", "dequant_dot", "dequant_dot_t")
    assert plan("int8", 64) == dispatch.Plan("pallas", "int8_weight_only_splitk", "int8_dequant_dot_t")
    assert plan("int8", 65) == dispatch.Plan("pallas", "int8_dequant_dot", "int8_dequant_dot_t")
    assert plan("int8", 1, numerics="llm_int8") == dispatch.Plan("xla")
    assert dispatch.choose_plan(qs["nf4"], 1, "xla") == dispatch.Plan("xla")


def _weight_sized_copies(jaxpr, size):
    """(primitive, shape) of every pad / slice / concatenate in `jaxpr` (sub-jaxprs included)
    whose output has at least `size` elements."""
    return [(e.primitive.name, tuple(e.outvars[0].aval.shape)) for e in _all_eqns(jaxpr.jaxpr)
            if e.primitive.name in ("pad", "slice", "concatenate")
            and max(v.aval.size for v in e.outvars) >= size]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("k,n", [(11008, 4096), (18944, 3584), (3584, 3584), (13824, 5120)])
@pytest.mark.parametrize("m", [1, 48, 2048])
def test_kernel_paths_do_not_copy_real_checkpoint_weights(kind, k, n, m):
    """In and out features of real checkpoints (Llama-2 7B/13B MLP, Qwen2.5-7B) through the
    kernels `auto` picks on a GPU, forward and backward: no pad or slice of a weight-sized array.
    The INT8 split-K kernel padded a (4096, 11008) CB to 11264 columns on every call (its K splits
    did not divide the 43 K tiles), and the INT8 dequant kernel's 512-column tiles did the same."""
    w = jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
    q = jax.eval_shape(lambda w: quant.quantize_int8(w) if kind == "int8"
                       else quant.quantize_4bit(w, "nf4", 64, True), w)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)

    def fwd_bwd(x, q):
        y, pull = jax.vjp(lambda x: ops.qmatmul(x, q, backend=KB), x)
        return y, pull(jnp.ones_like(y))

    assert _weight_sized_copies(jax.make_jaxpr(fwd_bwd)(x, q), n * k // 8) == []


def test_variant_choice_is_explicit():
    _, qs = _weights(64, 128)
    x = jnp.ones((4, 128))
    y = ops.qmatmul(x, qs["nf4"], backend=KB, variant="fused_tiled")
    np.testing.assert_allclose(np.asarray(y), _oracle(np.ones((4, 128)), qs["nf4"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(BackendError, match="implements"):
        ops.qmatmul(x, qs["nf4"], backend=KB, variant="int8_weight_only")
    with pytest.raises(KeyError, match="no kernel variant"):
        ops.qmatmul(x, qs["nf4"], backend=KB, variant="nope")


# ---- agreement with bitsandbytes on CPU ------------------------------------------------------

@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_agrees_with_bitsandbytes_matmul_4bit(dtype, quant_type):
    """Same packed weight through bnb.matmul_4bit (dequantize to x.dtype, then linear) and qmatmul.

    fp32: both compute dequant(W) exactly (bit-exact dequant) and a fp32 GEMM, so only the
    summation order differs: rtol 1e-5. bf16: the operands are identical bf16 values, products
    accumulate in fp32 on both sides, and each rounds once to bf16: within 1 bf16 ulp (2^-8).
    """
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    F = bnb.functional
    tdt = getattr(torch, dtype)
    w = torch.randn(96, 256, dtype=torch.float32, generator=torch.Generator().manual_seed(0)).to(tdt) * 0.05
    packed, st = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=True)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1)).to(tdt)
    y_bnb = bnb.matmul_4bit(x, packed.t(), st).float().numpy()
    q = quant.Weight4bit(
        packed=jnp.asarray(packed.numpy().reshape(-1)), absmax=jnp.asarray(st.absmax.numpy()),
        code=jnp.asarray(st.code.numpy()), nested_absmax=jnp.asarray(st.state2.absmax.numpy()),
        nested_code=jnp.asarray(st.state2.code.numpy()), offset=jnp.asarray(st.offset.numpy()),
        shape=(96, 256), quant_type=quant_type, blocksize=64, stored_dtype=dtype).validate()
    xj = jnp.asarray(x.float().numpy()).astype(dtype)
    for backend in ("xla", KB):
        y = np.asarray(ops.qmatmul(xj, q, backend=backend), np.float32)
        if dtype == "float32":
            np.testing.assert_allclose(y, y_bnb, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(y, y_bnb, rtol=2 ** -7, atol=2 ** -7 * np.abs(y_bnb).max())


@pytest.mark.torch
def test_llm_int8_numerics_agree_with_bitsandbytes_linear8bitlt():
    """numerics='llm_int8' reproduces bnb's Linear8bitLt inference (int8 activations, threshold 6)."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data = torch.randn(64, 128, generator=g) * 0.05
    m = bnb.nn.Linear8bitLt(128, 64, bias=False, has_fp16_weights=False, threshold=6.0)
    m.weight = bnb.nn.Int8Params(lin.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    m = m.to("cpu").eval()
    if m.weight.dtype != torch.int8:
        pytest.skip("this bitsandbytes build does not quantize Int8Params on CPU")
    q = quant.Int8Weight(cb=jnp.asarray(m.weight.data.numpy()), scb=jnp.asarray(m.weight.SCB.numpy()), threshold=6.0)
    x = torch.randn(3, 4, 128, generator=g).half()
    x[0, 0, 5] = 9.0  # an outlier column
    with torch.no_grad():
        y_bnb = m(x).float().numpy()  # (the forward moves CB/SCB into m.state: read them first)
    for backend in ("xla", KB):
        y = np.asarray(ops.qmatmul(jnp.asarray(x.numpy()), q, numerics="llm_int8", backend=backend), np.float32)
        np.testing.assert_allclose(y, y_bnb, rtol=2e-3, atol=2e-3)
