"""Block-scaled dot at M = 16: one K tile per program (splits = all K tiles) against a K loop of
several tiles per program (fewer splits), at each Triton pipelining depth.

    python -m benchmarks.block_dot_loop_probe    # one JSON line per config

Recorded in results/..._block_dot_loop_probe.jsonl (s7-5); that run also tried
`lax.fori_loop(..., unroll=True)`, which the Pallas Triton lowering rejects (NotImplementedError).
"""
import json, jax, jax.numpy as jnp
from benchmarks.block_dot_sweep import _runner
from benchmarks.sweep_setup import bf16_us, nf4_weight_copies
from benchmarks.timing import distinct_copies, us_per_product
from pallas_kernels.triton.matmul_4bit_block_dot import matmul_4bit_block_dot
def main():
    for k, n, few, full in ((4096, 14336, 2, 8), (14336, 4096, 7, 28), (4096, 4096, 4, 8)):
        copies, dense, qs = nf4_weight_copies(k, n)
        x = jax.random.normal(jax.random.key(9), (16, k), jnp.bfloat16)
        xs = distinct_copies(x, copies)
        base = bf16_us(x, dense, k, n)
        cfgs = [dict(splits=full, num_stages=s) for s in (1, 2, 3)]
        cfgs += [dict(splits=few, num_stages=s) for s in (1, 2, 3, 4)]
        for cfg in cfgs:
            us = us_per_product(_runner(matmul_4bit_block_dot, dict(cfg, exact_codes=False)),
                                (xs, qs), copies)
            ratio = round(us / base, 3) if isinstance(us, float) else None
            print(json.dumps(dict(k=k, n=n, m=16, **cfg, us=us, ratio=ratio)), flush=True)


if __name__ == "__main__":
    main()
