"""Named kernel variants: one place that lists every kernel, so tests and benchmarks cover all.

A new variant is one kernel module (kernel + `VARIANTS`, its jnp oracle in `reference/<family>.py`) plus
one line in `_MODULES`. The tuple is immutable; nothing registers itself at import time. The conformance
suite (tests/kernels/test_variants.py) runs every registered variant against its reference, so a new
registration is tested with no list to edit.

Each `Variant` says what it computes (`op`, `reference`, `numerics`), where it runs (`platform`,
`interpret`), which shapes it takes (`supports`), how it is configured (`config_type`,
`default_config`) and whether `auto` runs it (`status`). `module_of(name)` names the module that
declares a variant; `platform_available(platform)` says whether this process runs a platform's
kernels.

Config contract (what a tuning tool relies on):
- `config_type` is a frozen dataclass: `cfg = v.default_config(m, n, k, blocksize)` is an
  instance of it, the config the kernel uses when called without one;
  `dataclasses.replace(cfg, **overrides)` is another, run as `v.fn(..., config=cfg)`.
- `config_type is None`: the variant is configured by keyword arguments (block sizes, warps).
  `default_config(m, n, k, blocksize)`, where given, returns the dict of those keywords the kernel
  uses by default at that shape (keywords it leaves out are derived from the ones it lists);
  `v.fn(..., **{**v.default_config(m, n, k, bs), **overrides})` runs an override. Where
  `default_config` is None the variant takes no tuning keywords, or derives them all inline.
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
# Grouped (mixture-of-experts) ops, rows of x sorted by expert, group_sizes (E,) int32 summing to
# at most M (rows past the sum give zeros); listed by `grouped_variants()`, not `all_variants()`:
#   "grouped_matmul":        fn(x (M,K), group_sizes, w (E,N,K) in x's dtype, *, out_dtype,
#                               interpret) -> (M,N)                    y[rows of e] = x @ w[e].T
#   "grouped_matmul_t":      fn(dy (M,N), group_sizes, w (E,N,K), *, out_dtype, interpret) -> (M,K)
#   "grouped_matmul_4bit":   fn(x, group_sizes, packed (E,N,K//2) u8, absmax (E,N,K//bs) f32,
#                               code (16,) f32, *, blocksize, out_dtype, interpret) -> (M,N)
#   "grouped_matmul_4bit_t": the same operands with dy (M,N) -> (M,K)
GROUPED_OPS = ("grouped_matmul", "grouped_matmul_t", "grouped_matmul_4bit", "grouped_matmul_4bit_t")
# FP8 dequantization for the optional FP8 base products (jqlora.ops.fp8); listed by
# `fp8_variants()`, not `all_variants()`: they are no product of the dispatch table:
#   "dequantize_4bit_fp8":   fn(packed, absmax, code, inv_scale (N,) f32, *, blocksize, interpret)
#                            -> (N,K) float8_e4m3fn, W[n,k] * inv_scale[n] clipped to +-448
#   "dequantize_4bit_fp8_t": the same operands -> its transpose (K,N)
FP8_OPS = ("dequantize_4bit_fp8", "dequantize_4bit_fp8_t")
# Attention of cached decoding (jqlora.ops.cached_attention); listed by `attention_variants()`, not
# `all_variants()`; `supports(batch, heads, slots, head_dim)`:
#   "decode_attention": fn(q (B,h,d), k_cache, v_cache (L,B,S,kvh,d), layer, index, q_seg (B,),
#                          k_seg (B,S), *, scale, cap, window, out_dtype, interpret) -> (B,h,d)
ATTENTION_OPS = ("decode_attention",)
# The residual add and RMSNorm of decoding rows (jqlora.ops.decode_norm); listed by
# `norm_variants()`; `supports(rows, features)`:
#   "rms_norm": fn(x (M,N), delta None | (M,N) | (S,M,N) f32 partials, weight (N,), *, eps, kind,
#               interpret) -> (x + delta, RMSNorm(x + delta)), both in x's dtype
NORM_OPS = ("rms_norm",)
# What a variant computes, by the weight it effectively multiplies (docs/numerics.md); products
# are accumulated in fp32 and the output rounded once to out_dtype in every class:
NUMERICS = (
    "rounded_weight",       # round(code * absmax) to x's dtype: bitsandbytes' weight, the jnp path's
    "fp32_weight",          # code * absmax in fp32, never rounded; x widened to fp32
    "rounded_codes",        # round(code) * absmax: codes rounded to x's dtype, the scale in fp32
    "rounded_codes_twice",  # round(round(code) * absmax): rounded codes, the scaled weight rounded
    "int8_weight_only",     # x @ (CB * SCB/127).T in x's dtype: bitsandbytes' weight-only int8
    "llm_int8",             # bitsandbytes LLM.int8(): int8 x int8 GEMM + fp16 outlier columns
    "fp8_row_scaled",       # e4m3(code * absmax * inv_scale[row]): the FP8 base products' weight
    "online_softmax",       # attention: float32 scores and softmax, unrounded probabilities weight v
    "rms_norm",             # norm: float32 mean square of the rounded residual sum, transformers' roundings
)
# default: a variant `auto` runs (jqlora.ops.dispatch); alternative: useful numerics or speed,
# selected by `variant=`; experimental: kept for research, slower in every measured cell.
STATUSES = ("default", "alternative", "experimental")


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
    numerics: str = ""  # one of NUMERICS: the weight this variant multiplies (required)
    status: str = ""  # one of STATUSES: whether `auto` runs it (required)
    config_type: type | None = None  # the frozen config dataclass `fn(config=)` takes, or None
    # (m, n, k, blocksize) -> the config the kernel uses by default: a `config_type` instance,
    # or with config_type None a dict of keyword arguments (module docstring); None: no tuning
    default_config: Callable[[int, int, int, int], object] | None = None

    def __post_init__(self):
        if self.op not in OPS + GROUPED_OPS + FP8_OPS + ATTENTION_OPS + NORM_OPS:
            raise ValueError(f"variant {self.name!r}: unknown op {self.op!r}; "
                             f"expected one of {OPS + GROUPED_OPS + FP8_OPS + ATTENTION_OPS + NORM_OPS}")
        if self.platform not in PLATFORMS:
            raise ValueError(f"variant {self.name!r}: unknown platform {self.platform!r}; "
                             f"expected one of {PLATFORMS}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"variant {self.name!r}: unknown numerics {self.numerics!r}; "
                             f"expected one of {NUMERICS}")
        if self.status not in STATUSES:
            raise ValueError(f"variant {self.name!r}: unknown status {self.status!r}; "
                             f"expected one of {STATUSES}")
        if self.config_type is not None and not dataclasses.is_dataclass(self.config_type):
            raise ValueError(f"variant {self.name!r}: config_type must be a dataclass or None, "
                             f"got {self.config_type!r}")


# One entry per kernel module; a module lists its own variants in `VARIANTS`.
# One entry per kernel module; a module lists its own variants in `VARIANTS`. A module holding one
# variant family is named after it, as is its kernel function; matmul_4bit, matmul_4bit_t and
# matmul_int8 hold an op's two general forms (a fused kernel, and a dequant kernel + the vendor
# GEMM). The names compiled into the kernels (`pallas_call(name=...)`, the Mosaic kernel bodies)
# keep their own spellings: they are part of the compiled code and of the recorded profiles.
_MODULES = (
    "pallas_kernels.triton.dequant_tiled",
    "pallas_kernels.triton.matmul_4bit",
    "pallas_kernels.triton.splitk_small_m",
    "pallas_kernels.triton.gemv_block_scaled",
    "pallas_kernels.triton.block_scaled_dot",
    "pallas_kernels.triton.decoded_dot",
    "pallas_kernels.mosaic.mgpu_decoded_wgmma",
    "pallas_kernels.mosaic.mgpu_decoded_wgmma_t",
    "pallas_kernels.mosaic.mgpu_gemv_pair_table",
    "pallas_kernels.mosaic.mgpu_mma_pair_table",
    "pallas_kernels.triton.matmul_4bit_t",
    "pallas_kernels.triton.matmul_int8",
    "pallas_kernels.triton.int8_weight_only_gemv",
    "pallas_kernels.triton.llm_int8_tiled",
)
# The grouped (mixture-of-experts) kernels, ops GROUPED_OPS; tests/kernels/test_grouped_conformance.py
# runs each against its reference.
_GROUPED_MODULES = (
    "pallas_kernels.mosaic.grouped_mgpu",
    "pallas_kernels.mosaic.grouped_mgpu_4bit",
    "pallas_kernels.triton.grouped_dot",
)
# The FP8 dequant kernels, ops FP8_OPS; tests/kernels/test_dequant_fp8.py runs each against its
# reference.
_FP8_MODULES = ("pallas_kernels.triton.dequant_fp8",)
# The attention kernels of cached decoding, ops ATTENTION_OPS; tests/kernels/test_decode_attention.py
# runs each against its reference.
_ATTENTION_MODULES = ("pallas_kernels.triton.decode_attention",)
# The decoding rows' norm kernels, ops NORM_OPS; tests/kernels/test_rms_norm.py runs each against
# its reference.
_NORM_MODULES = ("pallas_kernels.triton.rms_norm",)


def _by_module(modules=_MODULES) -> tuple[tuple[str, tuple[Variant, ...]], ...]:
    """(module, its VARIANTS) for every registered module, in registry order."""
    import importlib

    return tuple((mod, tuple(importlib.import_module(mod).VARIANTS)) for mod in modules)


def _unique(out: tuple[Variant, ...], *others: tuple[Variant, ...]) -> tuple[Variant, ...]:
    """out, after checking that no name repeats within it or across the other families."""
    names = [v.name for v in out] + [v.name for family in others for v in family]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate kernel variant names: {sorted(dup)}")
    return out


def _family(modules) -> tuple[Variant, ...]:
    return tuple(v for _, variants in _by_module(modules) for v in variants)


def grouped_variants() -> tuple[Variant, ...]:
    """Every registered grouped (mixture-of-experts) variant, in a stable order."""
    return _unique(_family(_GROUPED_MODULES), all_variants())


def fp8_variants() -> tuple[Variant, ...]:
    """Every registered FP8 dequant variant (ops FP8_OPS), in a stable order."""
    return _unique(_family(_FP8_MODULES), all_variants(), grouped_variants())


def attention_variants() -> tuple[Variant, ...]:
    """Every registered attention variant (ops ATTENTION_OPS), in a stable order."""
    return _unique(_family(_ATTENTION_MODULES), all_variants(), grouped_variants(), fp8_variants())


def norm_variants() -> tuple[Variant, ...]:
    """Every registered norm variant (ops NORM_OPS), in a stable order."""
    return _unique(_family(_NORM_MODULES), all_variants(), grouped_variants(), fp8_variants(),
                   attention_variants())


def all_variants() -> tuple[Variant, ...]:
    """Every registered variant, in a stable order (imports the kernel modules on first use)."""
    return _unique(_family(_MODULES))


def module_of(name: str) -> str:
    """The module that declares variant `name` (e.g. "pallas_kernels.triton.matmul_4bit");
    KeyError naming the known variants otherwise."""
    for mod, variants in _by_module(_MODULES + _GROUPED_MODULES + _FP8_MODULES + _ATTENTION_MODULES
                                    + _NORM_MODULES):
        if any(v.name == name for v in variants):
            return mod
    get(name)  # raises the KeyError
    raise AssertionError(name)  # pragma: no cover - get() found a variant no module declares


def platform_available(platform: str) -> bool:
    """Whether this process runs `platform`'s kernels compiled: "gpu" (Triton lowering) needs a
    GPU as the default device; "sm90" (Mosaic GPU) a Hopper GPU and a jax whose Mosaic GPU has
    what the kernels use. Interpret mode (Triton variants on CPU) needs neither."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
    if platform == "sm90":
        from pallas_kernels import mosaic

        return mosaic.available()
    import jax

    return jax.default_backend() == "gpu"


def for_op(op: str) -> tuple[Variant, ...]:
    """The registered variants of one op (one of OPS), in registry order."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    return tuple(v for v in all_variants() if v.op == op)


def defaults() -> tuple[Variant, ...]:
    """The variants `auto` runs (status "default"), in registry order."""
    return tuple(v for v in all_variants() if v.status == "default")


def get(name: str) -> Variant:
    """The variant called `name` (grouped, FP8, attention and norm variants included); KeyError
    naming the known variants otherwise."""
    known = all_variants() + grouped_variants() + fp8_variants() + attention_variants() + norm_variants()
    for v in known:
        if v.name == name:
            return v
    raise KeyError(f"no kernel variant named {name!r}; known: {[v.name for v in known]}")
