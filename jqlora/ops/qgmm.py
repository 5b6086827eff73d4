"""qgmm: the grouped product of a mixture-of-experts layer, y[rows of e] = x[rows of e] @ W_e.T.

x (M, K) holds tokens already sorted by expert: the first group_sizes[0] rows go to expert 0, the
next group_sizes[1] to expert 1, and so on; rows past sum(group_sizes) give zeros. The experts
(`jqlora.quant.ExpertWeights`: NF4/FP4, int8 or a float stack) are frozen, as in `qmatmul`: the
custom_vjp returns a gradient for x only, and its backward pass keeps the packed experts and the
group sizes, never a dense expert stack, and dequantizes again (dx[rows of e] = dy @ W_e).

Which implementation runs each product is decided once per call by
`jqlora.ops.grouped_dispatch.choose_grouped_plan` (the `GROUPED_RULES` table; `explain_grouped`
says why). The "xla" path dequantizes the stack with the jnp reference and runs `jax.lax.ragged_dot_general`
(a dense expansion on GPU: fine on CPU, slow at real sizes on a GPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jqlora.ops.dispatch import Plan
from jqlora.ops.grouped_dispatch import choose_grouped_plan
from jqlora.ops.products import acc_dtype, after, precision, run_kernel
from jqlora.quant import ExpertWeights, Weight4bit, absmax_f32, dequantize_experts

# y = x @ W_e.T: contract x's K (dim 1) with the stack's K (dim 2); dx = dy @ W_e: dy's N with dim 1
_NT = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_NN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


@dataclasses.dataclass(frozen=True)
class _Static:
    plan: Plan
    out_dtype: str
    compute_dtype: str  # x's dtype: dy is cast to it, dx comes back in it


def ragged_reference(a, group_sizes, w, *, transpose: bool, out_dtype):
    """The jnp grouped product: a @ w[e].T per group (transpose=True) or a @ w[e], w (E, N, K)
    already in a's dtype; float32 (or wider) sums, one rounding to out_dtype."""
    dn = _NT if transpose else _NN
    y = jax.lax.ragged_dot_general(a, w, group_sizes, dn, precision=precision(a, w),
                                   preferred_element_type=acc_dtype(a, w))
    return y.astype(out_dtype)


