"""Which implementation computes a quantized product: the jnp reference ("xla") or a Pallas kernel.

A `Plan` is a small hashable record chosen once per call from the backend name, the weight's
format and the row count M. It is static (a nondiff argument of the custom_vjp), so a traced
function never decides anything at run time and no state is kept between calls.
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from jqlora.quant import Int8Weight, Weight4bit

log = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "interpret", "xla")
SMALL_M = 64  # INT8: at or below this many rows the split-K kernel streams CB once
# 4-bit, at or below this many rows: the block-scaled GEMV (H200, session 5, same run: M = 1
# 0.86-0.88x bf16 against the split-K kernel's 1.11-1.17x; M = 2 1.21-1.26x against 1.27-1.36x;
# s7-3 again at M = 2: 1.24 / 1.28 / 1.30 against 1.32 / 1.36 / 1.40).
GEMV_MAX_M_4BIT = 2
# 4-bit, GEMV_MAX_M_4BIT < M <= this: the block-scaled tensor-core kernel with the code table
# rounded to x's dtype and looked up in registers (block_scaled_dot_prmt). H200, session 8
# (results/..._lookup_probe_s8_2.json, _s8_4.json; ratios to bf16 at 4096x4096 / 4096x14336 /
# 14336x4096): M = 3 1.26 / 1.07 / 1.31 against split-K's 1.39 / 1.48 / 1.55 (the
# previous choice at M = 3); M = 16 1.21-1.24 / 1.07-1.13 / 1.30-1.33 against the table-gather
# form's 1.48-1.51 / 1.33-1.37 / 1.59-1.62 (the previous choice at 4..16). Effective weight
# round(code) * absmax where bitsandbytes (and dequant_dot) use round(code * absmax): the same
# error bound, another rounding point. At M = 32 even with decoded_dot_prmt (session 9, s9-4:
# 1.28 / 1.24 / 1.49 against 1.30 / 1.21 / 1.30).
BLOCK_DOT_MAX_M_4BIT = 32
# 4-bit, BLOCK_DOT_MAX_M_4BIT < M <= this: the decoded-weight tensor-core kernel
# (decoded_dot_prmt: scale applied per weight, 64-row x tiles). H200, s9-4: M = 64 1.16 / 1.51
# / 1.55 against block_scaled_dot_prmt's 1.46 / 1.92 / 1.96 and dequant_dot's 1.68 / 2.37
# / 2.34. Both kernels pad x to 64 rows for any M in 33..64, so their cost there is M = 64's.
# Weight round(round(code) * absmax): within about one ulp of x's dtype of bitsandbytes'. At
# M = 128 dequant_dot wins (1.78 / 2.56 / 2.24 against 2.03 / 3.01 / 2.36 at best).
DECODED_DOT_MAX_M_4BIT = 64
# 4-bit on a Hopper GPU with 16-bit activations, GEMV_MAX_M_4BIT < M <= this: the Mosaic GPU
# kernel (mgpu_decoded_wgmma: warp-specialized TMA pipeline, weight decoded in registers as the
# wgmma operand). H100, session 14, s14-8 and s14-9 (results/..._s14_mgpu_defaults_*.json;
# ratios to bf16 at 4096x4096 / 4096x14336 / 14336x4096, old and new `auto` in one process):
# M = 16 0.88 / 0.68 / 0.66 against block_scaled_dot_prmt's 0.96 / 0.85 / 0.96; M = 64 0.80 /
# 0.74 / 0.67 against decoded_dot_prmt's 1.01 / 1.07 / 1.12; M = 128 0.98 / 0.94 / 0.79 against
# dequant_dot's 1.74 / 2.44 / 2.14; M = 1024 1.27 / 1.45 / 1.25 against 1.36 / 1.38 / 1.38 (one
# shape lost); M = 4 1.03 / 0.74 / 0.72 against 0.99 / 0.80 / 0.90. At M = 2048 dequant_dot is
# ahead (1.21 / 1.21 / 1.20 against the kernel's 1.28 / 1.31 / 1.25); at M <= 2 the GEMV
# (0.71 / 0.63 / 0.62 against 1.03 / 0.79 / 0.73).
MGPU_MAX_M_4BIT = 1024
# 4-bit backward (dx = dy @ W) on Hopper with 16-bit dy, M <= this: the Mosaic GPU backward
# kernel (mgpu_decoded_wgmma_t: weight tiles decoded to shared memory, dy . W by wgmma). H100,
# s14-10 (results/..._s14_mgpu_bwd.json; ratio to the dense bf16 dy @ W): M = 16 1.64 / 1.47 /
# 1.52 against dequant_dot_t's 1.81 / 2.44 / 2.36; M = 128 1.50 / 1.50 / 1.83 against 1.74 /
# 2.24 / 2.46. At M = 256 dequant_dot_t is ahead (1.73-2.21 against 2.17-2.98).
# Session 23 (128 weight rows a step where N is split too): H100 s23-11 M = 1 / 16 / 128 1.43 /
# 1.36 / 1.26 at 4096x4096 and 1.18 / 1.14 / 1.18 at 4096x14336 (dequant_dot_t 1.74-2.53).
MGPU_T_MAX_M_4BIT = 128
# 4-bit on Hopper with 16-bit x, M <= GEMV_MAX_M_4BIT where the MMA kernel below does not take
# the product (since session 19 only shapes it excludes, e.g. blocksize 32 or N % 256 != 0):
# the Mosaic GPU pair-table GEMV (mgpu_gemv_pair_table: one conflict-free shared-memory load
# gives a byte's two fp32 codes).
# H100, session 17, s17-10 (results/..._s17_mgpu_gemv_staged_vs_step_time.json; ratios to bf16
# at 4096x4096 / 4096x14336 / 14336x4096, same run): M = 1 0.603 / 0.473 / 0.451 against the
# Triton GEMV's 0.714 / 0.632 / 0.620; M = 2 0.681 / 0.483 / 0.503 against 0.969 / 0.701 / 0.749.
# 4-bit on Hopper with 16-bit x, MGPU_MMA_MIN_M_4BIT <= M <= MGPU_MMA_MAX_M_4BIT: the Mosaic GPU
# pair-table MMA kernel (mgpu_mma_pair_table: one shared-memory load turns a byte into an
# mma.sync operand word; codes rounded to x's dtype, absmax applied to fp32 group sums). Since
# session 19 its weight tile is swizzled and its x loads conflict-free; H200, s19-2
# (results/..._s19_mma_swizzle_time.json; ratios to bf16 at 4096x4096 / 4096x14336 /
# 14336x4096, same run): M = 1 0.724 / 0.544 / 0.525 against the pair-table GEMV's 0.739 /
# 0.586 / 0.587 (so it takes M = 1 too); M = 2 0.730 / 0.559 / 0.538 against 0.819 / 0.676 /
# 0.659; M = 16 0.784 / 0.607 / 0.594 against mgpu_decoded_wgmma's 0.948 / 0.901 / 0.925 and
# its own unswizzled session-18 form's 0.883 / 0.733 / 0.717.
# Session 22 raised the kernel's M from 16 to 64 (eight n8 token tiles); H100, s22-12 and s22-13
# (results/..._s22_m32_time.json, ..._s22_m64_time.json, each one run): M = 17 0.617 / 0.387 /
# 0.448 against mgpu_decoded_wgmma's 0.831 / 0.663 / 0.690, M = 32 0.671 / 0.454 / 0.474 against
# 0.707 / 0.588 / 0.606, M = 48 0.743 / 0.627 / 0.568 against 0.833 / 0.690 / 0.680; at M = 64
# the wgmma kernel is ahead (0.738 / 0.648 / 0.616 against 0.869 / 0.789 / 0.701).
MGPU_MMA_MIN_M_4BIT = 1
MGPU_MMA_MAX_M_4BIT = 48

# Default variant names per (weight kind, op); the registry in pallas_kernels holds them all.
# Measured on an H200 (benchmarks/results): at large M the fused kernels are decode-bound
# (2.6-3.2x bf16), a transient dequant + cuBLAS GEMM is 1.13-1.17x; the dense tile lives for one
# call only, never as a residual. Small M streams the packed weight once in the forward. The
# small-M backward is dequant_dot_t too: in the 2026-11-21 H200 run the fused in-register twin of
# the forward (fused_tiled) ran at 4.1-15.5x bf16 at M <= 16 against dequant_dot's 2.2-2.9x, and
# qmatmul forward+backward with fused_tiled_t at M <= 16 at 2.4-7.2x. dequant_dot_t itself was
# not timed at small M in that run (benchmarks/results/README.md).
DEFAULT_4BIT_FWD_LARGE = "dequant_dot"
DEFAULT_4BIT_FWD_GEMV = "gemv_block_scaled"
DEFAULT_4BIT_FWD_BLOCK_DOT = "block_scaled_dot_prmt"
DEFAULT_4BIT_FWD_DECODED_DOT = "decoded_dot_prmt"
DEFAULT_4BIT_FWD_MGPU = "mgpu_decoded_wgmma"
DEFAULT_4BIT_FWD_MGPU_GEMV = "mgpu_gemv_pair_table"
DEFAULT_4BIT_FWD_MGPU_MMA = "mgpu_mma_pair_table"
DEFAULT_4BIT_BWD_MGPU = "mgpu_decoded_wgmma_t"
DEFAULT_4BIT_BWD_LARGE = "dequant_dot_t"
DEFAULT_4BIT_BWD_SMALL = "dequant_dot_t"
# INT8 (H200, 2026-11-21, benchmarks/results README, session 4): at M <= 16 the split-K kernel
# takes 0.57-0.86x the bf16 GEMM time where XLA's dequant + GEMM takes 2.9-3.8x; at M >= 2048 the
# dequantize_int8 kernel + cuBLAS takes 1.03-1.21x where the tiled Triton kernel takes 1.44-1.84x
# (M = 2048). The backward recomputes W the same way at every M.
DEFAULT_INT8_FWD_SMALL = "int8_weight_only_splitk"
DEFAULT_INT8_FWD_LARGE = "int8_dequant_dot"
DEFAULT_INT8_BWD = "int8_dequant_dot_t"
# LLM.int8 numerics under `auto` stay on the jnp path ("xla": XLA's int8 GEMM): in the H200 run
# s7-3 (results/..._int8_numerics_probe.json, all 15 protocol cells) it was faster than this
# kernel everywhere, threshold 0: 0.68-1.26x bf16 against 0.98-3.40x. backend="pallas" runs it.
DEFAULT_LLM_INT8 = "llm_int8_tiled"


class BackendError(ValueError):
    """The requested backend cannot compute this product (shape, format or platform)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    backend: str  # "xla", "pallas" or "interpret"
    fwd: str | None = None  # kernel variant names (None for xla)
    bwd: str | None = None

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def mgpu_available() -> bool:
    """A Hopper GPU and a jax whose Mosaic GPU runs `mgpu_decoded_wgmma`."""
    from pallas_kernels.mosaic import matmul_4bit_mgpu

    return matmul_4bit_mgpu.available()


