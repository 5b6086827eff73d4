"""qmatmul: y = x @ W.T (+ LoRA) for a quantized W, with a custom_vjp that re-dequantizes.

A frozen dense W (lm_head, tied embeddings, an unquantized base) goes through the same custom_vjp,
so its backward runs in the compute dtype too.

Invariants (docs/design.md): the compute dtype is an argument (default: x's dtype), never the
checkpoint's stored dtype; inputs of any rank are flattened to 2-D here and only here; the
backward pass saves the packed weight and its scales (plus x, A, B and x @ A.T for LoRA) and
never a dense (N, K) weight; the frozen weight gets no gradient. numerics="fp8" (a 4-bit W,
`jqlora.ops.fp8`) replaces the two base products and keeps the same residuals.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import jqlora.ops.sharding as sharding
from jqlora.ops.fp8 import FP8_MIN_ROWS, backward_fp8, check_fp8_weight, forward_fp8
from jqlora.ops.dispatch import Plan, choose_plan
from jqlora.ops.products import acc_dtype, backward_product, dot_nn, dot_nt, forward_product, precision
from jqlora.quant import Int8Weight, Weight4bit

NUMERICS = ("weight_only", "llm_int8", "fp8")


@dataclasses.dataclass(frozen=True)
class _Static:
    plan: Plan
    numerics: str
    out_dtype: str


def _zero_cotangent(q):
    """Symbolic-zero-like cotangent for the frozen weight: float0 for integer leaves."""
    def zero(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.zeros_like(leaf)
        return jnp.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(zero, q)


# ---- without LoRA ---------------------------------------------------------------------------

def _weight_forward(st: _Static, x, q):
    """x @ W.T in the compute dtype, for a quantized or a frozen dense W."""
    if st.numerics == "fp8":
        return forward_fp8(st.plan, x, q, out_dtype=st.out_dtype)
    if isinstance(q, (Weight4bit, Int8Weight)):
        return forward_product(st.plan, x, q, out_dtype=st.out_dtype, numerics=st.numerics)
    return dot_nt(x, q.astype(x.dtype)).astype(st.out_dtype)


def _weight_backward(st: _Static, dy, q, out_dtype):
    """dy @ W. A custom backward for the dense case too: autodiff of `dot(x, w, f32).astype(cd)`
    hands the transposed dot a float32 cotangent, so XLA widens W to float32 and runs a float32
    GEMM, several times slower than the compute-dtype one for an LM head
    (benchmarks/results/JOURNAL.md). dy's values are exact in the compute dtype."""
    if st.numerics == "fp8":
        return backward_fp8(st.plan, dy, q, out_dtype=out_dtype)
    if isinstance(q, (Weight4bit, Int8Weight)):
        return backward_product(st.plan, dy, q, out_dtype=out_dtype)
    return dot_nn(dy, q.astype(dy.dtype)).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _base(st: _Static, x, q):
    return _weight_forward(st, x, q)


def _base_fwd(st, x, q):
    return _base(st, x, q), q  # residuals: the packed weight and scales only (or the frozen dense W)


def _base_bwd(st, q, dy):
    return _weight_backward(st, dy, q, dy.dtype), _zero_cotangent(q)


_base.defvjp(_base_fwd, _base_bwd)


# ---- with LoRA: y = x W^T + s (x A^T) B^T ---------------------------------------------------

