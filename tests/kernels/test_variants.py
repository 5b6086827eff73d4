"""Conformance suite: every registered kernel variant against its reference.

One parametrization over `registry.all_variants()`, so a new registration is tested with no list
to edit (the model: jax's parameterized Pallas tests, tokamax's one test base for every
implementation).

- Each variant runs at two small shapes chosen by its own `supports`: M = 1 (NF4, bf16 x, fp32
  output, fp32 scales) and an M > 1 (FP4, fp16 x, double-quantized scales where it
  `accepts_nested`); weights come from the project's quantizers (`jqlora.quant`). Variants with
  an interpret mode run in Pallas interpret mode on CPU, every variant runs compiled on a GPU
  that has its platform; the others skip with the reason.
- Mosaic GPU (sm90) variants lower for CUDA on CPU (a Mosaic GPU module must come out), and
  where the kernel module has a CPU emulation of its arithmetic (`emulate`), that is compared
  with the reference.
- Every variant: bad operands get a clear error naming the operand (sm90 variants also refuse
  interpret mode and 32-bit x), an empty batch gives an empty product, and the default config
  is valid wherever `supports` takes the shape (the module's `shape_problem` accepts it).

Tolerances come from `v.numerics`:
- against the variant's own reference: 4-bit dequantization bit for bit; 4-bit products the
  module tolerance of tests/kernels/test_kernels_4bit.py (1e-5 of the product scale + 2 ulps of the
  output); int8 classes the bounds of tests/kernels/test_kernels_int8.py;
- against one common oracle, the fp32 weight code * absmax (4-bit): the class's weight rounding
  bounds the distance, `_ROUNDING[numerics]` eps of x's dtype per product, so a variant labelled
  with the wrong numerics fails too.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora import quant
from pallas_kernels import registry
from pallas_kernels.reference.fourbit import denest_absmax_reference, dequantize_4bit_reference
from ir_fingerprint import _args as abstract_args
from ir_fingerprint import lowered_modules
from ir_fingerprint import MS as PROTOCOL_MS
from ir_fingerprint import SHAPES as PROTOCOL_SHAPES
from test_kernels_4bit import assert_matmul_close, scale_bwd, scale_fwd
from test_kernels_int8 import _activations, _assert_within, _llm_bound, _wo_bound

VARIANTS = registry.all_variants()
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
FOUR_BIT = ("matmul_4bit", "matmul_4bit_t", "dequantize_4bit")
# Per product, the distance of each 4-bit class's weight from the fp32 weight, in eps of x's
# dtype (u = eps / 2 is one rounding): none, one rounding of the weight or of the code, or two.
_ROUNDING = {"fp32_weight": 0.0, "rounded_weight": 0.5, "rounded_codes": 0.5,
             "rounded_codes_twice": 1.0}
# The two cases of every variant: (label, M candidates, N, K, blocksize, table, x dtype, output
# dtype, double-quantized scales); the first M the variant supports is taken, and N, K move to
# the Mosaic kernels' granularity (256, 1024) where the small shape is not supported.
_CASES = (
    ("m1", (1,), 72, 256, 64, "nf4", jnp.bfloat16, jnp.float32, False),
    ("many", (17, 3, 2), 64, 256, 128, "fp4", jnp.float16, None, True),
)
_MOSAIC_NK = (256, 1024)


def _bs(v, bs):
    return bs if v.op in FOUR_BIT else 0


def _case_shape(v, ms, n, k, bs):
    """The first (m, n, k, blocksize) of the case that `v` supports, or None."""
    for nn, kk in ((n, k), _MOSAIC_NK):
        for m in ms:
            if v.supports(m, nn, kk, _bs(v, bs)):
                return m, nn, kk, bs
    return None


def _params():
    out = []
    for v in VARIANTS:
        for label, ms, n, k, bs, table, dtype, out_dtype, nested in _CASES:
            out.append(pytest.param(v.name, label, id=f"{v.name}-{label}"))
    return out


PARAMS = _params()


# ------------------------------------------------------------------------------------------
# operands
# ------------------------------------------------------------------------------------------
def _weight_4bit(seed, n, k, bs, table, nested):
    """(packed (N, K/2), absmax as the kernel takes it, code, nested or None, fp32 absmax)."""
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32)
    q = quant.quantize_4bit(w, table, bs, double_quant=nested)
    packed = q.packed.reshape(n, k // 2)
    absmax = q.absmax.reshape(n, k // bs)
    if not nested:
        return packed, absmax, q.code, None, absmax
    nest = (q.nested_absmax, q.nested_code, q.offset)
    return packed, absmax, q.code, nest, denest_absmax_reference(absmax, *nest)


def _fp32_weight_product(op, a, packed, absmax_f32, code, bs, out_dtype):
    """The common oracle: a (as fp32) times the unrounded fp32 weight, fp32 sums."""
    w = dequantize_4bit_reference(packed, absmax_f32, code, blocksize=bs, out_dtype=jnp.float32)
    w = w.T if op == "matmul_4bit" else w
    y = jnp.dot(a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or a.dtype)


# ------------------------------------------------------------------------------------------
# the conformance test
# ------------------------------------------------------------------------------------------
def _runs_here(v) -> str | None:
    """None where `v` can run in this process, else why not."""
    if v.platform == "sm90" and not (ON_GPU and registry.platform_available("sm90")):
        return "Mosaic GPU kernel: needs a Hopper GPU (CPU: test_sm90_lowers_for_cuda)"
    if not v.interpret and not ON_GPU:
        return "no interpret mode"
    return None


@pytest.mark.parametrize("name,case", PARAMS)
def test_variant_matches_its_reference(name, case):
    v = registry.get(name)
    _, ms, n, k, bs, table, dtype, out_dtype, nested = next(c for c in _CASES if c[0] == case)
    shape = _case_shape(v, ms, n, k, bs)
    assert shape is not None, f"{name}: supports none of the conformance shapes of case {case}"
    why = _runs_here(v)
    if why:
        pytest.skip(f"{name}: {why}")
    m, n, k, bs = shape
    nested = nested and v.accepts_nested
    if v.op in FOUR_BIT:
        _check_4bit(v, m, n, k, bs, table, dtype, out_dtype, nested)
    else:
        _check_int8(v, m, n, k, dtype, out_dtype)


def _check_4bit(v, m, n, k, bs, table, dtype, out_dtype, nested):
    packed, absmax, code, nest, absmax_f32 = _weight_4bit(m + n + k, n, k, bs, table, nested)
    kw = dict(blocksize=bs, interpret=INTERPRET)
    if nest is not None:
        kw["nested"] = nest
    what = f"{v.name} M={m} N={n} K={k} bs={bs} {table} {jnp.dtype(dtype).name}" + (
        " nested" if nest else "")
    if v.op == "dequantize_4bit":
        got = v.fn(packed, absmax, code, out_dtype=dtype, **kw)
        want = v.reference(packed, absmax_f32, code, blocksize=bs, out_dtype=dtype)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8), err_msg=what)
        w32 = np.asarray(dequantize_4bit_reference(packed, absmax_f32, code, blocksize=bs),
                         np.float64)
        bound = _ROUNDING[v.numerics] * float(jnp.finfo(dtype).eps) * np.abs(w32)
        assert np.all(np.abs(np.asarray(got, np.float64) - w32) <= bound), what
        return
    a_shape = (m, k) if v.op == "matmul_4bit" else (m, n)
    a = jax.random.normal(jax.random.key(m * 7 + 1), a_shape, jnp.float32).astype(dtype)
    got = v.fn(a, packed, absmax, code, out_dtype=out_dtype, **kw)
    want = v.reference(a, packed, absmax_f32, code, blocksize=bs, out_dtype=out_dtype)
    w_c = dequantize_4bit_reference(packed, absmax_f32, code, blocksize=bs, out_dtype=dtype)
    scale = scale_fwd(a, w_c) if v.op == "matmul_4bit" else scale_bwd(a, w_c)
    eps_x = float(jnp.finfo(dtype).eps)
    # interpret mode: XLA's default --xla_allow_excess_precision may drop a rounded-weight
    # kernel's f32 -> 16-bit -> f32 round trip of the decoded weight (splitk_small_m's row-wise
    # path), which then multiplies the fp32 weight: at most one weight rounding per product
    slack = eps_x / 2 if (INTERPRET and v.numerics == "rounded_weight") else 0.0
    assert_matmul_close(got, want, scale, f"{what} vs its reference", slack=slack)
    oracle = _fp32_weight_product(v.op, a, packed, absmax_f32, code, bs, out_dtype)
    assert_matmul_close(got, oracle, scale, f"{what} vs the fp32 weight ({v.numerics})",
                        slack=_ROUNDING[v.numerics] * eps_x)


def _check_int8(v, m, n, k, dtype, out_dtype):
    rng = np.random.default_rng(m + n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = quant.quantize_int8(jnp.asarray(w))
    cb, scb = np.asarray(q.cb), np.asarray(q.scb)
    od = dtype if out_dtype is None else out_dtype
    what = f"{v.name} M={m} N={n} K={k} {jnp.dtype(dtype).name}"
    if v.numerics == "llm_int8":
        x = _activations(rng, m, k, dtype, outliers=True)
        got = v.fn(x, q.cb, q.scb, threshold=6.0, out_dtype=od, interpret=INTERPRET)
        want = v.reference(x, q.cb, q.scb, threshold=6.0, out_dtype=od)
        bound = _llm_bound(x, cb, scb, want, od)
    else:
        assert v.numerics == "int8_weight_only", (v.name, v.numerics)
        a_shape = (m, n) if v.op == "matmul_int8_t" else (m, k)
        a = jnp.asarray(rng.standard_normal(a_shape), dtype)
        got = v.fn(a, q.cb, q.scb, out_dtype=od, interpret=INTERPRET)
        want = v.reference(a, q.cb, q.scb, out_dtype=od)
        bound = _wo_bound(a, cb, scb, want, dtype, od, transpose=v.op == "matmul_int8_t")
    out_shape = (m, k) if v.op == "matmul_int8_t" else (m, n)
    assert got.shape == out_shape and got.dtype == jnp.dtype(od), (what, got.shape, got.dtype)
    _assert_within(got, want, bound, what)


def test_parametrization_covers_the_registry():
    """Exactly the registered variants, each at every case: a new registration is tested
    without editing a list, and a variant that supports no conformance shape fails above."""
    names = {p.values[0] for p in PARAMS}
    assert names == {v.name for v in registry.all_variants()}
    for v in registry.all_variants():
        assert {p.values[1] for p in PARAMS if p.values[0] == v.name} == {c[0] for c in _CASES}


# ------------------------------------------------------------------------------------------
# Mosaic GPU variants on CPU: lowering, and the emulation of their arithmetic
# ------------------------------------------------------------------------------------------
SM90 = [v.name for v in VARIANTS if v.platform == "sm90"]


def _protocol_shape(v):
    bs = 64
    for n, k in PROTOCOL_SHAPES:
        for m in PROTOCOL_MS:
            if v.supports(m, n, k, _bs(v, bs)):
                return m, n, k
    raise AssertionError(f"{v.name} supports none of the protocol shapes")


@pytest.mark.parametrize("name", SM90)
def test_sm90_lowers_for_cuda(name):
    """Pallas -> Mosaic GPU for an sm90 target on a machine without a GPU, with fp32 scales and
    (where the variant takes them) double-quantized ones: Mosaic modules, no Triton."""
    v = registry.get(name)
    m, n, k = _protocol_shape(v)
    args, kw = abstract_args(v.op, m, n, k)
    try:
        triton, mosaic = lowered_modules(lambda *a: v.fn(*a, interpret=False, **kw), args)
    except Exception as e:  # noqa: BLE001
        if "Unable to" in str(e) or "no CUDA" in str(e):  # pragma: no cover
            pytest.skip(f"this jax cannot lower Mosaic GPU kernels without a GPU: {e}")
        raise
    assert mosaic and not triton, (name, len(mosaic), len(triton))
    if v.accepts_nested:
        s = jax.ShapeDtypeStruct
        nested = (s((n * k // 64 // 256,), jnp.float32), s((256,), jnp.float32),
                  s((), jnp.float32))
        nargs = (*args[:2], s((n, k // 64), jnp.uint8), *args[3:], *nested)
        _, mosaic = lowered_modules(
            lambda *a: v.fn(*a[:4], nested=tuple(a[4:]), interpret=False, **kw), nargs)
        assert mosaic, name


def _module(v):
    """The kernel module that declares `v`."""
    return importlib.import_module(registry.module_of(v.name))


EMULATED = [v.name for v in VARIANTS if v.platform == "sm90" and hasattr(_module(v), "emulate")]


@pytest.mark.parametrize("name", EMULATED)
@pytest.mark.parametrize("m", [1, 2])
def test_sm90_emulation_matches_the_reference(name, m):
    """The kernel module's numpy emulation of its sums (its order, its default config) against
    the variant's reference, at the tolerance its numerics class gives."""
    v = registry.get(name)
    emulate = _module(v).emulate
    n, k, bs = 256, 1024, 64
    assert v.supports(m, n, k, bs), (name, m)
    packed, absmax, code, _, _ = _weight_4bit(m, n, k, bs, "nf4", False)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    cfg = v.default_config(m, n, k, bs)
    got = jnp.asarray(emulate(x, packed, absmax, code, blocksize=bs, cfg=cfg))
    want = v.reference(x, packed, absmax, code, blocksize=bs, out_dtype=jnp.float32)
    w_c = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=x.dtype)
    assert_matmul_close(got, want, scale_fwd(x, w_c), f"{name} emulation M={m}")
    oracle = _fp32_weight_product(v.op, x, packed, absmax, code, bs, jnp.float32)
    assert_matmul_close(got, oracle, scale_fwd(x, w_c), f"{name} emulation vs fp32 weight",
                        slack=_ROUNDING[v.numerics] * float(jnp.finfo(x.dtype).eps))


