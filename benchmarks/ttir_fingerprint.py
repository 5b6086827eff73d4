"""Fingerprints of the Triton IR that the 4-bit kernels lower to, without source locations: a
refactor that leaves every fingerprint unchanged leaves the compiled GPU code unchanged, so its
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
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.matmul_4bit_block_dot import matmul_4bit_block_dot
from pallas_kernels.matmul_4bit_decoded_dot import matmul_4bit_decoded_dot
from pallas_kernels.matmul_4bit_gemv import matmul_4bit_gemv

N, K = 256, 1024
CASES = (  # name, kernel, M, kwargs
    ("gemv", matmul_4bit_gemv, 1, {}),
    ("gemv prmt", matmul_4bit_gemv, 2, dict(lookup="prmt")),
    ("block_dot exact", matmul_4bit_block_dot, 8, {}),
    ("block_dot prmt", matmul_4bit_block_dot, 16, dict(exact_codes=False, lookup="prmt")),
    ("decoded_dot prmt", matmul_4bit_decoded_dot, 48, {}),
    ("decoded_dot gather", matmul_4bit_decoded_dot, 48, dict(lookup="gather")),
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
    out = []
    for f, args in calls:
        with captured_triton_modules() as texts, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        out += [hashlib.sha1(t.encode()).hexdigest()[:16] for t in texts]
    return out


def main():
    for name, fn, m, kw in CASES:
        print(f"{name}: {' '.join(fingerprints(fn, m, kw))}", flush=True)


if __name__ == "__main__":
    main()
