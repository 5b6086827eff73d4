"""Where the large-M NF4 time goes: the dense GEMM on a parameter vs on a computed weight.

    OUT=/tmp/out python -m benchmarks.large_m_probe

At M >= 2048 `qmatmul` is the Pallas dequant kernel + XLA's GEMM on the transient weight. This
times the pieces at the protocol's large-M cells, each as a device time per product:
  x @ w.T on a bf16 parameter (the benchmark's baseline), x @ wt with wt (K, N) stored
  transposed, x @ (w * s).T with s a traced scalar (a GEMM whose operand is computed in the
  same program), the standalone dequant, and qmatmul.
It also records which GEMM implementation XLA picked in each compiled program (the custom-call
targets and fusion kinds in the optimized HLO). Output: JSON lines + $OUT/large_m_probe.json.
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, jax_device_ms, l2_defeating_copies
from jqlora import ops, quant
from jqlora.ops.products import kernel_operands_4bit
from pallas_kernels.triton.dequantize_4bit import dequantize_4bit

CELLS = ((4096, 14336, 2048), (4096, 14336, 8192), (14336, 4096, 8192))
_GEMM = re.compile(r'custom_call_target="([^"]+)"|"kind":"(__triton_gemm|__cublas[^"]*)"'
                   r'|(__triton_gemm|cublas\$lt\$matmul|cublas\$gemm)')


def gemm_kinds(fn, *args) -> dict:
    """Counts of the GEMM-ish custom calls / fusion kinds in the compiled program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    out: dict = {}
    for mt in _GEMM.finditer(text):
        key = next(g for g in mt.groups() if g)
        out[key] = out.get(key, 0) + 1
    return out


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    records = []
    for k, n, m in CELLS:
        copies = l2_defeating_copies(n * k * 2)
        ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
        wts = [w.T.copy() for w in ws]
        qs = [quant.quantize_4bit(w, "nf4", 64, True) for w in ws]
        x = jax.random.normal(jax.random.key(9), (m, k), jnp.bfloat16)
        s = jnp.asarray(1.0, jnp.bfloat16)
        progs = {
            "x @ w.T (param)": (lambda xs, ws, s: [x @ w.T for x, w in zip(xs, ws)], ws),
            "x @ wt (param stored K x N)": (lambda xs, ws, s: [x @ w for x, w in zip(xs, ws)], wts),
            "x @ (w * s).T (computed)": (lambda xs, ws, s: [x @ (w * s).T for x, w in zip(xs, ws)], ws),
            "dequant only": (lambda xs, qs, s: [dequantize_4bit(*kernel_operands_4bit(q), q.code, blocksize=64,
                                                               out_dtype=jnp.bfloat16) for q in qs], qs),
            "qmatmul pallas": (lambda xs, qs, s: [ops.qmatmul(x, q, backend="pallas")
                                                 for x, q in zip(xs, qs)], qs),
        }
        for what, (fn, wlist) in progs.items():
            xs = distinct_copies(x, len(wlist))
            us = jax_device_ms(fn, xs, wlist, s, iterations=10) / len(wlist) * 1e3
            rec = dict(k=k, n=n, m=m, what=what, us=round(us, 1),
                       gemm=gemm_kinds(fn, xs[:1], wlist[:1], s))
            records.append(rec)
            print(json.dumps(rec), flush=True)
    with open(os.path.join(out_dir, "large_m_probe.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
