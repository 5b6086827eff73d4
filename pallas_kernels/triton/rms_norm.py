"""`rms_norm`: the residual add and RMSNorm of a few decoding rows as one kernel.

Why: at one token a row, XLA runs a decoder layer's norm as two kernels (the mean square as a
reduction, then the scaling that reads it) and the residual add that feeds it as a third, or
folds the add and the product's K-split sum into the reduction, which then takes about 3 us
(a 1B decode, H200: about 8 us a layer for the two norms, docs/kernels.md). Each is a launch of
about a microsecond for a few KB of work. Here one program per row adds the residual,
normalises and scales: one launch of 1.6-1.9 us.

Layout: program i takes row i whole, in power-of-two pieces (`row_chunk`: Gemma's widths are not
powers of two): the residual, the delta and the weight; it stores the new residual and the
normalised row. In 5 or more pieces it is slower than XLA's norm, so `jqlora.ops.decode_norm`
chooses it by default for powers of two only. The delta is one (M, N) array in x's dtype, or a
product's S float32 K-split partials (S, M, N), summed here; the decoder layers hand over the
product's output whole (summing o_proj's partials in this kernel measured slower, docs/kernels.md). Numerics: "rms_norm"
(`pallas_kernels.reference.norm`): the oracle's roundings, its float32 sums in another order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.reference.norm import check_rms_norm_operands, rms_norm_reference
from pallas_kernels.registry import Variant

reference = rms_norm_reference

MAX_FEATURES = 16384  # a row held in registers by one program: Llama-3-70B's 8192 with room
MAX_CHUNK = 4096
MAX_CHUNKS = 32  # pieces of a row (Gemma 3 27B: 5376 = 21 x 256)


def _kernel(*refs, chunk: int, splits: int, eps: float, kind: str, has_delta: bool):
    row = pl.program_id(0)
    if has_delta:
        x_ref, d_ref, w_ref, r_ref, h_ref = refs
    else:
        x_ref, w_ref, h_ref = refs
    n = x_ref.shape[1]
    parts = [pl.ds(j, chunk) for j in range(0, n, chunk)]  # a row in power-of-two pieces
    xs = [x_ref[row, c] for c in parts]
    if has_delta:
        for j, c in enumerate(parts):
            if splits:
                total = d_ref[0, row, c].astype(jnp.float32)
                for s in range(1, splits):
                    total = total + d_ref[s, row, c].astype(jnp.float32)
                delta = total.astype(xs[j].dtype)
            else:
                delta = d_ref[row, c].astype(xs[j].dtype)
            xs[j] = (xs[j].astype(jnp.float32) + delta.astype(jnp.float32)).astype(xs[j].dtype)
            r_ref[row, c] = xs[j]
    # the pieces' squares summed elementwise, then one reduction: a reduction per piece is a
    # block-wide sum each (nine of them at Gemma 3 1B's 1152 = 9 x 128: 3.6 us, docs/kernels.md)
    squares = xs[0].astype(jnp.float32) * xs[0].astype(jnp.float32)
    for x in xs[1:]:
        squares = squares + x.astype(jnp.float32) * x.astype(jnp.float32)
    square = jnp.sum(squares)
    inv = jax.lax.rsqrt(square / n + eps)
    for x, c in zip(xs, parts):
        h = x.astype(jnp.float32) * inv
        w = w_ref[c]
        if kind == "gemma":
            out = (h * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        else:  # round h, then the weight times it in x's dtype
            out = (w.astype(x.dtype).astype(jnp.float32) * h.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
        h_ref[row, c] = out


def row_chunk(features: int) -> int:
    """The power-of-two piece a row is held in: the largest that divides it, at most MAX_CHUNK."""
    return _compat.largest_pow2_divisor(features, MAX_CHUNK)


@functools.partial(jax.jit, static_argnames=("eps", "kind", "interpret", "num_warps"))
def rms_norm(x, delta, weight, *, eps: float, kind: str = "llama", interpret=False, num_warps=4):
    """-> (r, normed) in x's dtype: r = x + delta (delta None: r is x), normed = RMSNorm(r).
    x (M, N); delta (M, N), or (S, M, N) float32 partials of a product summed here; weight (N,)."""
    check_rms_norm_operands(x, delta, weight, kind, what="rms_norm")
    m, n = x.shape
    if not supports(m, n):
        raise ValueError(f"rms_norm: {n} features (the kernel takes up to {MAX_FEATURES} in at most "
                         f"{MAX_CHUNKS} power-of-two pieces of at least 64)")
    has_delta = delta is not None
    splits = delta.shape[0] if has_delta and delta.ndim == 3 else 0
    operands = (x, delta, weight) if has_delta else (x, weight)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, r=a.ndim: (0,) * r)  # noqa: E731 - indexed in-kernel
    row_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    out_shape = (row_shape, row_shape) if has_delta else (row_shape,)
    outs = _compat.pallas_call(
        functools.partial(_kernel, chunk=row_chunk(n), splits=splits, eps=float(eps), kind=kind, has_delta=has_delta),
        out_shape=out_shape, grid=(m,), in_specs=[whole(a) for a in operands],
        out_specs=tuple(whole(o) for o in out_shape), interpret=interpret, num_warps=num_warps,
        num_stages=1, name="rms_norm",
    )(*operands)
    return (outs[0], outs[1]) if has_delta else (x, outs[0])


def supports(rows: int, features: int) -> bool:
    """Shapes the kernel takes: rows of up to MAX_FEATURES in at most MAX_CHUNKS power-of-two
    pieces of at least 64 (every Llama, Qwen and Gemma width)."""
    chunk = row_chunk(features) if features > 0 else 0
    return (rows > 0 and 0 < features <= MAX_FEATURES and chunk >= 64
            and features // chunk <= MAX_CHUNKS)


VARIANTS = (
    Variant(
        name="rms_norm",
        op="rms_norm",
        fn=rms_norm,
        reference=rms_norm_reference,
        supports=supports,
        description="a decoding row's residual add (a product's K-split partials summed in) and "
                    "RMSNorm, one program a row: one launch where XLA runs two or three",
        numerics="rms_norm",
        status="default",
    ),
)
