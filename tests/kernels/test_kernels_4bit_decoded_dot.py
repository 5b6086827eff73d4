"""The decoded-weight 4-bit tensor-core kernel (`pallas_kernels/triton/decoded_dot.py`):
against its oracle (interpret mode on CPU, compiled on a GPU), the prmt lookup against the fp32
gather on the rounded table, the oracle against an independent numpy float64 product, and the
numerics claim (the weight within one ulp of bitsandbytes' rounding) on random scales.

Tolerances as in test_kernels_4bit.py (the kernel sums in fp32 in another order than XLA).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.reference.fourbit import dequantize_4bit_reference, matmul_4bit_decoded_dot_reference
from pallas_kernels.triton.decoded_dot import decoded_dot
from test_kernels_4bit import (
    DTYPES, INTERPRET, NF4, TABLES, assert_matmul_close, assert_same_products, check_nested,
    make_weight, make_x, np_dequant_f32, round_codes, scale_fwd)


def _named(lookup):
    fn = functools.partial(decoded_dot, lookup=lookup)
    fn.__name__ = f"decoded_dot {lookup}"
    return fn


def _check(m, n, k, bs, dt, table, lookup, seed=0, **kw):
    dtype = DTYPES[dt]
    packed, absmax = make_weight(seed, n, k, bs)
    code = jnp.asarray(TABLES[table])
    x = make_x(seed + 1, (m, k), dtype)
    got = decoded_dot(x, packed, absmax, code, blocksize=bs, lookup=lookup,
                      interpret=INTERPRET, **kw)
    want = matmul_4bit_decoded_dot_reference(x, packed, absmax, code, blocksize=bs,
                                             lookup=lookup, out_dtype=kw.get("out_dtype"))
    w_c = dequantize_4bit_reference(packed, absmax, code, blocksize=bs, out_dtype=dtype)
    assert_matmul_close(got, want, scale_fwd(x, w_c), f"decoded_dot {lookup} M={m} N={n} K={k}")
    return got


# M ragged against block_m (40 of 64, 70 of 64: two M tiles), N ragged against block_n, K tiles
# narrower than a scale block (bs 512 with the default block_k 64) and wider (bs 32), explicit
# splits and tiles, fp32 x (no 16-bit table: the prmt path gathers), fp32 output
CASES = [
    (40, 72, 256, 64, "bf16", "nf4", {}),
    (70, 150, 512, 32, "f16", "fp4", {}),
    (33, 40, 2048, 512, "bf16", "nf4", dict(block_k=128)),
    (9, 64, 512, 64, "f16", "nf4", dict(block_m=16, block_n=32, block_k=256, splits=2)),
    (64, 24, 256, 128, "f32", "fp4", {}),
    (17, 96, 384, 128, "bf16", "fp4", dict(out_dtype=jnp.float32, num_warps=8, num_stages=2)),
]


@pytest.mark.parametrize("lookup", ["prmt", "gather"])
@pytest.mark.parametrize("m,n,k,bs,dt,table,kw", CASES)
def test_decoded_dot_matches_its_oracle(m, n, k, bs, dt, table, kw, lookup):
    _check(m, n, k, bs, dt, table, lookup, **kw)


@pytest.mark.parametrize("m,n,k,bs,dt,table", [(48, 72, 512, 64, "bf16", "nf4"),
                                               (20, 40, 256, 32, "f16", "fp4")])
def test_prmt_lookup_equals_the_gather_of_the_rounded_table(m, n, k, bs, dt, table):
    """The prmt path's weight tiles are the gather path's on the pre-rounded table, bit for bit,
    so the products are too (compiled; 4 fp32 ulps of the scale interpreted)."""
    dtype = DTYPES[dt]
    packed, absmax = make_weight(61, n, k, bs)
    x = make_x(62, (m, k), dtype)
    run = functools.partial(decoded_dot, x, packed, absmax, blocksize=bs,
                            interpret=INTERPRET, out_dtype=jnp.float32)
    got = run(jnp.asarray(TABLES[table]), lookup="prmt")
    want = run(round_codes(TABLES[table], dtype), lookup="gather")
    assert_same_products(got, want, scale_fwd(x, dequantize_4bit_reference(
        packed, absmax, jnp.asarray(TABLES[table]), blocksize=bs, out_dtype=dtype)),
        "decoded_dot prmt vs gather")


@pytest.mark.parametrize("lookup", ["prmt", "gather"])
def test_oracle_against_numpy_float64(lookup):
    """The oracle's weight is round(code' * absmax) in bf16 (code' = code rounded to bf16 for
    prmt), built here in numpy with ml_dtypes, and its product is that weight times x in float64
    up to fp32 summation error."""
    m, n, k, bs = 5, 24, 256, 64
    packed, absmax = make_weight(63, n, k, bs)
    x = make_x(64, (m, k), jnp.bfloat16)
    code = NF4.astype(ml_dtypes.bfloat16).astype(np.float32) if lookup == "prmt" else NF4
    w = np_dequant_f32(packed, absmax, code, bs).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = np.asarray(x, np.float64) @ w.T
    got = matmul_4bit_decoded_dot_reference(x, packed, absmax, jnp.asarray(NF4), blocksize=bs,
                                            lookup=lookup, out_dtype=jnp.float32)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), 1e-5 * scale + 1e-30)


@settings(max_examples=20, deadline=None)
@given(dt=st.sampled_from(["bf16", "f16"]), table=st.sampled_from(sorted(TABLES)),
       seed=st.integers(0, 2**16))
def test_prmt_weight_within_one_ulp_of_bitsandbytes(dt, table, seed):
    """round(round(code) * absmax) against bitsandbytes' round(code * absmax): at most one unit
    in the last place of x's dtype, for all 16 codes and random scales over 8 binades."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(seed)
    code = TABLES[table]
    absmax = np.exp2(rng.uniform(-4, 4, 512)).astype(np.float32)
    exact = (code[None, :] * absmax[:, None]).astype(dtype)
    rounded = code.astype(dtype).astype(np.float32)
    ours = (rounded[None, :] * absmax[:, None]).astype(dtype)
    bits = lambda a: np.asarray(a).view(np.int16).astype(np.int32)
    sign = lambda a: np.sign(np.asarray(a, np.float32))
    assert (sign(exact) * sign(ours) >= 0).all()  # the bit patterns compare as magnitudes
    assert np.max(np.abs(bits(exact) - bits(ours))) <= 1