# ------------------------------------------------------------------------------------------
# metadata
# ------------------------------------------------------------------------------------------
def test_metadata_is_valid():
    int8_ops = ("matmul_int8", "matmul_int8_t", "llm_int8")
    for v in VARIANTS:
        assert v.status in registry.STATUSES and v.numerics in registry.NUMERICS, v.name
        assert v.description, v.name
        if v.op in int8_ops:
            assert v.numerics == ("llm_int8" if v.op == "llm_int8" else "int8_weight_only"), v
        else:
            assert v.numerics in _ROUNDING, (v.name, v.numerics)
        assert v.interpret == (v.platform == "gpu"), v.name
    assert {v.name for v in registry.defaults()} == {
        v.name for v in VARIANTS if v.status == "default"}
    ops_with_a_default = {v.op for v in registry.defaults()}
    assert ops_with_a_default == set(registry.OPS), set(registry.OPS) - ops_with_a_default


@pytest.mark.parametrize("field,value", [("numerics", "bf16_weight"), ("status", "best"),
                                         ("numerics", ""), ("config_type", int)])
def test_bad_metadata_names_the_variant(field, value):
    v = registry.get("dequant_dot")
    with pytest.raises(ValueError, match=f"variant 'dequant_dot'.*{field}"):
        dataclasses.replace(v, **{field: value})


