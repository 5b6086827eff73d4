"""Named kernel variants: one place that lists every kernel, so tests and benchmarks cover all.

A new variant is one file (kernel + jnp reference) plus one entry in `ALL_VARIANTS`.
The tuple is immutable; nothing registers itself at import time.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

# Operations a variant can implement, with the call signature each one has:
#   "matmul_4bit":     fn(x (M,K), packed (N,K//2) u8, absmax (N,K//bs) f32, code (16,) f32,
#                         *, blocksize, out_dtype, interpret) -> (M,N)      y = x @ dequant(W).T
#   "matmul_4bit_t":   fn(dy (M,N), packed, absmax, code, *, blocksize, out_dtype, interpret) -> (M,K)
#                                                                          dx = dy @ dequant(W)
#   "dequantize_4bit": fn(packed, absmax, code, *, blocksize, out_dtype, interpret) -> (N,K)
#   "matmul_int8":     fn(x (M,K), cb (N,K) i8, scb (N,) f32, *, out_dtype, interpret) -> (M,N)
#   "matmul_int8_t":   fn(dy (M,N), cb, scb, *, out_dtype, interpret) -> (M,K)
#   "llm_int8":        fn(x (M,K), cb, scb, *, threshold, out_dtype, interpret) -> (M,N)
# A 4-bit variant with `accepts_nested` also takes nested=(nested_absmax, nested_code, offset)
# with absmax the uint8 (N,K//bs) codes of double-quantized scales, and de-nests them itself.
PLATFORMS = ("gpu", "sm90")
OPS = ("matmul_4bit", "matmul_4bit_t", "dequantize_4bit", "matmul_int8", "matmul_int8_t", "llm_int8")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named kernel implementing one op; `supports(m, n, k, blocksize)` says which shapes it takes."""

    name: str
    op: str
    fn: Callable
    reference: Callable
    supports: Callable[[int, int, int, int], bool]
    description: str = ""
    accepts_nested: bool = False  # takes double-quantized scales via `nested=` (see above)
    platform: str = "gpu"  # "gpu": Triton lowering, any CUDA GPU; "sm90": Mosaic GPU, Hopper only
    interpret: bool = True  # runs under Pallas interpret mode on CPU (False: GPU only)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"variant {self.name!r}: unknown op {self.op!r}; expected one of {OPS}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"variant {self.name!r}: unknown platform {self.platform!r}; "
                             f"expected one of {PLATFORMS}")


# One entry per kernel module; a module lists its own variants in `VARIANTS`.
_MODULES = (
    "pallas_kernels.triton.dequantize_4bit",
    "pallas_kernels.triton.matmul_4bit",
    "pallas_kernels.triton.matmul_4bit_small_m",
    "pallas_kernels.triton.matmul_4bit_gemv",
    "pallas_kernels.triton.matmul_4bit_block_dot",
    "pallas_kernels.triton.matmul_4bit_decoded_dot",
    "pallas_kernels.mosaic.matmul_4bit_mgpu",
    "pallas_kernels.mosaic.matmul_4bit_mgpu_t",
    "pallas_kernels.mosaic.matmul_4bit_mgpu_gemv",
    "pallas_kernels.mosaic.matmul_4bit_mgpu_mma",
    "pallas_kernels.triton.matmul_4bit_t",
    "pallas_kernels.triton.matmul_int8",
    "pallas_kernels.triton.matmul_int8_gemv",
    "pallas_kernels.triton.matmul_llm_int8",
)


def all_variants() -> tuple[Variant, ...]:
    """Every registered variant, in a stable order (imports the kernel modules on first use)."""
    import importlib

    out: list[Variant] = []
    for mod in _MODULES:
        out.extend(importlib.import_module(mod).VARIANTS)
    names = [v.name for v in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate kernel variant names: {sorted(dup)}")
    return tuple(out)


def for_op(op: str) -> tuple[Variant, ...]:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    return tuple(v for v in all_variants() if v.op == op)


def get(name: str) -> Variant:
    for v in all_variants():
        if v.name == name:
            return v
    raise KeyError(f"no kernel variant named {name!r}; known: {[v.name for v in all_variants()]}")