def _kernel_shape_problem(q) -> str | None:
    if isinstance(q, Weight4bit):
        if len(q.shape) != 2:
            return f"the 4-bit kernels take a 2-D weight, this one has shape {q.shape}"
        k = q.shape[1]
        if k % 2 or k % q.blocksize:
            return (f"the 4-bit kernels need in_features ({k}) to be even and a multiple of the "
                    f"blocksize ({q.blocksize}) so that blocks do not span rows")
    return None


def _mgpu_fits(q: Weight4bit, m: int, dtype, backward: bool = False, gemv: bool = False,
               mma: bool = False) -> bool:
    """Whether the Mosaic GPU kernels take this product: Hopper, 16-bit operands, their shapes,
    and M in the range where they measured faster."""
    from pallas_kernels.mosaic import (
        matmul_4bit_mgpu, matmul_4bit_mgpu_gemv, matmul_4bit_mgpu_mma, matmul_4bit_mgpu_t)

    n, k, bs = q.shape[0], q.shape[1], q.blocksize
    if dtype not in ("bfloat16", "float16"):
        return False
    if mma:
        fits = (MGPU_MMA_MIN_M_4BIT <= m <= MGPU_MMA_MAX_M_4BIT
                and matmul_4bit_mgpu_mma.supports(m, n, k, bs))
    elif gemv:
        fits = m <= GEMV_MAX_M_4BIT and matmul_4bit_mgpu_gemv.supports(m, n, k, bs)
    elif backward:
        fits = m <= MGPU_T_MAX_M_4BIT and matmul_4bit_mgpu_t.supports_t(m, n, k, bs)
    else:
        fits = GEMV_MAX_M_4BIT < m <= MGPU_MAX_M_4BIT and matmul_4bit_mgpu.supports(m, n, k, bs)
    return fits and mgpu_available()