def _supported_shapes(v):
    bs = 64 if v.op in FOUR_BIT else 0
    grid = [(m, n, k, bs) for m in (1, 3, 16, 48, 128)
            for n, k in ((72, 256), (256, 1024), (4096, 4096))]
    return [s for s in grid if v.supports(*s)]


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_default_config_is_a_config_of_its_type(name):
    """`default_config` returns a `config_type` instance (dataclass configs: `replace` works on
    it, as a tuning tool uses it), or with keyword configuration a dict whose keywords the
    kernel takes and which traces to the same program as the call without them."""
    v = registry.get(name)
    shapes = _supported_shapes(v)
    assert shapes, name
    if v.default_config is None:
        assert v.config_type is None, name
        return
    for m, n, k, bs in shapes[:2]:
        cfg = v.default_config(m, n, k, bs)
        if v.config_type is not None:
            assert isinstance(cfg, v.config_type), (name, cfg)
            assert dataclasses.replace(cfg) == cfg
            continue
        assert isinstance(cfg, dict) and cfg, (name, cfg)
        args, kw = abstract_args(v.op, m, n, k)
        plain = jax.make_jaxpr(lambda *a: v.fn(*a, interpret=False, **kw))(*args)
        given = jax.make_jaxpr(lambda *a: v.fn(*a, interpret=False, **kw, **cfg))(*args)
        assert str(plain) == str(given), (name, m, n, k, cfg)


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.config_type is not None])
def test_dataclass_default_config_is_the_default_program(name):
    """fn(config=default_config(...)) traces to the same program as fn() for the Mosaic kernels."""
    v = registry.get(name)
    m, n, k = _protocol_shape(v)
    args, kw = abstract_args(v.op, m, n, k)
    cfg = v.default_config(m, n, k, 64)
    plain = jax.make_jaxpr(lambda *a: v.fn(*a, interpret=False, **kw))(*args)
    given = jax.make_jaxpr(lambda *a: v.fn(*a, interpret=False, config=cfg, **kw))(*args)
    assert str(plain) == str(given), name


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_supports_is_a_pure_function_of_the_shape(name):
    """Same answer for the same (m, n, k, blocksize), in any order of calls, as a bool."""
    v = registry.get(name)
    bs = 64 if v.op in FOUR_BIT else 0
    grid = [(m, n, k, b) for m in (0, 1, 2, 5, 16, 17, 64, 65, 128, 1024)
            for n, k in ((72, 256), (256, 1024), (4096, 14336), (14336, 4096), (100, 96))
            for b in ({bs, 32, 128} if bs else {0})]
    first = [v.supports(*s) for s in grid]
    again = [v.supports(*s) for s in reversed(grid)][::-1]
    assert first == again, name
    assert all(isinstance(r, (bool, np.bool_)) for r in first), name
    assert any(first), name