def _zero_cotangent(tree):
    """Zero cotangent for frozen inputs: float0 for integer leaves (codes, group sizes)."""
    def zero(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.zeros_like(leaf)
        return jnp.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(zero, tree)


def kernel_operands(experts: ExpertWeights):
    """What the grouped kernels take: for 4-bit, packed (E, N, K/2) and float32 scales
    (E, N, K/bs), free reshapes of the per-expert bitsandbytes layout (nested scales de-nested)."""
    s = experts.stack
    e, n, k = experts.shape
    if isinstance(s, Weight4bit):
        scales = jax.vmap(absmax_f32)(s) if s.nested else s.absmax
        return s.packed.reshape(e, n, k // 2), scales.reshape(e, n, k // s.blocksize), s.code[0]
    raise ValueError(f"no grouped kernel operands for a {experts.format} expert stack")


def _product(plan: Plan, a, gs, experts, *, transpose: bool, out_dtype):
    """One grouped product of the plan: forward (transpose=True, y = a @ W_e.T) or backward."""
    a, experts = after(a, experts)
    name = plan.fwd if transpose else plan.bwd
    if plan.backend == "xla" or name is None:
        w = dequantize_experts(experts, a.dtype)  # transient: never a residual
        return ragged_reference(a, gs, w, transpose=transpose, out_dtype=out_dtype)
    from pallas_kernels import registry

    v = registry.get(name)
    if v.op.startswith("grouped_matmul_4bit"):
        packed, absmax, code = kernel_operands(experts)
        return run_kernel(v.fn, a, gs, packed, absmax, code, blocksize=experts.blocksize, out_dtype=out_dtype,
                          interpret=plan.interpret)
    w = _dequantize_for_kernel(experts, a.dtype, plan.interpret)  # a transient pass, then the kernel
    return run_kernel(v.fn, a, gs, w, out_dtype=out_dtype, interpret=plan.interpret)


def _dequantize_for_kernel(experts: ExpertWeights, dtype, interpret: bool):
    """The (E, N, K) stack in `dtype` for a dense-operand grouped kernel: a 4-bit stack through
    the `dequant_tiled` kernel on its (E*N, K) rows (bit-exact with the jnp reference, at HBM
    bandwidth where XLA's gather of the code table is several times slower), others with jnp."""
    if not isinstance(experts.stack, Weight4bit):
        return dequantize_experts(experts, dtype)
    from pallas_kernels import registry

    e, n, k = experts.shape
    packed, absmax, code = kernel_operands(experts)
    w = run_kernel(registry.get("dequant_tiled").fn, packed.reshape(e * n, k // 2), absmax.reshape(e * n, -1),
                   code, blocksize=experts.blocksize, out_dtype=dtype, interpret=interpret)
    return w.reshape(e, n, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qgmm(st: _Static, x, group_sizes, experts):
    return _product(st.plan, x, group_sizes, experts, transpose=True, out_dtype=st.out_dtype)


def _qgmm_fwd(st, x, group_sizes, experts):
    # residuals: the group sizes and the packed experts, never a dense expert stack. The experts
    # saved are the ones tied to x (`after`): under remat the backward's dequantization then
    # waits for x to be recomputed, so XLA cannot run it ahead of the layer's earlier products
    # and keep two dense expert stacks alive at once (a Qwen3-30B-A3B-shaped step held the
    # gate_up and down stacks together, 1.1 GiB, at its peak).
    x, experts = after(x, experts)
    return _qgmm(st, x, group_sizes, experts), (group_sizes, experts)


def _qgmm_bwd(st, res, dy):
    group_sizes, experts = res
    dy = dy.astype(st.compute_dtype)
    dx = _product(st.plan, dy, group_sizes, experts, transpose=False, out_dtype=st.compute_dtype)
    return dx, _zero_cotangent(group_sizes), _zero_cotangent(experts)


_qgmm.defvjp(_qgmm_fwd, _qgmm_bwd)


def qgmm(x, group_sizes, experts: ExpertWeights, *, backend: str = "auto", out_dtype=None,
         variant: str | None = None) -> jax.Array:
    """Grouped y = x @ W_e.T for tokens sorted by expert.

    x: (M, K) floating, the compute dtype of both products (dx comes back in it).
    group_sizes: (E,) integer, rows per expert in order; sum <= M (rows past it give zeros).
    experts: an `ExpertWeights` of E experts of shape (N, K) (frozen: no gradient).
    backend: "auto" (a Pallas kernel on a GPU where `GROUPED_RULES` has one, the jnp reference
             elsewhere), "pallas", "interpret" (kernels in Pallas interpret mode on CPU) or "xla".
    out_dtype: dtype of y; defaults to x's dtype.
    variant: force a named grouped kernel variant for the forward product (kernel backends).
    Returns y (M, N).
    """
    if not isinstance(experts, ExpertWeights):
        raise ValueError(f"qgmm: experts must be an ExpertWeights, got {type(experts).__name__}")
    x = jnp.asarray(x)
    group_sizes = jnp.asarray(group_sizes)
    e, n, k = experts.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"qgmm: x must be (M, {k}) for experts of shape (E={e}, N={n}, K={k}), "
                         f"got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"qgmm: x must be floating, got {x.dtype}")
    if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"qgmm: group_sizes must be an integer ({e},) array (one count per expert), "
                         f"got {group_sizes.dtype}{tuple(group_sizes.shape)}")
    od = jnp.dtype(out_dtype if out_dtype is not None else x.dtype)
    plan = choose_grouped_plan(experts, x.shape[0], backend, variant=variant, dtype=x.dtype.name)
    return _qgmm(_Static(plan, od.name, x.dtype.name), x, group_sizes.astype(jnp.int32), experts)