def _variants_for(q, m: int, numerics: str, dtype: str | None) -> tuple[str, str]:
    if isinstance(q, Weight4bit):
        fwd, bwd = _variants_4bit(m)
        if _mgpu_fits(q, m, dtype, mma=True):
            fwd = DEFAULT_4BIT_FWD_MGPU_MMA
        elif _mgpu_fits(q, m, dtype):
            fwd = DEFAULT_4BIT_FWD_MGPU
        elif _mgpu_fits(q, m, dtype, gemv=True):
            fwd = DEFAULT_4BIT_FWD_MGPU_GEMV
        if _mgpu_fits(q, m, dtype, backward=True):
            bwd = DEFAULT_4BIT_BWD_MGPU
        return fwd, bwd
    if numerics == "llm_int8":
        return DEFAULT_LLM_INT8, DEFAULT_INT8_BWD
    return (DEFAULT_INT8_FWD_SMALL if m <= SMALL_M else DEFAULT_INT8_FWD_LARGE), DEFAULT_INT8_BWD


def _variants_4bit(m: int) -> tuple[str, str]:
    """The 4-bit kernels for M rows where the Mosaic GPU ones do not apply."""
    if m <= GEMV_MAX_M_4BIT:
        return DEFAULT_4BIT_FWD_GEMV, DEFAULT_4BIT_BWD_SMALL
    if m <= BLOCK_DOT_MAX_M_4BIT:
        return DEFAULT_4BIT_FWD_BLOCK_DOT, DEFAULT_4BIT_BWD_SMALL
    if m <= DECODED_DOT_MAX_M_4BIT:
        return DEFAULT_4BIT_FWD_DECODED_DOT, DEFAULT_4BIT_BWD_SMALL
    return DEFAULT_4BIT_FWD_LARGE, DEFAULT_4BIT_BWD_LARGE


