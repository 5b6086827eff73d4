"""4-bit (NF4/FP4) Pallas kernels in interpret mode against their jnp references, and the
references against numpy (float32 bit patterns for dequant, float64 for the matmuls).

Tolerances (matmuls; the kernels accumulate in fp32 in a different order than XLA):
    |kernel - reference| <= 1e-5 * scale + 2 * eps(out_dtype) * |reference|
where scale = |x| @ |W|.T (the sum of absolute products behind each output) and eps is the
machine epsilon of the output dtype (2 ulps of the output value: one rounding each side).
Dequantization must be bit-exact.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels._compat import auto_interpret, cdiv, resolve_interpret
from pallas_kernels.reference.fourbit import (
    denest_absmax_reference, dequantize_4bit_reference, matmul_4bit_block_dot_reference,
    matmul_4bit_gemv_reference, matmul_4bit_reference, matmul_4bit_rounded_codes_reference,
    matmul_4bit_small_m_reference, matmul_4bit_t_reference, split_code_table)
from pallas_kernels.triton.block_scaled_dot import block_scaled_dot
from pallas_kernels.triton.dequant_tiled import dequant_tiled
from pallas_kernels.triton.gemv_block_scaled import gemv_block_scaled
from pallas_kernels.triton.matmul_4bit import dequant_dot, fused_tiled
from pallas_kernels.triton.matmul_4bit_t import dequant_dot_t, fused_tiled_t
from pallas_kernels.triton.splitk_small_m import splitk_small_m
from pallas_kernels import registry
from pallas_kernels.registry import OPS, Variant

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)
_FP4_POS = np.array([0, 1 / 192, 2 / 3, 1, 1 / 3, 1 / 2, 1 / 6, 1 / 4], dtype=np.float64)
FP4 = np.concatenate([_FP4_POS, -_FP4_POS]).astype(np.float32)
TABLES = {"nf4": NF4, "fp4": FP4}
# On a GPU the correctness tests run the compiled kernels; on CPU, Pallas interpret mode.
INTERPRET = jax.default_backend() != "gpu"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

# every 4-bit variant of the Triton lowering (the ones interpret mode runs), from the registry
TRITON_4BIT = tuple(v for v in registry.all_variants()
                    if v.platform == "gpu" and v.op in ("dequantize_4bit", "matmul_4bit",
                                                        "matmul_4bit_t"))


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def make_weight(seed, n, k, bs):
    """Random packed codes (all 256 byte values) and positive scales, with one all-zero block."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.05, 1.5, (n, k // bs)).astype(np.float32)
    absmax[0, 0] = 0.0
    return jnp.asarray(packed), jnp.asarray(absmax)


