"""Fingerprints of the code every registered kernel variant compiles to, without source locations.

A refactor that leaves every fingerprint unchanged leaves the compiled GPU code unchanged, so the
GPU measurements taken before it still hold. Runs on a CPU machine: each variant is lowered for a
CUDA sm90 target at a small shape it supports; the Triton modules (Triton lowering) and the Mosaic
GPU modules (after layout inference) are captured without debug info, and so is the StableHLO
around them (with location and source-file attributes removed).

    python tests/support/ir_fingerprint.py > before.txt
    (edit)
    python tests/support/ir_fingerprint.py | diff before.txt - && echo "same compiled code"

One line per (variant, scale format): the variant name, the shape, then one hash per captured
module and one for the surrounding StableHLO.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import warnings

if __package__ in (None, ""):  # run as a script: the repository root holds the packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp

BLOCKSIZE = 64
SHAPES = ((256, 1024), (4096, 4096), (14336, 4096), (4096, 14336))  # (N, K): out, in
MS = (1, 2, 16, 48, 128, 1024)


@contextlib.contextmanager
def captured_triton_modules():
    """Collect the location-free text of every Triton module lowered inside the block."""
    from jax._src.pallas.triton import lowering, pallas_call_registration as registration

    texts: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    gpu_info = getattr(registration, "gpu_info_lib", None)  # jax >= 0.11 asks the device
    saved_info = gpu_info.get_gpu_info if gpu_info is not None else None
    registration.lowering.lower_jaxpr_to_triton_module = capture
    if gpu_info is not None:
        info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
        gpu_info.get_gpu_info = lambda: info
    try:
        yield texts
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
        if gpu_info is not None:
            gpu_info.get_gpu_info = saved_info


@contextlib.contextmanager
def captured_mosaic_modules():
    """Collect the location-free text of every Mosaic GPU module lowered inside the block, as
    Pallas hands it on (layouts inferred, Mosaic's dialect lowered)."""
    from jax._src.pallas.mosaic_gpu import lowering

    texts: list[str] = []
    original = lowering.lower_jaxpr_to_module  # jax 0.10 and 0.11 alike

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        text = result.module.operation.get_asm(enable_debug_info=False)
        # jax 0.11 numbers each module's dump file name by a process-wide counter
        texts.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", text))
        return result

    lowering.lower_jaxpr_to_module = capture
    try:
        yield texts
    finally:
        lowering.lower_jaxpr_to_module = original


def _short(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _strip_hlo(text: str) -> str:
    """StableHLO text without what names a source file, a line or a process-wide counter."""
    text = re.sub(r"loc\([^\n]*?\)", "", text)
    text = re.sub(r"#loc\d*[^\n]*\n", "", text)
    # serialized kernels carry source locations; their location-free text is hashed above
    text = re.sub(r'backend_config = "(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r'\bir = "(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r'\bmodule = "(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r'\bkernel_hash = "(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r"mhlo\.frontend_attributes = \{[^}]*\}", "", text)
    text = re.sub(r"@[A-Za-z0-9_.]+", "@f", text)  # function names carry Python names
    return text


def hashes(f, args) -> list[str]:
    """One hash per kernel module lowered by `f(*args)` for sm90, then one for the StableHLO."""
    with captured_triton_modules() as texts, captured_mosaic_modules() as mosaic, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return [_short(t) for t in texts + mosaic] + ["hlo:" + _short(_strip_hlo(lowered.as_text()))]


def lowered_modules(f, args) -> tuple[list[str], list[str]]:
    """(Triton modules, Mosaic GPU modules) that `f(*args)` lowers to for CUDA sm90, as text."""
    with captured_triton_modules() as texts, captured_mosaic_modules() as mosaic, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return texts, mosaic


def module_hashes(f, args) -> list[str]:
    """One hash per kernel module lowered by `f(*args)` for sm90 (no StableHLO hash)."""
    return hashes(f, args)[:-1]


def fingerprints(fn, m: int, kw: dict, n: int = 256, k: int = 1024) -> list[str]:
    """Module hashes of a forward 4-bit kernel `fn(x, packed, absmax, code, blocksize=64,
    **kw)` on an (n, k) weight and M rows of bf16 x: double-quantized scales (de-nested by
    the kernel) first, then fp32 scales."""
    s = jax.ShapeDtypeStruct
    x, packed, code = s((m, k), jnp.bfloat16), s((n, k // 2), jnp.uint8), s((16,), jnp.float32)
    nested = (s((n * k // BLOCKSIZE // 256,), jnp.float32), s((256,), jnp.float32),
              s((), jnp.float32))

    def with_nested(x, p, a, c, na, nc, o):
        return fn(x, p, a, c, blocksize=BLOCKSIZE, nested=(na, nc, o), interpret=False, **kw)

    def flat(x, p, a, c):
        return fn(x, p, a, c, blocksize=BLOCKSIZE, interpret=False, **kw)

    return (module_hashes(with_nested, (x, packed, s((n, k // BLOCKSIZE), jnp.uint8), code,
                                        *nested))
            + module_hashes(flat, (x, packed, s((n, k // BLOCKSIZE), jnp.float32), code)))


def fingerprints_t(fn, m: int, kw: dict, n: int = 256, k: int = 1024) -> list[str]:
    """Module hashes of a backward 4-bit kernel `fn(dy, packed, absmax, code, blocksize=64,
    **kw)`, dy (M, n) bf16, fp32 scales."""
    s = jax.ShapeDtypeStruct
    args = (s((m, n), jnp.bfloat16), s((n, k // 2), jnp.uint8),
            s((n, k // BLOCKSIZE), jnp.float32), s((16,), jnp.float32))
    return module_hashes(
        lambda d, p, a, c: fn(d, p, a, c, blocksize=BLOCKSIZE, interpret=False, **kw), args)


def _args(op: str, m: int, n: int, k: int):
    """Abstract operands of `op` (see pallas_kernels.registry for the signatures), and the
    keyword arguments, for an M-row product with an (N, K) weight."""
    s = jax.ShapeDtypeStruct
    N, K = n, k
    packed, code = s((N, K // 2), jnp.uint8), s((16,), jnp.float32)
    absmax = s((N, K // BLOCKSIZE), jnp.float32)
    if op == "matmul_4bit":
        return (s((m, K), jnp.bfloat16), packed, absmax, code), dict(blocksize=BLOCKSIZE)
    if op == "matmul_4bit_t":
        return (s((m, N), jnp.bfloat16), packed, absmax, code), dict(blocksize=BLOCKSIZE)
    if op == "dequantize_4bit":
        return (packed, absmax, code), dict(blocksize=BLOCKSIZE, out_dtype=jnp.bfloat16)
    cb, scb = s((N, K), jnp.int8), s((N,), jnp.float32)
    if op in ("matmul_int8", "llm_int8"):
        kw = dict(threshold=6.0) if op == "llm_int8" else {}
        return (s((m, K), jnp.bfloat16), cb, scb), kw
    if op == "matmul_int8_t":
        return (s((m, N), jnp.bfloat16), cb, scb), {}
    raise ValueError(op)


def variant_fingerprints(v) -> list[str]:
    """Lines for one variant at every (M, N, K) it supports: fp32 scales, and double-quantized
    scales where it de-nests them."""
    bs = BLOCKSIZE if v.op.endswith("4bit") or v.op.endswith("4bit_t") else 0
    lines = []
    for n, k in SHAPES:
        for m in MS:
            if not v.supports(m, n, k, bs):
                continue
            lines += _fingerprints_at(v, m, n, k)
    return lines or [f"{v.name}: no supported shape"]


def _fingerprints_at(v, m: int, n: int, k: int) -> list[str]:
    args, kw = _args(v.op, m, n, k)
    at = f"{v.name} m={m} n={n} k={k}"
    f = lambda *a: v.fn(*a, interpret=False, **kw)  # noqa: E731
    lines = [f"{at}: {' '.join(hashes(f, args))}"]
    if v.accepts_nested:
        s = jax.ShapeDtypeStruct
        nested = (s((n * k // BLOCKSIZE // 256,), jnp.float32), s((256,), jnp.float32),
                  s((), jnp.float32))
        args = (*args[:2], s((n, k // BLOCKSIZE), jnp.uint8), *args[3:])

        def g(*a):
            return v.fn(*a[:4], nested=tuple(a[4:]), interpret=False, **kw)

        lines.append(f"{at} nested: {' '.join(hashes(g, (*args, *nested)))}")
    return lines


def main():
    from pallas_kernels import registry

    for v in registry.all_variants():
        try:
            lines = variant_fingerprints(v)
        except Exception as e:  # a variant that cannot lower here is a line too, not a crash
            lines = [f"{v.name}: cannot lower on this machine: {type(e).__name__}: {e}"[:300]]
        for line in lines:
            print(line, flush=True)


if __name__ == "__main__":
    main()