def test_nested_scales():
    check_nested(_named("prmt"),
                 functools.partial(matmul_4bit_decoded_dot_reference, lookup="prmt"),
                 40, 72, 768, 64, jnp.bfloat16, "nf4")


def test_empty_input():
    packed, absmax = make_weight(65, 8, 128, 64)
    y = decoded_dot(jnp.zeros((0, 128), jnp.bfloat16), packed, absmax,
                    jnp.asarray(NF4), blocksize=64, interpret=True)
    assert y.shape == (0, 8) and y.dtype == jnp.bfloat16


def test_bad_arguments_raise_clear_errors():
    packed, absmax = make_weight(66, 16, 256, 64)
    x = make_x(67, (4, 256), jnp.bfloat16)
    run = functools.partial(decoded_dot, x, packed, absmax, jnp.asarray(NF4),
                            blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="lookup must be one of"):
        run(lookup="shared")
    with pytest.raises(ValueError, match="splits=3 must divide the 4 K tiles"):
        run(splits=3)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        run(block_m=24)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        run(block_k=16)
    with pytest.raises(ValueError, match="has 128 columns but the weight needs 256"):
        decoded_dot(x[:, :128], packed, absmax, jnp.asarray(NF4), blocksize=64,
                    interpret=True)


@pytest.mark.parametrize("lookup", ["prmt", "gather"])
def test_lowers_to_triton(lower_for_triton, lookup):
    """The compiled path (inline PTX lookup, transposed store, K splits, in-kernel de-nesting)
    uses only ops the Triton lowering accepts; the GPU suite runs it."""
    s = jax.ShapeDtypeStruct
    n, k, m = 200, 1024, 48
    common = (s((m, k), jnp.bfloat16), s((n, k // 2), jnp.uint8))
    flat = lambda x, p, a, c: decoded_dot(x, p, a, c, blocksize=64, lookup=lookup,
                                          interpret=False)
    lower_for_triton(f"{lookup} flat", flat, *common, s((n, k // 64), jnp.float32),
                     s((16,), jnp.float32))
    nested = lambda x, p, a, c, na, nc, o: decoded_dot(
        x, p, a, c, blocksize=64, lookup=lookup, nested=(na, nc, o), interpret=False, splits=1)
    lower_for_triton(f"{lookup} nested", nested, *common, s((n, k // 64), jnp.uint8),
                     s((16,), jnp.float32), s((n * k // 64 // 256 + 1,), jnp.float32),
                     s((256,), jnp.float32), s((), jnp.float32))


def test_triton_ir_fingerprints(lower_for_triton):
    """tests/support/ir_fingerprint (how a refactor is shown not to change compiled code): one
    hash per pallas_call, the same on a second lowering, different for another lookup."""
    from ir_fingerprint import fingerprints

    prmt = fingerprints(decoded_dot, 48, {})
    assert len(prmt) == 2 and all(len(h) == 16 for h in prmt)
    assert fingerprints(decoded_dot, 48, {}) == prmt
    assert set(fingerprints(decoded_dot, 48, dict(lookup="gather"))).isdisjoint(prmt)
