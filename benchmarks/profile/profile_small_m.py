"""A few calls of the small-M NF4 or INT8 `qmatmul` (or the bf16 `jnp.dot`), for Nsight Compute.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:matmul_4bit_splitk \
        --launch-skip 2 --launch-count 1 --set detailed python -m benchmarks.profile.profile_small_m q 1

Modes: q (NF4 qmatmul), int8, dense, gemv (the block-scaled GEMV kernel on double-quantized
NF4, nested in-kernel): `... profile_small_m gemv 1 4096 14336 block_n=32 block_k=512`, and
block_dot (the block-scaled tensor-core kernel, rounded codes, the same way; `exact_codes=1` for
the exact table, `lookup=prmt` for the in-register lookup): `... profile_small_m block_dot 16
4096 14336`, and decoded_dot (the decoded-weight tensor-core kernel, any M, its keyword
arguments likewise): `... profile_small_m decoded_dot 2048 4096 4096 block_m=256`, and mgpu /
mgpu_t (the Hopper Mosaic GPU kernels, forward and dx; DecodedWgmmaConfig / DecodedWgmmaTConfig fields as keywords):
`ncu -k regex:matmul_4bit_mgpu_kernel ... profile_small_m mgpu 16 4096 14336 tile_m=16`, and
mgpu_gemv (the Hopper pair-table GEMV, M <= 2; GemvPairTableConfig fields as keywords), and mgpu_mma
(the Hopper pair-table MMA kernel; MmaPairTableConfig fields as keywords).

Without preallocation off, ncu cannot save and restore device memory for kernel replay.
"""
from __future__ import annotations

import sys
import types

# mode -> the Hopper Mosaic GPU variant it runs (config fields as keywords, `benchmarks.tune` rules)
MOSAIC = types.MappingProxyType({"mgpu": "mgpu_decoded_wgmma", "mgpu_t": "mgpu_decoded_wgmma_t",
          "mgpu_gemv": "mgpu_gemv_pair_table", "mgpu_mma": "mgpu_mma_pair_table"})


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jqlora import ops, quant

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    mode, m = args[0], int(args[1])
    k, n = (int(args[2]), int(args[3])) if len(args) > 3 else (4096, 14336)
    cfg = {key: int(v) if v.lstrip("-").isdigit() else v
           for key, v in (a.split("=") for a in args[4:])}
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((m, k), np.float32).astype(jnp.bfloat16))
    if mode in ("q", "int8"):
        w = jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.02, jnp.bfloat16)
        q = quant.quantize_4bit(w, "nf4", 64, True) if mode == "q" else quant.quantize_int8(w)
        f = jax.jit(lambda x: ops.qmatmul(x, q, backend="pallas"))
    elif mode in ("gemv", "block_dot", "decoded_dot"):
        from jqlora.ops.products import nested_kernel_operands_4bit
        from pallas_kernels.triton.block_scaled_dot import block_scaled_dot as matmul_4bit_block_dot
        from pallas_kernels.triton.gemv_block_scaled import gemv_block_scaled as matmul_4bit_gemv

        w = jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.02, jnp.bfloat16)
        q = quant.quantize_4bit(w, "nf4", 64, True)
        packed, codes, nested = nested_kernel_operands_4bit(q)
        if mode == "gemv":
            kernel = matmul_4bit_gemv
        elif mode == "decoded_dot":
            from pallas_kernels.triton.decoded_dot import decoded_dot as kernel
        else:
            kernel = matmul_4bit_block_dot
            cfg["exact_codes"] = bool(cfg.get("exact_codes", 0))
        f = jax.jit(lambda x: kernel(x, packed, codes, q.code, blocksize=64, nested=nested, **cfg))
    elif mode in MOSAIC:
        from benchmarks.tune import resolve_config
        from jqlora.ops.products import kernel_operands_4bit, nested_kernel_operands_4bit
        from pallas_kernels import registry

        v = registry.get(MOSAIC[mode])
        w = jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.02, jnp.bfloat16)
        q = quant.quantize_4bit(w, "nf4", 64, True)
        fields = ",".join(f"{key}={val}" for key, val in cfg.items())
        # mgpu / mgpu_t: fields alone build the config; the pair-table kernels: the default's
        text = (fields or "default") if mode in ("mgpu", "mgpu_t") else f"default,{fields}"
        kw = resolve_config(v, text.rstrip(","), m, n, k, 64)
        if v.accepts_nested:
            packed, codes, nested = nested_kernel_operands_4bit(q)
            f = jax.jit(lambda x: v.fn(x, packed, codes, q.code, blocksize=64, nested=nested, **kw))
        else:  # dx = dy @ W: dy is (M, N)
            packed, absmax = kernel_operands_4bit(q)
            x = jax.device_put(rng.standard_normal((m, n), np.float32).astype(jnp.bfloat16))
            f = jax.jit(lambda dy: v.fn(dy, packed, absmax, q.code, blocksize=64, **kw))
    elif mode == "dense":
        w = jax.device_put((rng.standard_normal((n, k), np.float32) * 0.02).astype(jnp.bfloat16))
        f = jax.jit(lambda x: jnp.dot(x, w.T))
    else:
        raise SystemExit(f"mode must be 'q' (NF4), 'int8', 'gemv', 'block_dot', 'decoded_dot', "
                         f"'mgpu', 'mgpu_t', 'mgpu_gemv', 'mgpu_mma' or 'dense', got {mode!r}")
    for _ in range(5):
        jax.block_until_ready(f(x))


if __name__ == "__main__":
    main()
