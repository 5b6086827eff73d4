"""Weights of one input stacked along their output rows: W = [W_1; W_2; ...] as one weight of the
same format, so that products sharing an input (q, k and v; gate and up) run as one product.

A 4-bit weight's blocks run over the row-major flattened tensor, so the pieces' packed bytes and
per-block scales concatenate as they are when no block spans two pieces (every piece's size a
multiple of the blocksize). Double quantization does not concatenate: each piece's nested scales
carry their own offset (the mean subtracted before nesting), so the stacked weight holds the
de-nested float32 scales (`absmax_f32`, bitsandbytes' two roundings) and dequantizes to exactly
the pieces' values, at 3 more bytes per block. An LLM.int8 weight's scales are per row: its rows
and scales concatenate. Plain arrays concatenate."""
from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from jqlora.quant.fourbit import absmax_f32
from jqlora.quant.weights import Int8Weight, Weight4bit


def rows_problem(weights: Sequence) -> Optional[str]:
    """Why `weights` cannot be stacked into one weight of their format, or None when they can."""
    if len(weights) < 2:
        return "fewer than two weights"
    first = weights[0]
    kinds = {type(w) for w in weights}
    if len(kinds) > 1:
        return f"mixed formats: {sorted(k.__name__ for k in kinds)}"
    ins = {int(w.shape[-1]) for w in weights}
    if len(ins) > 1 or any(len(w.shape) != 2 for w in weights):
        return f"not 2-D weights of one input width: shapes {[tuple(w.shape) for w in weights]}"
    if isinstance(first, Weight4bit):
        meta = {(w.quant_type, w.blocksize, w.stored_dtype) for w in weights}
        if len(meta) > 1:
            return f"different 4-bit formats (quant type, blocksize, stored dtype): {sorted(meta)}"
        if any(w.numel % w.blocksize for w in weights):
            return f"a block would span two weights: sizes {[w.numel for w in weights]}, blocksize {first.blocksize}"
        return None  # the code table follows from the quant type
    if isinstance(first, Int8Weight):
        meta = {(w.threshold, w.stored_dtype) for w in weights}
        return None if len(meta) == 1 else f"different LLM.int8 settings (threshold, stored dtype): {sorted(meta)}"
    dtypes = {jnp.dtype(w.dtype) for w in weights}
    return None if len(dtypes) == 1 else f"different dtypes: {sorted(map(str, dtypes))}"


def concat_rows(weights: Sequence):
    """One weight of (sum of out, in) whose rows are the weights' rows in order; ValueError naming
    the reason when they cannot be stacked (`rows_problem`)."""
    problem = rows_problem(weights)
    if problem:
        raise ValueError(f"concat_rows: {problem}")
    first = weights[0]
    out = sum(int(w.shape[0]) for w in weights)
    if isinstance(first, Weight4bit):
        return Weight4bit(
            packed=jnp.concatenate([w.packed for w in weights]),
            absmax=jnp.concatenate([absmax_f32(w).astype(jnp.float32) for w in weights]),
            code=first.code, shape=(out, int(first.shape[1])), quant_type=first.quant_type,
            blocksize=first.blocksize, stored_dtype=first.stored_dtype)
    if isinstance(first, Int8Weight):
        return Int8Weight(cb=jnp.concatenate([w.cb for w in weights]), scb=jnp.concatenate([w.scb for w in weights]),
                          threshold=first.threshold, stored_dtype=first.stored_dtype)
    return jnp.concatenate([jnp.asarray(w) for w in weights])
