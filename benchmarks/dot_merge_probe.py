"""Does sharing one x across the timed copies change the bf16 baseline? (It did: XLA's dot merger.)

    python -m benchmarks.dot_merge_probe

At 4096x4096 the benchmark times R = 4 products per call over 4 weight copies (L2 defeating).
With one shared x, XLA may merge the 4 dots into one wide GEMM plus concatenate/slice copies.
This prints, per M, the per-product device time of the bf16 product with a shared x and with
distinct copies of x, and of `qmatmul(backend="pallas")` (NF4 and INT8) with distinct copies.
The H200 output is in benchmarks/results/nvidia-h200-2026-11-21_dot_merge_probe.txt.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, jax_device_ms, l2_defeating_copies
from jqlora import ops, quant


def main():
    k = n = 4096
    c = l2_defeating_copies(n * k * 2)
    ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(c)]
    q4 = [quant.quantize_4bit(w, "nf4", 64, True) for w in ws]
    q8 = [quant.quantize_int8(w) for w in ws]
    per_product = lambda x, ws: [a @ w.T for a, w in zip(x, ws)]
    quantized = lambda xs, qs: [ops.qmatmul(a, q, backend="pallas") for a, q in zip(xs, qs)]
    for m in (1, 16, 128, 2048, 8192):
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        xs = distinct_copies(x, c)
        r = {"bf16 shared x": jax_device_ms(lambda x, ws: [x @ w.T for w in ws], x, ws),
             "bf16 distinct x": jax_device_ms(per_product, xs, ws),
             "nf4 distinct x": jax_device_ms(quantized, xs, q4),
             "int8 distinct x": jax_device_ms(quantized, xs, q8)}
        print(m, c, {name: round(ms / c * 1e3, 2) for name, ms in r.items()}, flush=True)


if __name__ == "__main__":
    main()
