"""The GEMV at M = 1, 2: its K split default against one K tile per program, pipelining depth,
and neighbouring tiles.

    python -m benchmarks.gemv_loop_probe     # one JSON line per config

Recorded in results/..._gemv_loop_probe.jsonl (s7-6) when the default (`{}` rows) was still the
largest split count <= ~1024 programs; the default is now one K tile per program (the
`splits=nk` rows of that file).
"""
import json, jax, jax.numpy as jnp
from benchmarks.block_dot_sweep import _runner
from benchmarks.sweep_setup import bf16_us, nf4_weight_copies
from benchmarks.timing import distinct_copies, us_per_product
from pallas_kernels.triton.dequantize_4bit import scale_block_chunks
from pallas_kernels.triton.matmul_4bit_gemv import matmul_4bit_gemv, default_config
def main():
    for k, n in ((4096, 14336), (14336, 4096), (4096, 4096)):
        copies, dense, qs = nf4_weight_copies(k, n)
        bn, bk, nw = default_config(n, k)
        nk = scale_block_chunks(k, 64, bk)[4]
        for m in (1, 2):
            x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
            xs = distinct_copies(x, copies)
            base = bf16_us(x, dense, k, n)
            cfgs = [dict(), dict(num_stages=1), dict(splits=nk), dict(splits=nk, num_stages=1)]
            if bk > 128:
                nk2 = scale_block_chunks(k, 64, bk // 2)[4]
                cfgs += [dict(block_k=bk // 2, splits=nk2), dict(block_n=bn * 2, splits=nk),
                         dict(block_n=bn * 2, num_warps=nw * 2, splits=nk)]
            for cfg in cfgs:
                us = us_per_product(_runner(matmul_4bit_gemv, cfg), (xs, qs), copies)
                ratio = round(us / base, 3) if isinstance(us, float) else None
                print(json.dumps(dict(k=k, n=n, m=m, default=[bn, bk, nw], nk=nk, **cfg, us=us,
                                      ratio=ratio)), flush=True)


if __name__ == "__main__":
    main()