# ------------------------------------------------------------------------------------------
# generic checks, every variant: operand errors, empty batches, default configs
# ------------------------------------------------------------------------------------------
def _concrete_args(v, m, n, k):
    """Zero operands of `v.fn` for an M-row product with an (N, K) weight, and its keywords."""
    args, kw = abstract_args(v.op, m, n, k)
    return [jnp.zeros(a.shape, a.dtype) for a in args], kw


def _call(v, args, kw, interpret=None):
    return v.fn(*args, interpret=v.interpret if interpret is None else interpret, **kw)


_CODE_SHAPE = r"`code` must be float32 of shape \(16,\)"


def _bad_operands(v):
    """(what is wrong, argument index, replacement, error regex) for the operands of `v.op`."""
    if v.op == "dequantize_4bit":
        return [("packed int8", 0, lambda p: p.astype(jnp.int8), "`packed` must be uint8"),
                ("absmax a column short", 1, lambda a: a[:, :-1], "`absmax` must have shape"),
                ("code of 8 entries", 2, lambda c: c[:8], _CODE_SHAPE)]
    if v.op in FOUR_BIT:
        return [("x a column short", 0, lambda x: x[:, :-1], "columns but the weight needs"),
                ("x of rank 1", 0, lambda x: x[0], "must be 2-D"),
                ("packed int8", 1, lambda p: p.astype(jnp.int8), "`packed` must be uint8"),
                ("absmax a column short", 2, lambda a: a[:, :-1], "`absmax` must have shape"),
                ("code of 8 entries", 3, lambda c: c[:8], _CODE_SHAPE)]
    return [("x a column short", 0, lambda x: x[:, :-1], "columns but cb has shape"),
            ("x of rank 1", 0, lambda x: x[0], "must be 2-D"),
            ("x of integers", 0, lambda x: x.astype(jnp.int32), "must be floating point"),
            ("cb float32", 1, lambda c: c.astype(jnp.float32), "cb must be int8"),
            ("scb a row short", 2, lambda s: s[:-1], "scb must have shape")]


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_bad_inputs_get_clear_errors(name):
    """Operands a kernel cannot take raise a ValueError naming the operand, before anything is
    lowered; the Mosaic GPU (sm90) variants also refuse interpret mode and float32 x."""
    v = registry.get(name)
    m, n, k, _ = _case_shape(v, (1,), 72, 256, 64)
    args, kw = _concrete_args(v, m, n, k)
    for what, i, bad, match in _bad_operands(v):
        broken = [bad(a) if j == i else a for j, a in enumerate(args)]
        with pytest.raises(ValueError, match=match):
            _call(v, broken, kw)
    if v.platform == "sm90":
        with pytest.raises(NotImplementedError, match="interpret"):
            _call(v, args, kw, interpret=True)
        wide = [args[0].astype(jnp.float32), *args[1:]]
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            _call(v, wide, kw)


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.op != "dequantize_4bit"])
def test_empty_batch_gives_an_empty_product(name):
    """M = 0 rows: an empty result of the product's shape and dtype, on every platform (the
    Mosaic GPU variants return before any kernel)."""
    v = registry.get(name)
    _, n, k, _ = _case_shape(v, (1,), 72, 256, 64)
    args, kw = _concrete_args(v, 0, n, k)
    y = _call(v, args, kw)
    cols = k if v.op.endswith("_t") else n
    assert y.shape == (0, cols) and y.dtype == args[0].dtype, (name, y.shape, y.dtype)