def choose_plan(q, m: int, backend: str, *, variant: str | None = None, numerics: str = "weight_only",
                dtype: str | None = None) -> Plan:
    """Resolve `backend` for weight `q`, M rows and compute dtype name `dtype` (None: unknown,
    which rules out the kernels that take 16-bit operands only). Explicit backends never fall
    back silently."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if not isinstance(q, (Weight4bit, Int8Weight)):
        if backend in ("pallas", "interpret"):
            raise BackendError(f"backend {backend!r} has kernels only for quantized weights; a dense weight uses 'xla'")
        return Plan("xla")
    if backend == "xla":
        return Plan("xla")
    problem = _kernel_shape_problem(q)
    if backend == "auto":
        if not on_gpu():
            return Plan("xla")
        if numerics == "llm_int8":
            # the kernel is bit-exact with bitsandbytes on the GPU (compiled suite) but slower
            # than XLA's int8 GEMM in every measured cell (DEFAULT_LLM_INT8's comment)
            log.debug("qmatmul auto backend: llm_int8 numerics use xla (measured faster)")
            return Plan("xla")
        if problem:
            log.debug("qmatmul auto backend: falling back to xla: %s", problem)
            return Plan("xla")
        backend = "pallas"
    elif problem:
        raise BackendError(f"backend {backend!r}: {problem}")
    if backend == "pallas" and not on_gpu():
        raise BackendError("backend 'pallas' needs a GPU; use 'interpret' to run the kernels on CPU, or 'xla'")
    fwd, bwd = _variants_for(q, m, numerics, dtype)
    if variant is not None:
        fwd = variant
    _check_variant(fwd, q, m)
    if fwd in (DEFAULT_4BIT_FWD_MGPU, DEFAULT_4BIT_FWD_MGPU_GEMV, DEFAULT_4BIT_FWD_MGPU_MMA,
               DEFAULT_4BIT_BWD_MGPU) and (
            backend == "interpret" or not mgpu_available()):
        raise BackendError(f"kernel variant {fwd!r} runs on a Hopper GPU only (Mosaic GPU, "
                           "inline PTX; no interpret mode)")
    return Plan(backend, fwd, bwd)


def _check_variant(name: str, q, m: int) -> None:
    from pallas_kernels import registry

    v = registry.get(name)
    n, k = q.shape[0], q.shape[-1]
    bs = q.blocksize if isinstance(q, Weight4bit) else 0
    want = "matmul_4bit" if isinstance(q, Weight4bit) else ("matmul_int8", "llm_int8")
    if v.op not in (want if isinstance(want, tuple) else (want,)):
        raise BackendError(f"kernel variant {name!r} implements {v.op!r}, not a product with this weight")
    if not v.supports(m, n, k, bs):
        raise BackendError(f"kernel variant {name!r} does not support M={m}, N={n}, K={k}, blocksize={bs}")