def make_nested(seed, n, k, bs):
    """Double-quantized scales: uint8 codes (N, K//bs), (nested_absmax, nested_code, offset), and
    the fp32 scales they stand for, de-nested in numpy as bitsandbytes does (the product rounded
    to fp32, then + offset). Nested absmax values differ a lot so a wrong block index shows."""
    rng = np.random.default_rng(seed)
    nb = n * (k // bs)
    codes = rng.integers(0, 256, (n, k // bs), dtype=np.uint8)
    nested_absmax = rng.uniform(0.05, 1.0, cdiv(nb, 256)).astype(np.float32)
    nested_code = np.sort(rng.uniform(-1.0, 1.0, 256)).astype(np.float32)
    offset = np.float32(rng.uniform(0.3, 1.0))
    prod = nested_code[codes.reshape(-1)] * nested_absmax[np.arange(nb) // 256]  # fp32 rounding
    absmax = (prod + offset).reshape(n, k // bs)
    nested = (jnp.asarray(nested_absmax), jnp.asarray(nested_code), jnp.asarray(offset))
    return jnp.asarray(codes), nested, jnp.asarray(absmax)


def make_x(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def np_dequant_f32(packed, absmax, code, bs):
    """Independent numpy dequant: float32 code[nibble] * float32 absmax (high nibble first)."""
    p = np.asarray(packed)
    n, kb = p.shape
    q = np.empty((n, 2 * kb), np.int64)
    q[:, 0::2] = p >> 4
    q[:, 1::2] = p & 15
    return np.asarray(code, np.float32)[q] * np.repeat(np.asarray(absmax, np.float32), bs, axis=1)


def assert_matmul_close(got, want, scale, what="", slack=0.0):
    """Within the module tolerance; `slack` * scale more where a known effect needs it."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    g = np.asarray(got.astype(jnp.float32), np.float64)
    w = np.asarray(want.astype(jnp.float32), np.float64)
    eps = float(jnp.finfo(got.dtype).eps)
    tol = (1e-5 + slack) * scale + 2 * eps * np.abs(w) + 1e-30
    err = np.abs(g - w)
    assert np.all(np.isfinite(g)), f"{what}: non-finite output"
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outside tolerance; worst "
                           f"err/tol={float(np.max(err / tol)):.3g}")


def scale_fwd(x, w_c):
    """|x| @ |W|.T in float64; w_c is the weight already cast to the compute dtype."""
    return np.abs(np.asarray(x.astype(jnp.float32), np.float64)) @ np.abs(
        np.asarray(w_c.astype(jnp.float32), np.float64)).T


def scale_bwd(dy, w_c):
    return np.abs(np.asarray(dy.astype(jnp.float32), np.float64)) @ np.abs(
        np.asarray(w_c.astype(jnp.float32), np.float64))


def check_forward(fn, m, n, k, bs, dtype, table, seed=0, reference=matmul_4bit_reference, **kw):
    packed, absmax = make_weight(seed, n, k, bs)
    code = jnp.asarray(TABLES[table])
    x = make_x(seed + 1, (m, k), dtype)
    got = fn(x, packed, absmax, code, blocksize=bs, interpret=INTERPRET, **kw)
    want = reference(x, packed, absmax, code, blocksize=bs, out_dtype=kw.get("out_dtype"))
    w_c = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=dtype)
    assert_matmul_close(got, want, scale_fwd(x, w_c), f"{fn.__name__} M={m} N={n} K={k} bs={bs}")


def check_backward(fn, m, n, k, bs, dtype, table, seed=0, **kw):
    packed, absmax = make_weight(seed, n, k, bs)
    code = jnp.asarray(TABLES[table])
    dy = make_x(seed + 2, (m, n), dtype)
    got = fn(dy, packed, absmax, code, blocksize=bs, interpret=INTERPRET, **kw)
    want = matmul_4bit_t_reference(dy, packed, absmax, code, blocksize=bs,
                                   out_dtype=kw.get("out_dtype"))
    w_c = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=dtype)
    assert_matmul_close(got, want, scale_bwd(dy, w_c), f"{fn.__name__} M={m} N={n} K={k} bs={bs}")


# ------------------------------------------------------------------------------------------
# the oracle itself
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table", ["nf4", "fp4"])
@pytest.mark.parametrize("out", ["f32", "bf16", "f16"])
def test_reference_dequant_matches_numpy_bit_for_bit(table, out):
    n, k, bs = 24, 256, 64
    packed, absmax = make_weight(3, n, k, bs)
    code = jnp.asarray(TABLES[table])
    got = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=DTYPES[out])
    want = np_dequant_f32(packed, absmax, code, bs).astype(jnp.dtype(DTYPES[out]))
    assert got.dtype == DTYPES[out] and got.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_reference_nibble_order_and_scale_broadcast():
    # bitsandbytes: [1.0, -1.0] packs to 0xF0 with NF4 (element 2j in the HIGH nibble).
    row = np.array([0xF0, 0x07, 0x7F, 0x00], np.uint8)  # codes F,0, 0,7, 7,F, 0,0
    codes = np.array([1.0, -1.0, -1.0, 0.0, 0.0, 1.0, -1.0, -1.0], np.float32)
    packed = jnp.asarray(np.tile(row, (2, 16)))            # (2, 64): K = 128, two 64-blocks
    absmax = jnp.asarray(np.array([[2.0, 0.5], [3.0, 0.25]], np.float32))
    got = np.asarray(dequantize_4bit_reference(packed, absmax, jnp.asarray(NF4), blocksize=64))
    want = np.tile(codes, 16)[None, :] * np.repeat(np.asarray(absmax), 64, axis=1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np_dequant_f32(packed, absmax, NF4, 64), want)


def test_reference_detects_swapped_nibbles():
    """Negative control: a weight with hi/lo nibbles swapped must dequantize differently."""
    packed, absmax = make_weight(5, 8, 64, 32)
    swapped = ((packed & 15) << 4) | (packed >> 4)
    a = dequantize_4bit_reference(packed, absmax, jnp.asarray(NF4), blocksize=32)
    b = dequantize_4bit_reference(swapped.astype(jnp.uint8), absmax, jnp.asarray(NF4), blocksize=32)
    assert not np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("table", ["nf4", "fp4"])
def test_reference_matmuls_match_float64(dt, table):
    m, n, k, bs = 5, 24, 128, 32
    dtype = DTYPES[dt]
    packed, absmax = make_weight(7, n, k, bs)
    code = jnp.asarray(TABLES[table])
    x = make_x(8, (m, k), dtype)
    dy = make_x(9, (m, n), dtype)
    w_c = np_dequant_f32(packed, absmax, code, bs).astype(jnp.dtype(dtype)).astype(np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    dy64 = np.asarray(dy.astype(jnp.float32), np.float64)
    for got, exact, scale in (
        (matmul_4bit_reference(x, packed, absmax, code, blocksize=bs), x64 @ w_c.T,
         np.abs(x64) @ np.abs(w_c).T),
        (matmul_4bit_t_reference(dy, packed, absmax, code, blocksize=bs), dy64 @ w_c,
         np.abs(dy64) @ np.abs(w_c)),
    ):
        assert got.dtype == dtype
        g = np.asarray(got.astype(jnp.float32), np.float64)
        # fp32 accumulation error + one rounding to the output dtype
        tol = 1e-5 * scale + float(jnp.finfo(dtype).eps) * np.abs(exact)
        assert np.all(np.abs(g - exact) <= tol), float(np.max(np.abs(g - exact) / tol))
    # out_dtype is honoured
    y32 = matmul_4bit_reference(x, packed, absmax, code, blocksize=bs, out_dtype=jnp.float32)
    assert y32.dtype == jnp.float32


# ------------------------------------------------------------------------------------------
# dequantize kernel: bit-exact
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,bs,out,table,method", [
    (72, 192, 64, "bf16", "nf4", "auto"),
    (40, 96, 32, "f32", "fp4", "select"),
    (40, 96, 32, "f16", "nf4", "gather"),
    (5, 512, 128, "bf16", "fp4", "select"),
    (33, 1024, 256, "f32", "nf4", "auto"),
    (3, 1024, 512, "bf16", "nf4", "auto"),
    (2, 2048, 1024, "f16", "fp4", "auto"),
    (4, 4096, 2048, "bf16", "nf4", "select"),
    (2, 8192, 4096, "f32", "nf4", "auto"),
])
def test_dequantize_kernel_bit_exact(n, k, bs, out, table, method):
    packed, absmax = make_weight(11, n, k, bs)
    code = jnp.asarray(TABLES[table])
    got = dequant_tiled(packed, absmax, code, blocksize=bs, out_dtype=DTYPES[out],
                        interpret=INTERPRET, method=method)
    want = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=DTYPES[out])
    assert got.shape == (n, k) and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_dequantize_kernel_small_tiles():
    # tiles smaller than a scale block and ragged row tiles
    packed, absmax = make_weight(12, 19, 256, 128)
    code = jnp.asarray(NF4)
    got = dequant_tiled(packed, absmax, code, blocksize=128, out_dtype=jnp.bfloat16,
                        interpret=True, block_n=8, block_k=32)
    want = dequantize_4bit_reference(packed, absmax, code, blocksize=128, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


# ------------------------------------------------------------------------------------------
# forward matmul kernels
# ------------------------------------------------------------------------------------------
FWD_CASES = [  # m, n, k, bs, dtype, table: ragged M and N, K not a multiple of the K tile
    (1, 72, 192, 64, "bf16", "nf4"),
    (3, 40, 96, 32, "f32", "fp4"),
    (17, 72, 192, 64, "f16", "nf4"),
    (64, 24, 256, 128, "bf16", "fp4"),
    (130, 40, 96, 32, "f32", "nf4"),
    (3, 16, 1024, 512, "f16", "fp4"),
    (2, 16, 8192, 4096, "bf16", "nf4"),
]


@pytest.mark.parametrize("m,n,k,bs,dt,table", FWD_CASES)
def test_fused_tiled(m, n, k, bs, dt, table):
    check_forward(fused_tiled, m, n, k, bs, DTYPES[dt], table)


def test_fused_tiled_options():
    # explicit small tiles (K loop of several steps, tile narrower than a scale block), gather
    # decode, and the large-M default tiling (block_m 256)
    check_forward(fused_tiled, 20, 40, 512, 256, jnp.bfloat16, "nf4", block_m=16, block_n=16,
                  block_k=64, method="gather")
    check_forward(fused_tiled, 260, 24, 64, 32, jnp.float32, "fp4")
    check_forward(fused_tiled, 5, 24, 128, 32, jnp.bfloat16, "nf4", out_dtype=jnp.float32)


@pytest.mark.parametrize("m,n,k,bs,dt,table", [c for c in FWD_CASES if c[0] <= 64])
def test_splitk_small_m(m, n, k, bs, dt, table):
    check_forward(splitk_small_m, m, n, k, bs, DTYPES[dt], table)


@pytest.mark.parametrize("shape,kw", [
    ((3, 40, 512, 64, "bf16", "nf4"), dict(split_x="wrapper", splits=1)),
    ((1, 24, 256, 32, "f32", "fp4"), dict(split_x="kernel", block_k=64, method="select")),
    ((3, 40, 512, 64, "f16", "nf4"), dict(rowwise_max_m=0, method="gather", splits=2, block_k=64)),
    ((5, 24, 256, 32, "bf16", "fp4"), dict(rowwise_max_m=64, block_n=8, out_dtype=jnp.float32)),
    ((2, 40, 512, 64, "f32", "nf4"), dict(reduce_at_end=True, block_k=128, splits=2)),
])
def test_splitk_small_m_options(shape, kw):
    m, n, k, bs, dt, table = shape
    check_forward(splitk_small_m, m, n, k, bs, DTYPES[dt], table, **kw)


def check_nested(fn, reference, m, n, k, bs, dtype, table, slack=0.0):
    """fn on double-quantized scales (de-nested in-kernel) = fn on the numpy-de-nested fp32
    scales (tight), and = reference (which de-nests bit for bit) within `slack`."""
    packed, _ = make_weight(21, n, k, bs)
    codes, nested, absmax = make_nested(22, n, k, bs)
    code = jnp.asarray(TABLES[table])
    x = make_x(23, (m, k), dtype)
    got = fn(x, packed, codes, code, blocksize=bs, nested=nested, interpret=INTERPRET)
    flat = fn(x, packed, absmax, code, blocksize=bs, interpret=INTERPRET)
    want = reference(x, packed, codes, code, blocksize=bs, nested=nested)
    scale = scale_fwd(x, dequantize_4bit_reference(packed, absmax, code, blocksize=bs,
                                                   out_dtype=dtype))
    what = f"{fn.__name__} nested M={m} N={n} K={k} bs={bs}"
    assert_matmul_close(got, flat, scale, what + " vs fp32 scales")
    assert_matmul_close(got, want, scale, what + " vs reference", slack=slack)
    return x, packed, codes, code, nested


# N ragged against block_n (32 at M <= 4 and M = 64, 64 at M = 17); N*K/bs = 864, 320, 432 scales
# (the last nested block is short) and 1280 = 5 * 256; K/bs = 12 and 6 put nested-block edges
# inside a row; bs=256 at M=17 has K tiles narrower than a scale block.
NESTED_CASES = [
    (1, 72, 768, 64, "bf16", "nf4"),
    (3, 40, 1024, 128, "f32", "fp4"),
    (17, 72, 1536, 256, "bf16", "fp4"),
    (64, 40, 1024, 32, "f32", "nf4"),
]


@pytest.mark.parametrize("m,n,k,bs,dt,table", NESTED_CASES)
def test_splitk_small_m_nested_scales(m, n, k, bs, dt, table):
    """De-nesting in-kernel = the fp32-scale kernel on the numpy-de-nested scales (same kernel
    otherwise: the tight check), and = the reference (which de-nests bit for bit).

    Against the reference, interpret mode gets half an ulp of the compute dtype per product of
    slack: XLA's default --xla_allow_excess_precision drops the row-wise path's round trip
    f32 -> bf16 -> f32 of the decoded weight, so there it multiplies unrounded fp32 weights
    (with the flag off it matches the reference at the module tolerance). Compiled: no slack.
    """
    dtype = DTYPES[dt]
    slack = float(jnp.finfo(dtype).eps) / 2 if INTERPRET and dtype != jnp.float32 else 0.0
    check_nested(splitk_small_m, matmul_4bit_small_m_reference, m, n, k, bs, dtype, table,
                 slack=slack)


# ------------------------------------------------------------------------------------------
# block-scaled GEMV (M <= 4): its own oracle (fp32 weights), and how far that is from the
# rounded-weight reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,bs,dt,table", [c for c in FWD_CASES if c[0] <= 4])
def test_gemv_block_scaled(m, n, k, bs, dt, table):
    check_forward(gemv_block_scaled, m, n, k, bs, DTYPES[dt], table,
                  reference=matmul_4bit_gemv_reference)


@pytest.mark.parametrize("shape,kw", [
    ((1, 40, 2048, 512, "bf16", "nf4"), dict(block_k=128)),         # 4 tiles per scale block
    ((4, 33, 512, 32, "f16", "fp4"), dict(block_k=64, splits=2)),    # K splits, ragged N
    ((2, 40, 1024, 64, "bf16", "nf4"), dict(block_n=8, block_k=1024, splits=1,
                                            out_dtype=jnp.float32)),
    ((3, 24, 256, 128, "f32", "fp4"), dict(num_warps=2, num_stages=2, fma=True)),
])
def test_gemv_block_scaled_options(shape, kw):
    m, n, k, bs, dt, table = shape
    check_forward(gemv_block_scaled, m, n, k, bs, DTYPES[dt], table,
                  reference=matmul_4bit_gemv_reference, **kw)


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
def test_gemv_block_scaled_against_the_rounded_weight_reference(dt):
    """The documented difference: none for fp32 x; for bf16/fp16 x at most half an ulp of x's
    dtype per product (the rounded-weight reference rounds each weight, this kernel does not)."""
    dtype = DTYPES[dt]
    m, n, k, bs = 3, 40, 1024, 64
    packed, absmax = make_weight(31, n, k, bs)
    code = jnp.asarray(NF4)
    x = make_x(32, (m, k), dtype)
    got = gemv_block_scaled(x, packed, absmax, code, blocksize=bs, interpret=INTERPRET)
    want = matmul_4bit_reference(x, packed, absmax, code, blocksize=bs)
    scale = scale_fwd(x, dequantize_4bit_reference(packed, absmax, code, blocksize=bs,
                                                   out_dtype=dtype))
    slack = 0.0 if dtype == jnp.float32 else float(jnp.finfo(dtype).eps) / 2
    assert_matmul_close(got, want, scale, f"gemv vs rounded-weight reference ({dt})", slack=slack)


@pytest.mark.parametrize("m,n,k,bs,dt,table", [c for c in NESTED_CASES if c[0] <= 4])
def test_gemv_block_scaled_nested_scales(m, n, k, bs, dt, table):
    """De-nesting in-kernel = the same kernel on numpy-de-nested fp32 scales, and = the oracle."""
    x, packed, codes, code, nested = check_nested(
        gemv_block_scaled, matmul_4bit_gemv_reference, m, n, k, bs, DTYPES[dt], table)
    for fn in (gemv_block_scaled, matmul_4bit_gemv_reference):
        with pytest.raises(ValueError, match="`nested_code`"):
            fn(x, packed, codes, code, blocksize=bs, interpret=True,
               nested=(nested[0], nested[1][:16], nested[2]))


# ------------------------------------------------------------------------------------------
# block-scaled tensor-core kernel (M <= 16): exact codes (hi + lo tables, the GEMV's oracle) and
# rounded codes (its own oracle)
# ------------------------------------------------------------------------------------------
BLOCK_DOT_CASES = [c for c in FWD_CASES if c[0] <= 16] + [
    (16, 40, 512, 64, "bf16", "nf4"),   # M = 16: no padded rows
    (9, 150, 256, 32, "f16", "fp4"),    # two N tiles of 128, ragged
]


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("m,n,k,bs,dt,table", BLOCK_DOT_CASES)
def test_block_scaled_dot(m, n, k, bs, dt, table, exact):
    check_forward(block_scaled_dot, m, n, k, bs, DTYPES[dt], table, exact_codes=exact,
                  reference=lambda *a, **kw: matmul_4bit_block_dot_reference(
                      *a, exact_codes=exact, **kw))


@pytest.mark.parametrize("shape,kw", [
    ((5, 40, 2048, 512, "bf16", "nf4"), dict(block_k=128, block_n=16, num_warps=4)),  # tile < block
    ((12, 33, 512, 32, "f16", "fp4"), dict(block_k=64, splits=2, block_n=32)),  # K splits, ragged
    ((16, 40, 1024, 64, "bf16", "nf4"), dict(splits=1, out_dtype=jnp.float32)),
    ((7, 24, 256, 128, "f32", "fp4"), dict(num_stages=2, exact_codes=False)),
])
def test_block_scaled_dot_options(shape, kw):
    m, n, k, bs, dt, table = shape
    exact = kw.get("exact_codes", True)
    check_forward(block_scaled_dot, m, n, k, bs, DTYPES[dt], table, **kw,
                  reference=lambda *a, **r: matmul_4bit_block_dot_reference(
                      *a, exact_codes=exact, **r))


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_block_scaled_dot_code_tables(dt):
    """hi + lo carries the fp32 code: with fp32 output the exact variant meets the fp32 oracle
    at 1e-5 of the product scale, and the rounded-code variant does not (negative control); the
    rounded-code variant meets its own oracle, and both are within half an ulp of x's dtype per
    product of the fp32 oracle."""
    dtype = DTYPES[dt]
    for table in (NF4, FP4):
        hi, lo = split_code_table(jnp.asarray(table), dtype)
        assert hi.dtype == lo.dtype == dtype
        rel = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - table)
        assert np.all(rel <= np.maximum(2.0**-17 * np.abs(table), 2.0**-25)), rel
    m, n, k, bs = 16, 40, 1024, 64
    packed, absmax = make_weight(41, n, k, bs)
    code = jnp.asarray(NF4)
    x = make_x(42, (m, k), dtype)
    scale = scale_fwd(x, dequantize_4bit_reference(packed, absmax, code, blocksize=bs,
                                                   out_dtype=jnp.float32))
    exact_oracle = matmul_4bit_gemv_reference(x, packed, absmax, code, blocksize=bs,
                                              out_dtype=jnp.float32)
    kw = dict(blocksize=bs, out_dtype=jnp.float32, interpret=INTERPRET)
    exact = block_scaled_dot(x, packed, absmax, code, **kw)
    rounded = block_scaled_dot(x, packed, absmax, code, exact_codes=False, **kw)
    assert_matmul_close(exact, exact_oracle, scale, f"exact codes vs fp32 oracle ({dt})")
    with pytest.raises(AssertionError, match="outside tolerance"):
        assert_matmul_close(rounded, exact_oracle, scale, "rounded codes vs fp32 oracle")
    assert_matmul_close(rounded, exact_oracle, scale, f"rounded codes, half-ulp bound ({dt})",
                        slack=float(jnp.finfo(dtype).eps) / 2)
    own = matmul_4bit_block_dot_reference(x, packed, absmax, code, blocksize=bs,
                                          out_dtype=jnp.float32, exact_codes=False)
    assert_matmul_close(rounded, own, scale, f"rounded codes vs its oracle ({dt})")


@pytest.mark.parametrize("m,n,k,bs,dt,table",
                         [c for c in NESTED_CASES if c[0] <= 16] + [(12, 72, 768, 64, "f16", "fp4")])
def test_block_scaled_dot_nested_scales(m, n, k, bs, dt, table):
    check_nested(block_scaled_dot, matmul_4bit_block_dot_reference, m, n, k, bs,
                 DTYPES[dt], table)


def test_denest_reference_bit_exact():
    """Two roundings (product, then + offset) eager and under jit, where XLA would fuse an FMA."""
    codes, nested, absmax = make_nested(24, 40, 1024, 128)
    for f in (denest_absmax_reference, jax.jit(denest_absmax_reference)):
        got = f(codes, *nested)
        assert got.shape == absmax.shape and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(absmax).view(np.uint32))


def test_splitk_small_m_nested_bad_operands():
    n, k, bs = 8, 128, 64
    packed, absmax = make_weight(0, n, k, bs)
    codes, (nested_absmax, nested_code, offset), _ = make_nested(0, n, k, bs)
    code = jnp.asarray(NF4)
    x = make_x(0, (1, k), jnp.float32)
    bad = [
        ("absmax", absmax, (nested_absmax, nested_code, offset)),  # fp32 scales with nested=
        ("absmax", codes[:, :1], (nested_absmax, nested_code, offset)),
        ("nested_absmax", codes, (jnp.ones(2, jnp.float32), nested_code, offset)),
        ("nested_absmax", codes, (nested_absmax.astype(jnp.float16), nested_code, offset)),
        ("nested_code", codes, (nested_absmax, nested_code[:16], offset)),
        ("offset", codes, (nested_absmax, nested_code, offset.reshape(1))),
        ("nested", codes, (nested_absmax, nested_code)),
    ]
    for fn in (splitk_small_m, matmul_4bit_small_m_reference):
        for name, am, nested in bad:
            with pytest.raises(ValueError, match=f"`{name}`"):
                fn(x, packed, am, code, blocksize=bs, nested=nested, interpret=True)


def test_dequant_dot_forward():
    check_forward(dequant_dot, 17, 72, 192, 64, jnp.bfloat16, "nf4")
    check_forward(dequant_dot, 3, 40, 96, 32, jnp.float32, "fp4")
    check_forward(dequant_dot, 3, 40, 96, 32, jnp.float16, "nf4", out_dtype=jnp.float32)


# ------------------------------------------------------------------------------------------
# backward product dy @ dequant(W)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k,bs,dt,table", FWD_CASES)
def test_fused_tiled_t(m, n, k, bs, dt, table):
    check_backward(fused_tiled_t, m, n, k, bs, DTYPES[dt], table)


def test_fused_tiled_t_options():
    check_backward(fused_tiled_t, 20, 40, 512, 256, jnp.bfloat16, "nf4", block_m=16, block_n=16,
                   block_k=64, method="gather")
    check_backward(fused_tiled_t, 260, 24, 64, 32, jnp.float32, "fp4")
    check_backward(fused_tiled_t, 5, 24, 128, 32, jnp.bfloat16, "nf4", out_dtype=jnp.float32)


def test_dequant_dot_t():
    check_backward(dequant_dot_t, 17, 72, 192, 64, jnp.bfloat16, "nf4")
    check_backward(dequant_dot_t, 3, 40, 96, 32, jnp.float32, "fp4")


# ------------------------------------------------------------------------------------------
# in-register code lookup (lookup="prmt", pallas_kernels.nibble_lookup): the same code tiles as
# the gather, so the same products bit for bit
# ------------------------------------------------------------------------------------------
def assert_same_products(got, want, scale, what):
    """Bit for bit where the kernels are compiled (both sides run the same fused multiply-adds
    and dots on the same code values); interpreted, XLA's CPU fusion may contract a multiply
    and an add differently in the two graphs, so 4 fp32 ulps of the product scale there."""
    if not INTERPRET:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)
    else:
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        assert np.all(err <= 4 * 2.0**-24 * scale), (what, float(np.max(err / scale)))


def round_codes(table, dtype):
    """The code table rounded to dtype, held as fp32 (what the gather path then loads)."""
    return jnp.asarray(jnp.asarray(table).astype(dtype), jnp.float32)


@pytest.mark.parametrize("m,n,k,bs,dt,table,kw", [
    (1, 72, 192, 64, "bf16", "nf4", {}),
    (4, 40, 512, 32, "f16", "fp4", dict(block_k=64, splits=2, block_n=16)),  # splits, ragged N
    (2, 40, 2048, 512, "bf16", "nf4", dict(block_k=128)),  # 4 tiles per scale block
    (3, 24, 256, 128, "f32", "fp4", {}),  # fp32 x: no 16-bit table, gathers
])
def test_gemv_prmt_lookup(m, n, k, bs, dt, table, kw):
    """= the gather kernel on the pre-rounded table, bit for bit, and = its oracle."""
    dtype = DTYPES[dt]
    packed, absmax = make_weight(51, n, k, bs)
    x = make_x(52, (m, k), dtype)
    run = functools.partial(gemv_block_scaled, x, packed, absmax, blocksize=bs,
                            interpret=INTERPRET, out_dtype=jnp.float32, **kw)
    got = run(jnp.asarray(TABLES[table]), lookup="prmt")
    want = run(round_codes(TABLES[table], dtype))
    assert_same_products(got, want, scale_fwd(x, dequantize_4bit_reference(
        packed, absmax, jnp.asarray(TABLES[table]), blocksize=bs, out_dtype=dtype)), "gemv prmt")
    check_forward(gemv_block_scaled, m, n, k, bs, dtype, table, lookup="prmt", **kw,
                  reference=matmul_4bit_rounded_codes_reference)


@pytest.mark.parametrize("m,n,k,bs,dt,table,kw", [
    (16, 40, 128, 64, "bf16", "nf4", {}),
    (9, 150, 64, 32, "f16", "fp4", {}),  # two N tiles, ragged
    (5, 40, 2048, 512, "bf16", "nf4", dict(block_k=128, block_n=16, num_warps=4)),
    (12, 33, 256, 32, "f16", "fp4", dict(block_k=64, splits=2, block_n=32)),
    (7, 24, 256, 128, "f32", "nf4", {}),  # fp32 x: no 16-bit table, gathers
    (40, 72, 128, 64, "bf16", "nf4", {}),  # beyond the registered M <= 16 (x padded to 64)
])
def test_block_scaled_dot_prmt_lookup(m, n, k, bs, dt, table, kw):
    """= the rounded-code gather kernel bit for bit (the same code tiles), and = its oracle.

    Interpreted, a kernel's cost grows with the scale-block chunks unrolled per K tile, so K is
    two chunks a tile (one where a tile is narrower than a block) and more K is a K loop
    (fori_loop, K splits): the default tiles, ragged N, and M = 16 and M > 16 all run."""
    dtype = DTYPES[dt]
    packed, absmax = make_weight(53, n, k, bs)
    x = make_x(54, (m, k), dtype)
    run = functools.partial(block_scaled_dot, x, packed, absmax, jnp.asarray(TABLES[table]),
                            blocksize=bs, interpret=INTERPRET, out_dtype=jnp.float32,
                            exact_codes=False, **kw)
    assert_same_products(run(lookup="prmt"), run(), scale_fwd(x, dequantize_4bit_reference(
        packed, absmax, jnp.asarray(TABLES[table]), blocksize=bs, out_dtype=dtype)),
        "block-dot prmt")
    check_forward(block_scaled_dot, m, n, k, bs, dtype, table, lookup="prmt",
                  exact_codes=False, **kw, reference=matmul_4bit_rounded_codes_reference)


@pytest.mark.parametrize("fn", [functools.partial(gemv_block_scaled, lookup="prmt"),
                                functools.partial(block_scaled_dot, lookup="prmt",
                                                  exact_codes=False)], ids=["gemv", "block_dot"])
def test_prmt_lookup_nested_scales(fn):
    fn.__name__ = "prmt " + fn.func.__name__
    # N*K/bs = 432 scales: a nested-block edge inside a row and a short last nested block
    check_nested(fn, matmul_4bit_rounded_codes_reference, 3, 72, 384, 64, jnp.bfloat16, "nf4")


def test_prmt_lookup_bad_arguments():
    packed, absmax = make_weight(55, 16, 128, 64)
    x = make_x(56, (2, 128), jnp.bfloat16)
    code = jnp.asarray(NF4)
    for fn in (gemv_block_scaled, functools.partial(block_scaled_dot, exact_codes=False)):
        with pytest.raises(ValueError, match="lookup must be 'gather' or 'prmt'"):
            fn(x, packed, absmax, code, blocksize=64, lookup="shared", interpret=True)
    with pytest.raises(ValueError, match="needs exact_codes=False"):
        block_scaled_dot(x, packed, absmax, code, blocksize=64, lookup="prmt",
                         interpret=True)


# ------------------------------------------------------------------------------------------
# property test over random shapes, every variant
# ------------------------------------------------------------------------------------------
@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from([v.name for v in TRITON_4BIT]),
    m=st.integers(1, 70), n=st.integers(1, 80), k_blocks=st.integers(1, 3),
    bs=st.sampled_from([32, 64, 128]), dt=st.sampled_from(sorted(DTYPES)),
    table=st.sampled_from(sorted(TABLES)), seed=st.integers(0, 2**16),
)
def test_property_random_shapes(name, m, n, k_blocks, bs, dt, table, seed):
    """One variant per example (each example compiles a kernel: keep CI time bounded)."""
    k = bs * k_blocks
    dtype = DTYPES[dt]
    packed, absmax = make_weight(seed, n, k, bs)
    code = jnp.asarray(TABLES[table])
    w_c = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=dtype)
    for v in TRITON_4BIT:
        if v.name != name or not v.supports(m, n, k, bs):
            continue
        if v.op == "dequantize_4bit":
            got = v.fn(packed, absmax, code, blocksize=bs, out_dtype=dtype, interpret=INTERPRET)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                          np.asarray(w_c).view(np.uint8))
        elif v.op == "matmul_4bit":
            x = make_x(seed + 1, (m, k), dtype)
            got = v.fn(x, packed, absmax, code, blocksize=bs, out_dtype=dtype, interpret=INTERPRET)
            want = v.reference(x, packed, absmax, code, blocksize=bs, out_dtype=dtype)
            assert_matmul_close(got, want, scale_fwd(x, w_c), v.name)
        elif v.op == "matmul_4bit_t":
            dy = make_x(seed + 2, (m, n), dtype)
            got = v.fn(dy, packed, absmax, code, blocksize=bs, out_dtype=dtype, interpret=INTERPRET)
            want = v.reference(dy, packed, absmax, code, blocksize=bs, out_dtype=dtype)
            assert_matmul_close(got, want, scale_bwd(dy, w_c), v.name)


# ------------------------------------------------------------------------------------------
# registry entries, shape support, errors, helpers
# ------------------------------------------------------------------------------------------
def test_variants_registered():
    by_name = {v.name: v for v in TRITON_4BIT}
    assert {"dequant_tiled": "dequantize_4bit", "fused_tiled": "matmul_4bit",
            "fused_tiled_t": "matmul_4bit_t", "splitk_small_m": "matmul_4bit"}.items() <= {
        n: v.op for n, v in by_name.items()}.items()
    for v in TRITON_4BIT:
        assert isinstance(v, Variant) and v.op in OPS and v.description
        assert v.supports(1, 64, 128, 64)
        assert not v.supports(1, 64, 127, 64)      # K odd
        assert not v.supports(1, 64, 96, 64)       # K % blocksize
        assert not v.supports(1, 64, 96, 48)       # blocksize not a power of two
        assert not v.supports(1, 64, 32, 16)       # blocksize below 32
    assert by_name["splitk_small_m"].supports(64, 64, 128, 64)
    assert {v.name for v in TRITON_4BIT if v.accepts_nested} == {
        "splitk_small_m", "gemv_block_scaled", "gemv_block_scaled_prmt", "block_scaled_dot",
        "block_scaled_dot_rounded_codes", "block_scaled_dot_prmt", "decoded_dot_prmt",
        "decoded_dot_gather"}
    assert not by_name["splitk_small_m"].supports(65, 64, 128, 64)
    assert by_name["gemv_block_scaled"].supports(4, 64, 128, 64)
    assert not by_name["gemv_block_scaled"].supports(5, 64, 128, 64)
    assert not by_name["gemv_block_scaled_prmt"].supports(5, 64, 128, 64)
    for name in ("block_scaled_dot", "block_scaled_dot_rounded_codes"):
        assert by_name[name].supports(16, 64, 128, 64)
        assert not by_name[name].supports(17, 64, 128, 64)
    assert by_name["block_scaled_dot_prmt"].supports(64, 64, 128, 64)
    assert not by_name["block_scaled_dot_prmt"].supports(65, 64, 128, 64)


def test_bad_inputs_raise_clear_errors():
    packed, absmax = make_weight(0, 8, 128, 64)
    code = jnp.asarray(NF4)
    x = make_x(0, (2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="absmax"):
        fused_tiled(x, packed, absmax[:, :1], code, blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="blocksize"):
        dequant_tiled(packed, absmax, code, blocksize=48, interpret=True)
    with pytest.raises(ValueError, match="multiple of blocksize"):
        fused_tiled_t(make_x(0, (2, 8), jnp.float32), packed, absmax, code, blocksize=256,
                      interpret=True)
    with pytest.raises(ValueError, match="columns"):
        splitk_small_m(x[:, :64], packed, absmax, code, blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="uint8"):
        dequant_tiled(packed.astype(jnp.int8), absmax, code, blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="M=65"):
        splitk_small_m(make_x(0, (65, 128), jnp.float32), packed, absmax, code,
                       blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="code"):
        fused_tiled(x, packed, absmax, code[:8], blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="M=5"):
        gemv_block_scaled(make_x(0, (5, 128), jnp.float32), packed, absmax, code, blocksize=64,
                          interpret=True)
    with pytest.raises(ValueError, match="splits=3"):
        gemv_block_scaled(x, packed, absmax, code, blocksize=64, block_k=64, splits=3,
                          interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_block_scaled(x, packed, absmax, code, blocksize=64, block_n=24, interpret=True)
    with pytest.raises(ValueError, match="M=129"):
        block_scaled_dot(make_x(0, (129, 128), jnp.float32), packed, absmax, code,
                         blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="splits=3"):
        block_scaled_dot(x, packed, absmax, code, blocksize=64, block_k=64, splits=3,
                         interpret=True)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        block_scaled_dot(x, packed, absmax, code, blocksize=64, block_n=8, interpret=True)


def test_empty_m():
    packed, absmax = make_weight(0, 8, 64, 32)
    code = jnp.asarray(NF4)
    for fn in (fused_tiled, splitk_small_m, gemv_block_scaled, block_scaled_dot):
        y = fn(jnp.zeros((0, 64), jnp.bfloat16), packed, absmax, code, blocksize=32, interpret=True)
        assert y.shape == (0, 8) and y.dtype == jnp.bfloat16
    y = fused_tiled_t(jnp.zeros((0, 8), jnp.float32), packed, absmax, code, blocksize=32,
                      interpret=True)
    assert y.shape == (0, 64)


def test_compat_helpers():
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4 and cdiv(0, 3) == 0
    assert resolve_interpret(True) is True and resolve_interpret(False) is False
    assert resolve_interpret(None) == auto_interpret()
    if jax.default_backend() == "cpu":
        assert auto_interpret() is True


def test_kernels_lower_for_triton(lower_for_triton):
    """Every 4-bit kernel lowers for CUDA (Pallas -> Triton IR) without a GPU, flat and nested
    scales, ragged N, K tiles narrower than a scale block."""
    n, k = 72, 1024
    dt = jnp.bfloat16

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    packed, code = sds((n, k // 2), jnp.uint8), sds((16,), jnp.float32)

    def weight(bs, nested=False):
        if not nested:
            return packed, sds((n, k // bs), jnp.float32), code
        return packed, sds((n, k // bs), jnp.uint8), code

    def nested_ops(bs):
        return (jnp.ones((cdiv(n * k // bs, 256),), jnp.float32), jnp.ones((256,), jnp.float32),
                jnp.float32(0.5))

    x1, x3, x17, dy = sds((1, k), dt), sds((3, k), dt), sds((17, k), dt), sds((17, n), dt)
    x16, x5_f32 = sds((16, k), dt), sds((5, k), jnp.float32)
    jobs = {
        "dequant_tiled": (lambda p, a, c: dequant_tiled(p, a, c, blocksize=64),
                          weight(64)),
        "fused_tiled": (lambda x, p, a, c: fused_tiled(x, p, a, c, blocksize=64),
                        (x17, *weight(64))),
        "fused_tiled_t": (lambda d, p, a, c: fused_tiled_t(d, p, a, c, blocksize=64),
                          (dy, *weight(64))),
        "splitk_small_m nested": (
            lambda x, p, a, c: splitk_small_m(x, p, a, c, blocksize=64,
                                              nested=nested_ops(64)),
            (x1, *weight(64, nested=True))),
        "splitk_small_m dots": (lambda x, p, a, c: splitk_small_m(x, p, a, c, blocksize=64),
                                (x17, *weight(64))),
        "gemv_block_scaled": (lambda x, p, a, c: gemv_block_scaled(x, p, a, c, blocksize=64),
                              (x3, *weight(64))),
        "gemv_block_scaled nested": (
            lambda x, p, a, c: gemv_block_scaled(x, p, a, c, blocksize=64, nested=nested_ops(64),
                                                 block_n=16, splits=1),
            (x1, *weight(64, nested=True))),
        "gemv_block_scaled fma": (
            lambda x, p, a, c: gemv_block_scaled(x, p, a, c, blocksize=64, fma=True),
            (x3, *weight(64))),
        "gemv_block_scaled tile < block": (
            lambda x, p, a, c: gemv_block_scaled(x, p, a, c, blocksize=512, block_k=128),
            (x1, *weight(512))),
        "block_scaled_dot": (lambda x, p, a, c: block_scaled_dot(x, p, a, c, blocksize=64),
                             (x16, *weight(64))),
        "block_scaled_dot rounded codes, nested": (
            lambda x, p, a, c: block_scaled_dot(x, p, a, c, blocksize=64, exact_codes=False,
                                                nested=nested_ops(64)),
            (x3, *weight(64, nested=True))),
        "gemv_block_scaled prmt lookup, nested": (
            lambda x, p, a, c: gemv_block_scaled(x, p, a, c, blocksize=64, lookup="prmt",
                                                 nested=nested_ops(64)),
            (x1, *weight(64, nested=True))),
        "block_scaled_dot prmt lookup": (
            lambda x, p, a, c: block_scaled_dot(x, p, a, c, blocksize=64, exact_codes=False,
                                                lookup="prmt"),
            (x16, *weight(64))),
        "block_scaled_dot fp32, tile < block": (
            lambda x, p, a, c: block_scaled_dot(x, p, a, c, blocksize=512, block_k=128,
                                                block_n=16, num_warps=4),
            (x5_f32, *weight(512))),
    }
    for label, (fn, args) in jobs.items():
        lower_for_triton(label, fn, *args)