def _shapes():
    """Shapes at the Mosaic GPU kernels' granularity (N and K multiples of 256, up to 40960 and
    28672), M drawn for the GEMVs (1..2), the small-M kernels (1..64) or any (1..4096), and
    blocksizes 32..4096 (64 where K does not hold whole blocks)."""
    ms = st.one_of(st.integers(1, 2), st.integers(1, 64), st.integers(1, 4096))
    return st.tuples(ms, st.integers(1, 160).map(lambda a: 256 * a),
                     st.integers(1, 112).map(lambda a: 256 * a), st.integers(5, 12))


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.default_config is not None])
@settings(max_examples=100, deadline=None)
@given(shape=_shapes())
def test_default_config_is_valid_wherever_supported(name, shape):
    """Where `supports` takes a shape, `default_config` gives a config of the variant's
    `config_type` (or keywords its `fn` takes), and the module's `shape_problem` (the Mosaic
    GPU kernels') finds nothing wrong with it."""
    v = registry.get(name)
    m, n, k, log_bs = shape
    bs = 2 ** log_bs if k % 2 ** log_bs == 0 else 64
    bs = bs if v.op in FOUR_BIT else 0
    if not v.supports(m, n, k, bs):
        return
    cfg = v.default_config(m, n, k, bs)
    if v.config_type is not None:
        assert isinstance(cfg, v.config_type), (name, cfg)
    else:
        params = inspect.signature(v.fn).parameters
        assert isinstance(cfg, dict) and set(cfg) <= set(params), (name, cfg)
    shape_problem = getattr(_module(v), "shape_problem", None)
    if shape_problem is not None:
        assert shape_problem(m, n, k, bs, cfg) is None, (name, m, n, k, bs, cfg)
