"""What XLA's sum of K-split partials costs, by its form (session 22).

The pair-table MMA kernel with K splits and the INT8 split-K kernel leave fp32 partials that
XLA sums (and, for INT8, scales) in a fusion of its own: 1.3-1.8 us a call on the H100 (s21-8),
the gap between the MMA kernel alone (0.38 x bf16 at M = 16, 14336x4096) and the call (0.41),
and between INT8 M = 1 at 4096x4096 with and without it (0.58 / 0.69). This times that fusion
alone in the forms it could take, each over distinct copies of its input (device time, CUPTI):

- `reduce`: jnp.sum(p, axis=0) of (S, M, N), as `matmul_4bit_mgpu_mma` does;
- `adds`: p[0] + p[1] + ... (an elementwise loop fusion instead of a reduction);
- INT8 `padded`: the split-K kernel's (S * 16, N) output, reshaped, summed, sliced to M rows and
  scaled (what `matmul_int8_splitk` does at M = 1), against `rows`, the same with only the M
  real rows in the partials.

    python -m benchmarks.epilogue_probe        # writes epilogue_probe.json to the working dir
"""
from __future__ import annotations

import functools
import json
import operator

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, us_per_product

COPIES = 8


def _time(fn, p) -> float:
    ps = distinct_copies(p, COPIES)
    return us_per_product(lambda ps: [fn(a) for a in ps], (ps,), COPIES, iterations=20)


def nf4_forms(s: int, m: int, n: int) -> dict:
    p = jax.random.normal(jax.random.key(0), (s, m, n), jnp.float32)
    return {"reduce": _time(lambda a: jnp.sum(a, axis=0).astype(jnp.bfloat16), p),
            "adds": _time(lambda a: functools.reduce(operator.add, list(a)).astype(jnp.bfloat16),
                          p)}


def int8_forms(s: int, m: int, n: int, bm: int = 16) -> dict:
    scale = jax.random.uniform(jax.random.key(1), (n,), jnp.float32)
    padded = jax.random.normal(jax.random.key(0), (s * bm, n), jnp.float32)
    rows = padded.reshape(s, bm, n)[:, :m]

    def from_padded(a):
        acc = a.reshape(s, bm, n).sum(axis=0)[:m]
        return (acc * scale[None, :]).astype(jnp.bfloat16)

    def from_rows(a):
        return (jnp.sum(a, axis=0) * scale[None, :]).astype(jnp.bfloat16)

    return {"padded": _time(from_padded, padded), "rows": _time(from_rows, rows)}


def main():
    out = []
    for s, m, n in ((8, 16, 4096), (8, 1, 4096), (8, 16, 14336), (2, 16, 14336), (3, 16, 11008)):
        out.append(dict(kind="nf4_mma_partials", s=s, m=m, n=n, us=nf4_forms(s, m, n)))
        print(json.dumps(out[-1]), flush=True)
    for s, m, n in ((4, 1, 4096), (4, 16, 4096)):
        out.append(dict(kind="int8_splitk_epilogue", s=s, m=m, n=n, us=int8_forms(s, m, n)))
        print(json.dumps(out[-1]), flush=True)
    with open("epilogue_probe.json", "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=out), f,
                  indent=1)


if __name__ == "__main__":
    main()