def _hi_lo(u, dtype):
    """A float32 (M, r) as (M, 2r) in a 2-byte dtype: [round(u), round(u - round(u))], so the GEMMs
    over an (M, K) activation that contract u run on bf16 operands at nearly float32 accuracy
    (about 16 bits of u). As one float32 operand, dx's LoRA term and dA are HIGHEST-precision
    float32 GEMMs, slow at training shapes; u rounded once to bf16 (as PEFT's backward rounds it)
    is fast but loosens the LoRA gradients past the cuDNN-vs-einsum check's tolerance
    (benchmarks/results/JOURNAL.md). Wider dtypes pass through."""
    if jnp.dtype(dtype).itemsize != 2:
        return u
    hi = u.astype(dtype)
    return jnp.concatenate([hi, (u - hi.astype(u.dtype)).astype(dtype)], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_lora(st: _Static, scale: float, x, q, a, b):
    return _with_lora_fwd(st, scale, x, q, a, b)[0]


def _with_lora_fwd(st, scale, x, q, a, b):
    # Each branch is rounded to the compute dtype before the sum, as PEFT's bf16 layers do. A
    # float32 (M, N) base + float32 LoRA term then one rounding would cost two float32 (M, N)
    # writes and reads per layer (benchmarks/results/JOURNAL.md).
    base = _weight_forward(st, x, q)
    xa = dot_nt(x, a).astype(x.dtype)  # (M, r): the only LoRA activation kept for backward
    y = base + (scale * dot_nt(xa, b)).astype(st.out_dtype)
    return y, (x, q, a, b, xa)


def _with_lora_bwd(st, scale, res, dy):
    x, q, a, b, xa = res
    acc = acc_dtype(dy, x)
    r = a.shape[0]
    u = _hi_lo(dot_nn(dy, b), x.dtype)  # dY B (M, r), contracted through the rank first
    paired = u.shape[1] == 2 * r  # (M, 2r): a bf16 hi/lo pair, contracted against A twice
    dx = (_weight_backward(st, dy, q, x.dtype)
          + (scale * dot_nn(u, jnp.concatenate([a, a]) if paired else a)).astype(x.dtype))
    tn = (((0,), (0,)), ((), ()))  # contract over the rows M
    da = jax.lax.dot_general(u, x, tn, precision=precision(u, x), preferred_element_type=acc)  # U^T X
    da = scale * (da[:r] + da[r:] if paired else da)
    db = scale * jax.lax.dot_general(dy, xa, tn, precision=precision(dy, xa), preferred_element_type=acc)
    return dx, _zero_cotangent(q), da.astype(a.dtype), db.astype(b.dtype)


_with_lora.defvjp(_with_lora_fwd, _with_lora_bwd)


# ---- public entry point ---------------------------------------------------------------------

def qmatmul(
    x: jax.Array,
    q,
    *,
    compute_dtype=None,
    lora: tuple | None = None,
    backend: str = "auto",
    variant: str | None = None,
    numerics: str = "weight_only",
) -> jax.Array:
    """x @ W.T (+ scale * (x @ A.T) @ B.T) for x of shape (..., K) and W of logical shape (N, K).

    q: a `Weight4bit`, an `Int8Weight` or a dense (N, K) array (frozen in every case).
    compute_dtype: dtype of the products and of the result; defaults to x's dtype.
    lora: optional (A (r, K), B (N, r), scale). Gradients flow to x, A and B.
    backend: "auto" (Pallas on GPU, xla elsewhere), "pallas", "interpret" (Pallas on CPU) or "xla";
             which kernel each one runs: `jqlora.ops.dispatch` (docs/kernels.md).
    variant: force a named kernel variant from `pallas_kernels.registry` (kernel backends only).
    numerics: "weight_only" (default), or "llm_int8" to reproduce bitsandbytes' LLM.int8
              inference numerics for an Int8Weight (forward; the backward is weight-only), or
              "fp8" for a Weight4bit: both base products on float8_e4m3fn operands scaled per
              row (`jqlora.ops.fp8`; the LoRA branch stays in the compute dtype), from
              `jqlora.ops.fp8.FP8_MIN_ROWS` rows per device up; fewer rows run the "weight_only" product.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; expected one of {NUMERICS}")
    if numerics == "fp8":
        check_fp8_weight(q)
        if variant is not None:
            raise ValueError(f"variant={variant!r} names a compute-dtype kernel; numerics='fp8' "
                             "runs its own FP8 dequant kernels")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError("qmatmul needs x with at least one dimension (..., in_features)")
    quantized = isinstance(q, (Weight4bit, Int8Weight))
    shape = tuple(q.shape)
    if len(shape) != 2:
        raise ValueError(f"qmatmul needs a 2-D (out_features, in_features) weight, got shape {shape}")
    n, k = shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight is (out={n}, in={k}); y = x @ W.T")
    cd = jnp.dtype(compute_dtype if compute_dtype is not None else x.dtype)
    if not jnp.issubdtype(cd, jnp.floating):
        raise ValueError(f"compute dtype must be floating, got {cd}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(cd)  # the one place where N-D inputs become 2-D
    m = x2.shape[0]
    if not quantized:
        # as it is: no stop_gradient, no cast here (the custom_vjp casts to the compute dtype and gives
        # W no cotangent). A new value made of W here would be what the backward keeps, and a scan
        # over layers would save it per layer: a second copy of every dense weight.
        q = jnp.asarray(q)
    # under a training mesh each device multiplies its own rows by the whole weight (jqlora.parallel)
    local = sharding.local_rows(m)
    if numerics == "fp8" and local < FP8_MIN_ROWS:
        numerics = "weight_only"  # a few rows: the compute-dtype product (GEMV kernels), as generation runs
    # the dispatch table knows the compute-dtype kernels; fp8 reads only the backend from it
    plan = choose_plan(q, local, backend, variant=variant, numerics="weight_only" if numerics == "fp8" else numerics,
                       dtype=cd.name)
    st = _Static(plan, numerics, cd.name)
    if lora is None:
        y = sharding.per_device(functools.partial(_base, st), x2, q)
    else:
        a, b, scale = _check_lora(lora, n, k)
        y = sharding.per_device(functools.partial(_with_lora, st, float(scale)), x2, q, a.astype(cd), b.astype(cd))
    return y.reshape(*lead, n)


def _check_lora(lora, n, k):
    try:
        a, b, scale = lora
    except (TypeError, ValueError):
        raise ValueError("lora must be a tuple (A (r, in), B (out, r), scale)") from None
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA shapes A {a.shape}, B {b.shape} do not fit a weight (out={n}, in={k}): "
                         f"expected A (r, {k}) and B ({n}, r)")
    return a, b, scale
