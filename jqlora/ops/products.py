"""The two products a quantized linear layer needs, y = x @ W.T and dx = dy @ W, per backend.

Both take 2-D operands already in the compute dtype and accumulate in float32. The xla backend
dequantizes with the jnp reference (a transient dense weight inside one function, never saved);
the kernel backends hand the packed bytes and scales to a Pallas variant from the registry.
Kernels are reached through `pallas_kernels.registry` only; the LLM.int8 xla path runs the jnp
oracle of `pallas_kernels.reference.int8`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jqlora.ops.dispatch import Plan
from jqlora.quant import Int8Weight, Weight4bit, absmax_f32, dequantize

_F32 = jnp.float32


def acc_dtype(*arrays):
    """Accumulation dtype: float32, or float64 when an operand is float64 (gradient checks)."""
    return jnp.result_type(_F32, *(a.dtype for a in arrays))


def precision(a, b):
    """float32 operands mean float32 products: GPUs would otherwise round them to TF32."""
    wide = any(jnp.dtype(x.dtype).itemsize >= 4 for x in (a, b))
    return jax.lax.Precision.HIGHEST if wide else None


def dot_nt(a, b):
    """a @ b.T with float32 (or wider) accumulation, without materializing b.T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision(a, b),
                               preferred_element_type=acc_dtype(a, b))


def dot_nn(a, b):
    """a @ b with float32 (or wider) accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision(a, b),
                               preferred_element_type=acc_dtype(a, b))


def kernel_operands_4bit(q: Weight4bit):
    """Packed bytes as (N, K/2) and fp32 scales as (N, K/bs): free reshapes of bitsandbytes' layout."""
    n, k = q.shape
    return q.packed.reshape(n, k // 2), absmax_f32(q).reshape(n, k // q.blocksize)


def nested_kernel_operands_4bit(q: Weight4bit):
    """For variants that de-nest in-kernel: packed (N, K/2), the uint8 scale codes (N, K/bs) and
    (nested_absmax, nested_code, offset); no fp32 scale array, no de-nest kernel before the call."""
    n, k = q.shape
    codes = q.absmax.reshape(n, k // q.blocksize)
    return q.packed.reshape(n, k // 2), codes, (q.nested_absmax, q.nested_code, q.offset)


def _variant(name: str):
    from pallas_kernels import registry

    return registry.get(name)


def run_kernel(fn, *operands, **settings):
    """`fn(*operands, **settings)` as a jitted call: the settings (blocksize, dtypes, interpret,
    threshold) static, the arrays (`nested` included) traced.

    Identical products then share one trace and one lowered function wherever they sit in a
    program: JAX caches a jitted function's trace by its input types, and lowering reuses a
    trace it has lowered. A kernel that is not jitted is lowered anew at every call site: a
    Gemma decoder scans each run of same-kind layers as a segment of its own, and Gemma 3 1B's
    9 segments lowered 63 copies of 7 Mosaic GPU kernels, about 0.5 s each; its generation
    programs compiled in 63-70 s, 21-22 s with this (benchmarks/results/JOURNAL.md,
    2026-11-29). Kernels that are jitted already (most Triton ones) run as they are."""
    if not hasattr(fn, "lower"):
        static = tuple(name for name, value in settings.items() if not isinstance(value, (tuple, jax.Array)))
        fn = jax.jit(fn, static_argnames=static)
    return fn(*operands, **settings)


def after(activation: jax.Array, q):
    """`q`, usable only once `activation` exists.

    Dequantization depends on nothing but the weight, so XLA's scheduler may hoist every layer's
    (transient) dense weight to the start of the backward pass, most of a deep stack's dense
    weights then alive at once (benchmarks/results/JOURNAL.md). Tying the weight to the
    activation it multiplies keeps one layer's dense weight alive at a time.
    """
    return jax.lax.optimization_barrier((activation, q))


def forward_product(plan: Plan, x: jax.Array, q, *, out_dtype, numerics: str = "weight_only") -> jax.Array:
    """y = x @ dequant(W).T, (M, K) x (N, K) -> (M, N) in out_dtype."""
    x, q = after(x, q)
    if numerics == "llm_int8":
        if not isinstance(q, Int8Weight):
            raise ValueError("numerics='llm_int8' applies to Int8Weight only")
        if plan.backend == "xla":
            from pallas_kernels.reference import int8 as int8_reference

            return int8_reference.llm_int8_matmul_reference(x, q.cb, q.scb,
                                                            threshold=q.threshold).astype(out_dtype)
        return run_kernel(_variant(plan.fwd).fn, x, q.cb, q.scb, threshold=q.threshold, out_dtype=out_dtype,
                          interpret=plan.interpret)
    if plan.backend == "xla":
        return dot_nt(x, dequantize(q, x.dtype)).astype(out_dtype)
    variant = _variant(plan.fwd)
    fn = variant.fn
    if isinstance(q, Weight4bit):
        if q.nested and variant.accepts_nested:
            packed, codes, nested = nested_kernel_operands_4bit(q)
            return run_kernel(fn, x, packed, codes, q.code, blocksize=q.blocksize, out_dtype=out_dtype,
                              interpret=plan.interpret, nested=nested)
        packed, absmax = kernel_operands_4bit(q)
        return run_kernel(fn, x, packed, absmax, q.code, blocksize=q.blocksize, out_dtype=out_dtype,
                          interpret=plan.interpret)
    return run_kernel(fn, x, q.cb, q.scb, out_dtype=out_dtype, interpret=plan.interpret)


def backward_product(plan: Plan, dy: jax.Array, q, *, out_dtype) -> jax.Array:
    """dx = dy @ dequant(W), (M, N) x (N, K) -> (M, K); dequantizes again instead of reusing."""
    dy, q = after(dy, q)
    if plan.backend == "xla":
        return dot_nn(dy, dequantize(q, dy.dtype)).astype(out_dtype)
    fn = _variant(plan.bwd).fn
    if isinstance(q, Weight4bit):
        packed, absmax = kernel_operands_4bit(q)
        return run_kernel(fn, dy, packed, absmax, q.code, blocksize=q.blocksize, out_dtype=out_dtype,
                          interpret=plan.interpret)
    return run_kernel(fn, dy, q.cb, q.scb, out_dtype=out_dtype, interpret=plan.interpret)
