"""Version shims for the Pallas GPU (Triton lowering) API, shared by the kernels in this package.

Works on jax 0.10.x (CPU dev/CI) and 0.11.x (GPU machine). Everything that differs across
versions lives here, so kernel modules stay version-agnostic.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

# The Triton-lowering helpers module: `jax.experimental.pallas.triton` (jax >= 0.4.3x, incl.
# 0.10/0.11); older releases called it `jax.experimental.pallas.gpu`.
try:  # pragma: no cover - which branch runs depends on the installed jax
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    from jax.experimental.pallas import gpu as plgpu  # type: ignore[no-redef]

# Compiler-params class for the Triton lowering: `CompilerParams` (new) / `TritonCompilerParams` (old).
_TritonParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")

# Squeezed block dimension marker: `pl.squeezed` (new); `None` works on every version we support.
SQUEEZED = getattr(pl, "squeezed", None)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap (n >= 1, cap >= 1)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def largest_divisor_at_most(n: int, cap: int) -> int:
    """Largest divisor of n that is <= cap (at least 1): K split counts that divide the tiles."""
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@functools.lru_cache(maxsize=None)
def _default_backend() -> str:
    return jax.default_backend()


def auto_interpret() -> bool:
    """True where Pallas GPU kernels cannot be compiled (no GPU backend): run them interpreted."""
    return _default_backend() not in ("gpu", "cuda", "rocm")


def resolve_interpret(interpret) -> bool:
    """`None` -> auto (interpret on CPU); otherwise the caller's choice as a bool."""
    return auto_interpret() if interpret is None else bool(interpret)


def compiler_params(num_warps: int | None = None, num_stages: int | None = None):
    """Triton compiler params (ignored in interpret mode)."""
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape, grid, in_specs, out_specs, interpret: bool,
                num_warps: int | None = None, num_stages: int | None = None, name: str | None = None):
    """`pl.pallas_call` with the kwargs every supported version accepts (interpret=None: auto)."""
    interpret = resolve_interpret(interpret)
    kwargs = dict(out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                  interpret=interpret, name=name)
    if not interpret:
        kwargs["compiler_params"] = compiler_params(num_warps, num_stages)
    return pl.pallas_call(kernel, **kwargs)


def fma_f32(a, b, c, *, interpret: bool):
    """a * b + c for float32 tensors of one shape, as one fused multiply-add on the GPU (inline
    PTX: the Triton lowering emits a multiply and an add, which LLVM does not contract here).
    Interpret mode computes a * b + c with jnp (XLA may or may not fuse it)."""
    if interpret:
        return a * b + c
    (out,) = plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, a.dtype)])
    return out


def load(ref, *, mask=None, other=None):
    """Masked load (Triton `tl.load` semantics); plain `ref[...]` when mask is None."""
    if mask is None:
        return ref[...]
    if other is not None and not hasattr(other, "dtype"):
        other = jax.numpy.asarray(other, dtype=ref.dtype)
    return plgpu.load(ref, mask=mask, other=other)


def store(ref, val, *, mask=None):
    """Masked store; plain `ref[...] = val` when mask is None."""
    if mask is None:
        ref[...] = val
    else:
        plgpu.store(ref, val, mask=mask)
