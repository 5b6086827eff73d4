"""Fingerprints of the Triton IR that the 4-bit kernels lower to, and of the Mosaic GPU modules
of the Hopper kernels (after layout inference and dialect lowering), without source locations:
a refactor that leaves every fingerprint unchanged leaves the compiled GPU code unchanged, so its
GPU measurements still hold. Runs on a CPU machine (lowering only, for an sm90 target).

    python -m benchmarks.ttir_fingerprint > before.txt
    (edit)
    python -m benchmarks.ttir_fingerprint | diff before.txt - && echo "same Triton IR"

One line per kernel configuration: name, then one hash per pallas_call with double-quantized
scales de-nested in-kernel and one with fp32 scales.
"""
from __future__ import annotations

import contextlib
import hashlib
import re
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.triton.matmul_4bit_block_dot import matmul_4bit_block_dot
from pallas_kernels.triton.matmul_4bit_decoded_dot import matmul_4bit_decoded_dot
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv
from pallas_kernels.mosaic.matmul_4bit_mgpu import Config, matmul_4bit_mgpu
from pallas_kernels.mosaic.matmul_4bit_mgpu_gemv import GemvConfig, matmul_4bit_mgpu_gemv
from pallas_kernels.mosaic.matmul_4bit_mgpu_mma import MmaConfig, matmul_4bit_mgpu_mma
from pallas_kernels.mosaic.matmul_4bit_mgpu_t import ConfigT, matmul_4bit_mgpu_t

N, K = 256, 1024
CASES = (  # name, kernel, M, kwargs
    ("gemv", matmul_4bit_gemv, 1, {}),
    ("gemv prmt", matmul_4bit_gemv, 2, dict(lookup="prmt")),
    ("block_dot exact", matmul_4bit_block_dot, 8, {}),
    ("block_dot prmt", matmul_4bit_block_dot, 16, dict(exact_codes=False, lookup="prmt")),
    ("decoded_dot prmt", matmul_4bit_decoded_dot, 48, {}),
    ("decoded_dot gather", matmul_4bit_decoded_dot, 48, dict(lookup="gather")),
    ("mgpu", matmul_4bit_mgpu, 128, dict(config=Config(tile_m=128))),
    ("mgpu split-K", matmul_4bit_mgpu, 16, dict(config=Config(tile_m=16, k_splits=2))),
    ("mgpu_gemv", matmul_4bit_mgpu_gemv, 1, dict(config=GemvConfig(k_splits=2))),
    ("mgpu_mma", matmul_4bit_mgpu_mma, 16, dict(config=MmaConfig(k_splits=2))),
)
BACKWARD_CASES = (  # dx = dy @ W kernels, dy (M, N)
    ("mgpu_t", matmul_4bit_mgpu_t, 128, dict(config=ConfigT(tile_m=128))),
)


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


def _hashes(f, args) -> list[str]:
    with captured_triton_modules() as texts, captured_mosaic_modules() as mosaic, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return [hashlib.sha1(t.encode()).hexdigest()[:16] for t in texts + mosaic]


def fingerprints_t(fn, m: int, kw: dict) -> list[str]:
    """One hash per kernel module of a backward kernel (fp32 scales)."""
    s = jax.ShapeDtypeStruct
    args = (s((m, N), jnp.bfloat16), s((N, K // 2), jnp.uint8), s((N, K // 64), jnp.float32),
            s((16,), jnp.float32))
    return _hashes(lambda d, p, a, c: fn(d, p, a, c, blocksize=64, interpret=False, **kw), args)


def fingerprints(fn, m: int, kw: dict) -> list[str]:
    s = jax.ShapeDtypeStruct
    x, packed, code = s((m, K), jnp.bfloat16), s((N, K // 2), jnp.uint8), s((16,), jnp.float32)
    nested = (s((N * K // 64 // 256,), jnp.float32), s((256,), jnp.float32), s((), jnp.float32))
    calls = [
        (lambda x, p, a, c, na, nc, o: fn(x, p, a, c, blocksize=64, nested=(na, nc, o),
                                          interpret=False, **kw),
         (x, packed, s((N, K // 64), jnp.uint8), code, *nested)),
        (lambda x, p, a, c: fn(x, p, a, c, blocksize=64, interpret=False, **kw),
         (x, packed, s((N, K // 64), jnp.float32), code)),
    ]
    return [h for f, args in calls for h in _hashes(f, args)]


def main():
    for name, fn, m, kw in CASES:
        print(f"{name}: {' '.join(fingerprints(fn, m, kw))}", flush=True)
    for name, fn, m, kw in BACKWARD_CASES:
        print(f"{name}: {' '.join(fingerprints_t(fn, m, kw))}", flush=True)


if __name__ == "__main__":
    main()
