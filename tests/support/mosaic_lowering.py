"""Lowering a Mosaic GPU 4-bit kernel for CUDA on a machine without a GPU (the CPU tests of the
Hopper kernels): Pallas -> Mosaic GPU, layout inference and the inline PTX operands included.
Not a test module: the Mosaic kernel tests import it (tests/conftest.py puts tests/support/ on the path, as for
``checkpoint_factory``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jqlora import quant


def lower_for_cuda(kernel, m, n, k, bs, dtype=jnp.bfloat16, nested=True, **kw) -> str:
    """StableHLO text of `kernel(x, packed, absmax, code, blocksize=bs, nested=..., **kw)` on
    abstract NF4 operands of an (n, k) weight; skips where this jax cannot lower without a GPU."""
    w = jax.ShapeDtypeStruct((n, k), jnp.float32)
    q = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", bs, nested), w)
    x = jax.ShapeDtypeStruct((m, k), dtype)

    def f(x, q):
        absmax = q.absmax.reshape(n, k // bs)
        nest = (q.nested_absmax, q.nested_code, q.offset) if nested else None
        return kernel(x, q.packed.reshape(n, k // 2), absmax, q.code, blocksize=bs, nested=nest,
                      **kw)

    return lower_text_for_cuda(f, x, q)


def lower_text_for_cuda(f, *args) -> str:
    """StableHLO text of `jax.jit(f)` on `args` (arrays or ShapeDtypeStructs) lowered for CUDA;
    skips where this jax cannot lower Mosaic GPU kernels without a GPU."""
    try:
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001
        if "Unable to" in str(e) or "no CUDA" in str(e):  # pragma: no cover
            pytest.skip(f"this jax cannot lower Mosaic GPU kernels without a GPU: {e}")
        raise
