"""Which implementation runs a decoding step's attention: one new token per row over one layer of
the KV cache.

- `backend="auto"` (the models' default): the `decode_attention` kernel on a GPU where it takes
  the shape and no mesh splits the rows; elsewhere the model's einsum path.
- `"pallas"`: the kernel wherever it takes the shape; `"interpret"`: the same in Pallas interpret
  mode (the CPU tests); `"xla"`: the einsum path. The products' backends never fall back; this
  one does, to the path that computes the same attention: the backend names how the products
  run, and a model whose heads the kernel does not take must still decode under it.

The einsum path (`jqlora.models.attention.einsum_attention`) has transformers' numerics: the
probabilities are rounded to the activations' dtype before they weight v. The kernel keeps them
in float32 ("online_softmax", docs/numerics.md): the two agree to that rounding. Prefill (more
than one new token), sliding layers' ring buffers and head sizes that are not a power of two
always take the einsum path.
"""
from __future__ import annotations

from typing import Optional

import jax

from jqlora.ops.dispatch import decoding_backend_problem
from jqlora.ops.sharding import product_mesh


def kernel_problem(backend: str, q_shape: tuple, cache_shape: tuple) -> Optional[str]:
    """Why the kernel does not run this step (None: it runs). q (B, T, h, d); cache (L, B, S, kvh, d)."""
    from pallas_kernels.triton.decode_attention import supports

    problem = decoding_backend_problem(backend, "the einsum path")
    if problem is not None:
        return problem
    b, t, h, d = q_shape
    if t != 1:
        return f"{t} new tokens (the kernel takes one a row)"
    if not supports(b, h, cache_shape[2], d):
        return f"head_dim {d} (the kernel takes a power of two up to 256)"
    if product_mesh(b) is not None:
        return "a mesh splits the rows"
    return None


def decode_path(backend: str, batch: int, heads: int, head_dim: int) -> tuple[str, str]:
    """("kernel" | "einsum", why) for the decoding steps of a model whose layers keep whole caches
    (a sliding layer's ring buffer is always the einsum path): what `jqlora generate --timing`
    reports."""
    problem = kernel_problem(backend, (batch, 1, heads, head_dim), (1, batch, 1, 1, head_dim))
    if problem is None:
        return "kernel", f"{backend}: the decode_attention kernel, one launch a layer"
    return "einsum", f"{backend}: {problem}"


def decode_attention(q, k_cache, v_cache, layer, index, q_seg, k_seg, *, scale: float, cap: Optional[float],
                     window: Optional[int], backend: str, out_dtype=None) -> jax.Array:
    """(B, 1, h * d): q (B, 1, h, d) over row `layer` of k_cache, v_cache (L, B, S, kvh, d), the new
    token already written at slot `index`; q_seg (B, 1), k_seg (B, S). Call where `kernel_problem`
    is None."""
    from pallas_kernels.triton.decode_attention import decode_attention as kernel

    b, _, h, d = q.shape
    y = kernel(q[:, 0], k_cache, v_cache, layer, index, q_seg[:, 0], k_seg, scale=float(scale), cap=cap,
               window=window, out_dtype=out_dtype or q.dtype, interpret=backend == "interpret")
    return y.reshape(b, 1, h * d)
