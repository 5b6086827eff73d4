"""Which implementation runs the residual adds and RMSNorms of a decoding step (one new token a row).

- `backend="auto"` (the models' default): the `rms_norm` kernel on a GPU for widths that are a
  power of two (Llama's, Qwen's) where no mesh splits the rows; elsewhere XLA. Gemma's widths
  (640, 1152, 2304, 2560, 3840, 5376) the kernel takes in 5 to 21 pieces, and there it measured
  1.2-3.4x slower than XLA's norm (docs/kernels.md).
- `"pallas"`: the kernel wherever it takes the width; `"interpret"`: the same in Pallas interpret
  mode (the CPU tests); `"xla"`: XLA. As for the decode attention (`jqlora.ops.cached_attention`),
  a width the kernel does not take falls back to XLA, which computes the same.

The kernel and XLA compute the same roundings (`pallas_kernels.reference.norm`). Prefill and
training rows always take XLA: there the norms are a small part of a step and XLA fuses them
with their neighbours.
"""
from __future__ import annotations

from typing import Optional

import jax

from jqlora.ops.dispatch import decoding_backend_problem
from jqlora.ops.sharding import product_mesh


def norm_problem(backend: str, shape: tuple) -> Optional[str]:
    """Why the kernel does not run the norm of x of shape (B, T, N) (None: it runs)."""
    from pallas_kernels.triton.rms_norm import supports

    problem = decoding_backend_problem(backend, "XLA's norm")
    if problem is not None:
        return problem
    b, t, n = shape
    if t != 1:
        return f"{t} new tokens (the kernel takes decoding rows, one token a row)"
    if not supports(b, n):
        return f"width {n} (the kernel takes up to 16384 in power-of-two pieces of at least 64)"
    if backend == "auto" and n & (n - 1):
        return f"width {n} is not a power of two (in pieces the kernel is slower than XLA's norm)"
    if product_mesh(b) is not None:
        return "a mesh splits the rows"
    return None


def add_rms_norm(x, delta, weight, *, eps: float, kind: str, backend: str) -> tuple[jax.Array, jax.Array]:
    """(r, RMSNorm(r)) with r = x + delta (x when delta is None), x and delta (B, 1, N), in x's
    dtype. Call where `norm_problem` is None."""
    from pallas_kernels.triton.rms_norm import rms_norm

    b, t, n = x.shape
    flat = lambda a: None if a is None else a.reshape(b * t, n)  # noqa: E731
    r, h = rms_norm(flat(x), flat(delta), weight, eps=float(eps), kind=kind, interpret=backend == "interpret")
    return r.reshape(x.shape), h.reshape(x.shape)
