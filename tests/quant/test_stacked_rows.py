"""`jqlora.quant.stacked_rows`: weights stacked along their output rows dequantize to exactly the pieces'
rows (the pieces' own dequantization is checked against bitsandbytes in
test_quant_vs_bitsandbytes.py), on random shapes and every 4-bit layout; what cannot be stacked is
refused with its reason."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jqlora import quant
from jqlora.quant.stacked_rows import concat_rows, rows_problem

_dequant = jax.jit(quant.dequantize, static_argnums=(1,))


def _weight(key, rows, cols, scale=1.0):
    return jax.random.normal(jax.random.key(key), (rows, cols), jnp.float32) * scale


def _pieces_4bit(rows, cols, quant_type, blocksize, nested, seed=0):
    # pieces of very different magnitudes: their nested scales get different offsets
    return [quant.quantize_4bit(_weight(seed + i, r, cols, 10.0 ** i), quant_type, blocksize, nested)
            for i, r in enumerate(rows)]


def _bits(a):
    return np.asarray(a).view(np.uint32)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=3), st.sampled_from([64, 128, 192]),
       st.sampled_from(["nf4", "fp4"]), st.sampled_from([32, 64, 128]), st.booleans())
def test_stacked_4bit_weight_dequantizes_to_the_pieces_rows(units, cols, quant_type, blocksize, nested):
    rows = [u * 8 for u in units]  # 8 rows x 64k columns: every piece a whole number of blocks
    pieces = _pieces_4bit(rows, cols, quant_type, blocksize, nested)
    stacked = concat_rows(pieces)
    assert stacked.shape == (sum(rows), cols) and not stacked.nested
    assert (stacked.quant_type, stacked.blocksize) == (quant_type, blocksize)
    want = np.concatenate([np.asarray(_dequant(p, jnp.float32)) for p in pieces])
    np.testing.assert_array_equal(_bits(_dequant(stacked, jnp.float32)), _bits(want))


def test_nested_pieces_keep_their_own_offsets():
    """Stacking the nested codes as they are (one offset for all) would shift every scale of the
    later pieces: the stacked weight holds the de-nested float32 scales instead."""
    pieces = _pieces_4bit([16, 8, 8], 128, "nf4", 64, True)
    offsets = [float(p.offset) for p in pieces]
    assert len(set(offsets)) == 3
    stacked = concat_rows(pieces)
    assert stacked.absmax.dtype == jnp.float32
    np.testing.assert_array_equal(
        _bits(stacked.absmax), _bits(np.concatenate([np.asarray(quant.absmax_f32(p)) for p in pieces])))
    # what a stack of the raw nested codes under the first piece's offset would give: wrong rows
    naive = dataclasses.replace(pieces[0], packed=stacked.packed, shape=stacked.shape,
                                absmax=jnp.concatenate([p.absmax for p in pieces]),
                                nested_absmax=jnp.concatenate([p.nested_absmax for p in pieces]))
    assert not np.array_equal(np.asarray(_dequant(naive, jnp.float32)), np.asarray(_dequant(stacked, jnp.float32)))


def test_stacked_int8_and_plain_weights():
    ws = [_weight(i, r, 96) for i, r in enumerate((32, 8, 8))]
    int8 = [quant.quantize_int8(w) for w in ws]
    stacked = concat_rows(int8)
    np.testing.assert_array_equal(np.asarray(_dequant(stacked, jnp.float32)),
                                  np.concatenate([np.asarray(_dequant(q, jnp.float32)) for q in int8]))
    dense = [w.astype(jnp.bfloat16) for w in ws]
    np.testing.assert_array_equal(np.asarray(concat_rows(dense)), np.concatenate([np.asarray(w) for w in dense]))


def test_stacking_works_under_jit():
    pieces = _pieces_4bit([8, 8], 64, "nf4", 64, True)
    got = jax.jit(lambda ps: _dequant(concat_rows(ps), jnp.float32))(pieces)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate([np.asarray(_dequant(p, jnp.float32)) for p in pieces]))


@pytest.mark.parametrize("make, reason", [
    (lambda: [quant.quantize_4bit(_weight(0, 8, 64)), _weight(1, 8, 64)], "mixed formats"),
    (lambda: [quant.quantize_4bit(_weight(0, 8, 64), blocksize=64), quant.quantize_4bit(_weight(1, 8, 64), blocksize=128)],
     "different 4-bit formats"),
    (lambda: [quant.quantize_4bit(_weight(0, 8, 64), "nf4"), quant.quantize_4bit(_weight(1, 8, 64), "fp4")],
     "different 4-bit formats"),
    (lambda: [quant.quantize_4bit(_weight(0, 3, 32), blocksize=64), quant.quantize_4bit(_weight(1, 3, 32), blocksize=64)],
     "a block would span two weights"),
    (lambda: [quant.quantize_4bit(_weight(0, 8, 64)), quant.quantize_4bit(_weight(1, 8, 128))], "one input width"),
    (lambda: [quant.quantize_int8(_weight(0, 8, 64)), dataclasses.replace(quant.quantize_int8(_weight(1, 8, 64)),
                                                                          threshold=6.0)], "LLM.int8 settings"),
    (lambda: [_weight(0, 8, 64), _weight(1, 8, 64).astype(jnp.bfloat16)], "different dtypes"),
    (lambda: [_weight(0, 8, 64)], "fewer than two"),
])
def test_what_cannot_be_stacked_is_refused_with_its_reason(make, reason):
    weights = make()
    assert reason in rows_problem(weights)
    with pytest.raises(ValueError, match=reason):
        concat_rows(weights)
