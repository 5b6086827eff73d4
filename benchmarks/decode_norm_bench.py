"""Device time of one decoding norm: the `rms_norm` kernel at its defaults and at given settings
(num_warps), against XLA's residual add and RMSNorm as the models run it otherwise.

    python -m benchmarks.decode_norm_bench [--widths 2048,4096,8192,1152] [--rows 1,16] \
        [--configs "num_warps=1;num_warps=8"] [--out DIR]

Random bf16 rows and weight; the residual add's delta is one (rows, width) bf16 array, as the
decoder layers hand it over (o_proj's output). Times are `benchmarks.timing.jax_device_ms` (CUPTI
kernel sums, no launch gaps), microseconds: XLA's two or three kernels summed against the one
kernel. Writes <out>/<gpu>-<date>_decode_norm.json with device, date, commit and versions.
"""
from __future__ import annotations

import argparse


def parse_configs(text: str | None) -> list[dict]:
    """'num_warps=1;num_warps=8' -> [{'num_warps': 1}, {'num_warps': 8}]."""
    from benchmarks.grouped_bench import parse_configs as parse

    return parse(text, "--configs")


def bench(widths, rows, configs, log=print) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import timed_rows
    from jqlora.models.llama import RMSNorm
    from pallas_kernels.triton.rms_norm import rms_norm

    out = []
    for n in widths:
        for m in rows:
            keys = jax.random.split(jax.random.key(n + m), 3)
            x = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
            delta = jax.random.normal(keys[1], (m, n), jnp.bfloat16)
            weight = jax.random.normal(keys[2], (n,), jnp.bfloat16)
            norm = RMSNorm(weight, 1e-5)
            interp = jax.default_backend() != "gpu"  # interpret mode: a CPU smoke run

            def xla(x, delta, weight):
                r = x + delta
                return r, norm(r)

            contenders = [("xla", xla),
                          ("kernel default", lambda *a: rms_norm(*a, eps=1e-5, interpret=interp))]
            contenders += [(f"kernel {cfg}", lambda *a, cfg=cfg: rms_norm(*a, eps=1e-5, interpret=interp, **cfg))
                           for cfg in configs]
            out += timed_rows(contenders, (x, delta, weight), {"width": n, "rows": m}, log)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="2048,4096,8192,1152")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--configs", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from benchmarks.run import write_rows

    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    write_rows(bench(ints(a.widths), ints(a.rows), parse_configs(a.configs)), a.out, "decode_norm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
