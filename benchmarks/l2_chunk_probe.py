"""Can the large-M dequant + GEMM path hide its dequant pass in L2?

    python -m benchmarks.l2_chunk_probe 2048,8192     # $OUT/l2_chunk_probe.jsonl

At M >= 2048 `qmatmul` runs the dequant kernel (packed NF4 -> a transient dense bf16 weight in
HBM) and then cuBLAS: device time 1 + dequant / GEMM, 1.08-1.14x bf16 (session 11). The dequant
pass is bound by HBM bytes, 2 of its 2.5 bytes per weight being the dense write. Cut into chunks
whose dense weight fits in L2 (H100 50 MB, H200 60 MB), each chunk's write could stay in L2 (a
write-back cache: lines rewritten while resident never reach HBM) and the GEMM of that chunk read
it back from L2. This probe measures that, per product:

- forward y = x @ W.T: N cut into c row chunks, y assembled by concatenate (and, to see the
  concatenate's own cost, a form returning the chunk outputs unassembled);
- backward dx = dy @ W: K cut into c column chunks, dx concatenated along K.

Chunk i + 1's dequant is made to wait for chunk i's GEMM (an optimization barrier on both), so
XLA cannot hoist all dequants ahead and lose the L2 reuse. Each chunk's dequant reads its
window of the packed weight in place (BlockSpec offsets), no slice copies. Timing as in the
protocol harness: L2-defeating weight copies, one product per copy, device time per product.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.timing import distinct_copies, jax_device_ms, l2_defeating_copies
from jqlora import quant
from jqlora.ops.products import kernel_operands_4bit
from pallas_kernels import _compat
from pallas_kernels.triton.dequantize_4bit import _dequant_kernel

_BN, _BKB = 16, 256  # the dequant kernel's default tile: 16 rows x 256 bytes (512 weights)


def dequant_window(packed, absmax, code, *, blocksize, row0, rows, col0, cols, dtype=jnp.bfloat16):
    """Dense (rows, cols) window of the (N, K) weight; offsets and sizes in tile multiples."""
    span = 2 * _BKB
    assert row0 % _BN == 0 and rows % _BN == 0 and col0 % span == 0 and cols % span == 0
    i0, j0 = row0 // _BN, col0 // span
    g = span // blocksize
    kernel = functools.partial(_dequant_kernel, n_rows=rows, bn=_BN, out_dtype=jnp.dtype(dtype),
                               method="gather")
    return _compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
        grid=(rows // _BN, cols // span),
        in_specs=[pl.BlockSpec((_BN, _BKB), lambda i, j: (i + i0, j + j0)),
                  pl.BlockSpec((_BN, g), lambda i, j: (i + i0, j + j0)),
                  pl.BlockSpec((16,), lambda i, j: (0,))],
        out_specs=pl.BlockSpec((_BN, span), lambda i, j: (i, j)),
        interpret=False, num_warps=4, num_stages=1, name="dequantize_4bit_window",
    )(packed, absmax, code)


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(a.dtype)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(a.dtype)


def _chunked(lhs, q, c, *, by_rows: bool, assemble=True):
    """lhs @ dequant(W).T (by_rows: W's N rows cut into c chunks) or lhs @ dequant(W) (W's K
    columns cut), chunk i + 1's dequant ordered after chunk i's GEMM."""
    packed, absmax = kernel_operands_4bit(q)
    n, k = q.shape
    step = (n if by_rows else k) // c
    outs, prev = [], lhs
    for i in range(c):
        packed, absmax, prev = jax.lax.optimization_barrier((packed, absmax, prev))
        window = dict(row0=i * step, rows=step, col0=0, cols=k) if by_rows else \
            dict(row0=0, rows=n, col0=i * step, cols=step)
        w = dequant_window(packed, absmax, q.code, blocksize=q.blocksize, **window)
        prev = _nt(lhs, w) if by_rows else _nn(lhs, w)
        outs.append(prev)
    return jnp.concatenate(outs, axis=1) if assemble else outs


def fwd_chunked(x, q, c, assemble=True):
    return _chunked(x, q, c, by_rows=True, assemble=assemble)


def bwd_chunked(dy, q, c):
    return _chunked(dy, q, c, by_rows=False)


def fwd_streams(x, q, c):
    """Chunk i + 1's dequant on a second stream (XLA stream annotation), overlapping chunk i's
    GEMM; needs XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true. Dequant i waits for
    GEMM i - 2 only (two dense chunks alive)."""
    from jax.experimental.compute_on import compute_on

    packed, absmax = kernel_operands_4bit(q)
    n, k = q.shape
    step = n // c
    outs = []
    for i in range(c):
        dep = outs[i - 2] if i >= 2 else x
        pk, am, _ = jax.lax.optimization_barrier((packed, absmax, dep))
        with compute_on("gpu_stream:1"):
            w = jax.jit(lambda pk, am, i=i: dequant_window(
                pk, am, q.code, blocksize=q.blocksize, row0=i * step, rows=step, col0=0,
                cols=k))(pk, am)
        outs.append(_nt(x, w))
    return jnp.concatenate(outs, axis=1)


def fwd_whole(x, q):
    return fwd_chunked(x, q, 1)


def bwd_whole(dy, q):
    return bwd_chunked(dy, q, 1)


def main():
    out_path = os.path.join(os.environ.get("OUT", "."), "l2_chunk_probe.jsonl")
    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048, 8192]
    shapes = [tuple(int(d) for d in s.split("x")) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 \
        else [(4096, 4096), (4096, 14336), (14336, 4096)]

    def rec(**r):
        print(json.dumps(r), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(r) + "\n")

    rec(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    for m in ms:
        for (k, n) in shapes:
            r = l2_defeating_copies(n * k // 2)
            keys = jax.random.split(jax.random.key(0), r)
            ws = [jax.random.normal(kk, (n, k), jnp.bfloat16) * 0.02 for kk in keys]
            qs = [quant.quantize_4bit(w, "nf4", 64, True) for w in ws]
            xs = distinct_copies(jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16), r)
            dys = distinct_copies(jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16), r)

            def t(name, f, a, b):
                try:
                    us = jax_device_ms(lambda aa, bb: [f(u, v) for u, v in zip(aa, bb)], a, b,
                                       iterations=10) / r * 1e3
                except Exception as e:  # noqa: BLE001 - a failing form is a result too
                    us = f"{type(e).__name__}: {str(e)[:300]}"
                rec(m=m, k=k, n=n, what=name, us=us, copies=r)

            t("fwd bf16", lambda x, w: x @ w.T, xs, ws)
            t("fwd dequant+dot (whole)", fwd_whole, xs, qs)
            for c in (2, 4, 8):
                if n // c >= 512:
                    t(f"fwd chunked c={c}", lambda x, q, c=c: fwd_chunked(x, q, c), xs, qs)
            if "stream_annotation" in os.environ.get("XLA_FLAGS", ""):
                for c in (4, 8):
                    if n // c >= 512:
                        t(f"fwd streams c={c}", lambda x, q, c=c: fwd_streams(x, q, c), xs, qs)
            t("fwd chunked c=4 unassembled", lambda x, q: fwd_chunked(x, q, 4, False), xs, qs)
            t("bwd bf16", lambda dy, w: dy @ w, dys, ws)
            t("bwd dequant+dot (whole)", bwd_whole, dys, qs)
            for c in (2, 4, 8):
                if k // c >= 512:
                    t(f"bwd chunked c={c}", lambda dy, q, c=c: bwd_chunked(dy, q, c), dys, qs)
            del ws, qs, xs, dys


if __name__ == "__main__":
    main()
