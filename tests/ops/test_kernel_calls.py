"""The door into the kernels (`jqlora.ops.products`) lowers each distinct product once per
program, however many places call it: a Gemma decoder scans each run of same-kind layers as a
segment of its own, and with a Mosaic GPU kernel lowered at every call site Gemma 3 1B's
generation programs took 63-70 s to compile, 21-22 s with one lowering a product
(benchmarks/results/JOURNAL.md, 2026-11-29). Checked by lowering for CUDA on the CPU, as the
Mosaic kernels' own tests do."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from mosaic_lowering import lower_text_for_cuda

from jqlora import quant
from jqlora.ops import products
from jqlora.ops.dispatch import Plan

N, K, BS = 256, 512, 64


def _segments(x, q, plan, backward=False):
    """Two layer segments, each a scan over its own closure (as `jqlora.models` builds them),
    both running the same product."""
    def segment(length, tag):
        def body(carry, _):
            if backward:
                return carry, products.backward_product(plan, x, q, out_dtype=jnp.bfloat16) + tag
            return carry, products.forward_product(plan, x, q, out_dtype=jnp.bfloat16) + tag
        return lax.scan(body, 0, None, length=length)[1]
    return segment(2, 0.0), segment(3, 1.0)


def _lowered(m, rows, plan, backward=False) -> str:
    w = jax.ShapeDtypeStruct((N, K), jnp.float32)
    q = jax.eval_shape(lambda w: quant.quantize_4bit(w, "nf4", BS, True), w)
    x = jax.ShapeDtypeStruct((m, rows), jnp.bfloat16)
    return lower_text_for_cuda(lambda x, q: _segments(x, q, plan, backward), x, q)


@pytest.mark.parametrize("variant,m", [("mgpu_mma_pair_table", 1), ("mgpu_decoded_wgmma", 16)])
def test_a_product_called_from_two_segments_is_lowered_once(variant, m):
    text = _lowered(m, K, Plan("pallas", fwd=variant))
    # one kernel custom call in one shared function, called from both segments
    assert text.count("custom_call @mosaic_gpu") == 1


def test_the_backward_product_is_lowered_once_too():
    text = _lowered(16, N, Plan("pallas", bwd="mgpu_decoded_wgmma_t"), backward=True)
    assert text.count("custom_call @mosaic_gpu") == 1


def test_a_jitted_kernel_runs_as_it_is():
    """Kernels that are jitted already are not wrapped again (a second wrapper would lower as a
    second function); the others are, with their settings static and their arrays (a `nested`
    tuple included) traced."""
    seen = []

    def kernel(x, w, *, scale, nested=None):
        seen.append((type(x).__name__, scale, type(nested[0]).__name__))
        return x * scale + nested[0]

    out = jax.jit(lambda x: products.run_kernel(kernel, x, x, scale=2.0, nested=(x,)))(jnp.ones(3))
    assert out.tolist() == [3.0, 3.0, 3.0]
    assert seen == [("DynamicJaxprTracer", 2.0, "DynamicJaxprTracer")]
    def add(x, w):
        return x + w

    jitted = jax.jit(add)
    assert products.run_kernel(jitted, jnp.ones(2), jnp.ones(2)).tolist() == [2.0, 2.0]
    text = jax.jit(lambda x: products.run_kernel(jitted, x, x)).lower(jnp.ones(2)).as_text()
    assert re.findall(r"func\.func private @(\w+)", text) == ["add"]


@pytest.mark.parametrize("fwd", ["mgpu_grouped_dot_4bit", "mgpu_grouped_dot"])
def test_a_grouped_product_called_from_two_segments_is_lowered_once(fwd):
    """The experts' grouped products go through the same door (`jqlora.ops.qgmm`)."""
    import importlib

    qgmm = importlib.import_module("jqlora.ops.qgmm")  # the module (jqlora.ops re-exports its function)
    e, n, k = 4, 256, 256
    w = jax.ShapeDtypeStruct((e, n, k), jnp.float32)
    experts = jax.eval_shape(lambda w: quant.quantize_experts(w, "nf4", BS, True), w)
    x = jax.ShapeDtypeStruct((64, k), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((e,), jnp.int32)
    plan = Plan("pallas", fwd=fwd)

    def program(x, gs, experts):
        def segment(length, tag):
            def body(carry, _):
                return carry, qgmm._product(plan, x, gs, experts, transpose=True, out_dtype=jnp.bfloat16) + tag
            return lax.scan(body, 0, None, length=length)[1]
        return segment(2, 0.0), segment(3, 1.0)

    assert lower_text_for_cuda(program, x, gs, experts).count("custom_call @mosaic_gpu") == 1
