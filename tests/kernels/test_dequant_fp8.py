"""The FP8 dequant kernels (`registry.fp8_variants()`: dequant_fp8, dequant_fp8_t) against their
jnp reference, fp8 values bit for bit, in Pallas interpret mode on CPU (compiled on a GPU); the
reference against an independent numpy decode cast by ml_dtypes; the Triton lowering; errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jqlora import quant
from pallas_kernels import registry
from pallas_kernels.reference.fourbit import dequantize_4bit_fp8_reference

FP8 = registry.fp8_variants()
INTERPRET = jax.default_backend() != "gpu"


def _operands(n, k, bs, table, nested, seed=0, spread=3.0):
    """packed (N, K/2), fp32 absmax (N, K/bs), code, inv_scale (N,) = 448 / the row's largest absmax,
    and the packed weight (for the numpy decode). Rows span a few binades."""
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32)
    w = w * jnp.exp2(jnp.arange(n) % 5 - 2.0)[:, None] * spread
    q = quant.quantize_4bit(w, table, bs, double_quant=nested)
    absmax = quant.absmax_f32(q).reshape(n, k // bs)
    inv = 448.0 / absmax.max(axis=1)
    return q.packed.reshape(n, k // 2), absmax, q.code, inv


def _bits(a):
    return np.asarray(a).view(np.uint8)


# (N, K, blocksize, table, double quant, block_k): N = 40, 72 and 100 are not multiples of the 16-row
# tile of dequant_fp8 nor of the 64-row tile of dequant_fp8_t; block_k 32 makes tiles narrower
# than a 64-wide scale block, block_k 512 wider than a 32-wide one
CASES = [(40, 256, 64, "nf4", True, None), (72, 128, 32, "fp4", False, None),
         (100, 512, 128, "nf4", False, 32), (16, 256, 32, "fp4", True, 512), (64, 64, 64, "nf4", True, None)]


@pytest.mark.parametrize("name", [v.name for v in FP8])
@pytest.mark.parametrize("n,k,bs,table,nested,block_k", CASES)
def test_kernel_matches_its_reference_bit_for_bit(name, n, k, bs, table, nested, block_k):
    v = registry.get(name)
    packed, absmax, code, inv = _operands(n, k, bs, table, nested, seed=n + k)
    got = v.fn(packed, absmax, code, inv, blocksize=bs, interpret=INTERPRET, block_k=block_k)
    want = v.reference(packed, absmax, code, inv, blocksize=bs)
    shape = (k, n) if name.endswith("_t") else (n, k)
    assert got.shape == want.shape == shape and got.dtype == jnp.float8_e4m3fn, (got.shape, got.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{name} {n}x{k} bs={bs} {table}")


def test_select_decode_matches_too():
    packed, absmax, code, inv = _operands(40, 128, 64, "nf4", False)
    want = dequantize_4bit_fp8_reference(packed, absmax, code, inv, blocksize=64)
    for v in FP8:
        got = v.fn(packed, absmax, code, inv, blocksize=64, interpret=INTERPRET, method="select")
        np.testing.assert_array_equal(_bits(got), _bits(want.T if v.name.endswith("_t") else want))


@pytest.mark.parametrize("table", ["nf4", "fp4"])
def test_reference_against_a_numpy_decode(table):
    """code[nibble] * absmax * inv_scale in float32 (numpy), clipped to +-448 and cast by ml_dtypes:
    the same bits. A smaller inv_scale on some rows and a larger one on others (values past 448
    saturate, not NaN)."""
    n, k, bs = 24, 128, 64
    packed, absmax, code, inv = _operands(n, k, bs, table, True, seed=3)
    inv = inv * jnp.where(jnp.arange(n) % 3 == 0, 1.7, 0.3).astype(jnp.float32)
    p = np.asarray(packed).astype(np.int32)
    nib = np.stack([p >> 4, p & 15], axis=-1).reshape(n, k)
    w = np.asarray(code)[nib] * np.repeat(np.asarray(absmax), bs, axis=1)
    want = np.clip(w * np.asarray(inv)[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got = dequantize_4bit_fp8_reference(packed, absmax, code, inv, blocksize=bs)
    np.testing.assert_array_equal(_bits(got), want.view(np.uint8))
    assert not np.isnan(np.asarray(got, np.float32)).any()
    assert np.abs(np.asarray(got, np.float32)).max() == 448.0


def test_registry_lists_them_apart_from_the_products():
    names = {v.name for v in FP8}
    assert names == {"dequant_fp8", "dequant_fp8_t"}
    assert not names & {v.name for v in registry.all_variants()}  # no row of the dispatch table
    for v in FP8:
        assert v.op in registry.FP8_OPS and v.numerics == "fp8_row_scaled" and v.description
        assert registry.module_of(v.name) == "pallas_kernels.triton.dequant_fp8"
        assert v.supports(0, 72, 256, 64) and not v.supports(0, 72, 96, 64)


@pytest.mark.parametrize("name", [v.name for v in FP8])
def test_bad_operands_name_the_operand(name):
    v = registry.get(name)
    packed, absmax, code, inv = _operands(16, 128, 64, "nf4", False)
    bad = [((packed, absmax, code, inv[:-1]), "`inv_scale` must be float32 of shape"),
           ((packed, absmax, code, inv.astype(jnp.bfloat16)), "`inv_scale` must be float32"),
           ((packed.astype(jnp.int8), absmax, code, inv), "`packed` must be uint8"),
           ((packed, absmax[:, :1], code, inv), "`absmax` must have shape")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            v.fn(*args, blocksize=64, interpret=True)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        v.fn(packed, absmax, code, inv, blocksize=64, interpret=True, block_n=24)


def test_kernels_lower_for_triton(lower_for_triton):
    """Both kernels lower for CUDA (Pallas -> Triton IR) without a GPU: ragged N, tiles wider and
    narrower than a scale block."""
    s = jax.ShapeDtypeStruct
    n, k = 72, 1024
    for v in FP8:
        for bs in (64, 512):
            args = (s((n, k // 2), jnp.uint8), s((n, k // bs), jnp.float32), s((16,), jnp.float32),
                    s((n,), jnp.float32))
            lower_for_triton(f"{v.name} bs={bs}", lambda *a, f=v.fn, b=bs: f(*a, blocksize=b), *args)
