"""A decoded token's 4-bit products of one decoder layer, apart and fused: what fusing the
projections that read one input (q|k|v, gate|up) saves at one token.

    OUT=/tmp/out python -m benchmarks.profile.fused_products [--shapes 1b,8b] [--m 1]

Per shape (`SHAPES`: Llama-3.2-1B and Llama-3-8B layers), the device time of one `qmatmul` at M
rows (`auto` dispatch, bf16 x, random NF4 weights, blocksize 64): each projection apart with
double quantization (as checkpoints store them), q|k|v and gate|up stacked by rows
(`jqlora.quant.stacked_rows.concat_rows`: de-nested float32 scales, what decoding runs) and the same
stacks double-quantized (what a stack with one set of nested scales would cost), then the LM head
(bf16 `x @ E.T` and `qmatmul`). Each product runs over enough weight copies that they stream from
memory, not L2 (`benchmarks.timing`). Writes $OUT/fused_products.json and prints each shape's
per-layer sums: seven products apart against four with q|k|v and gate|up fused.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = {"1b": dict(hidden=2048, q=2048, kv=512, inter=8192, vocab=128256),
          "8b": dict(hidden=4096, q=4096, kv=1024, inter=14336, vocab=128256),
          "tiny": dict(hidden=128, q=128, kv=64, inter=256, vocab=512)}  # a CPU smoke run

# (out, in) of each product, from a shape's sizes
PRODUCTS = {"q": ("q", "hidden"), "k": ("kv", "hidden"), "v": ("kv", "hidden"), "o": ("hidden", "q"),
            "gate": ("inter", "hidden"), "up": ("inter", "hidden"), "down": ("hidden", "inter")}
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def product_us(m: int, rows: int, cols: int, stacked_from: tuple = (), nested: bool = True) -> float:
    """Device us of one NF4 `qmatmul` at M = m on a (rows, cols) weight; stacked_from: the
    (rows, cols) pieces whose row stack it is (`concat_rows`), else one weight."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import distinct_copies, jax_device_ms, l2_defeating_copies
    from jqlora import ops, quant
    from jqlora.quant.stacked_rows import concat_rows

    copies = l2_defeating_copies(rows * cols // 2)
    keys = jax.random.split(jax.random.key(rows * 7 + cols), copies * max(1, len(stacked_from)))

    def quantized(key, r):
        return quant.quantize_4bit(jax.random.normal(key, (r, cols), jnp.bfloat16) * 0.02, "nf4", 64, True)

    if stacked_from and not nested:
        ws = [concat_rows([quantized(k, r) for k, (r, _) in zip(keys[i::copies], stacked_from)])
              for i in range(copies)]
    else:
        ws = [quantized(k, rows) for k in keys[:copies]]
    xs = distinct_copies(jax.random.normal(jax.random.key(1), (m, cols), jnp.bfloat16), copies)
    call = lambda xs, ws: [ops.qmatmul(x, w) for x, w in zip(xs, ws)]  # noqa: E731
    return jax_device_ms(call, xs, ws, iterations=20) / copies * 1e3


def head_us(m: int, hidden: int, vocab: int) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import distinct_copies, jax_device_ms
    from jqlora import ops

    tables = [jax.random.normal(jax.random.key(i), (vocab, hidden), jnp.bfloat16) for i in range(2)]
    xs = distinct_copies(jax.random.normal(jax.random.key(1), (m, hidden), jnp.bfloat16), 2)
    return {"lm_head bf16 x @ E.T": jax_device_ms(lambda xs, es: [x @ e.T for x, e in zip(xs, es)], xs, tables) / 2e-3,
            "lm_head qmatmul": jax_device_ms(lambda xs, es: [ops.qmatmul(x, e) for x, e in zip(xs, es)], xs, tables) / 2e-3}


def measure(shape: str, m: int = 1) -> dict:
    s = SHAPES[shape]
    size = {name: (s[o], s[i]) for name, (o, i) in PRODUCTS.items()}
    us = {name: product_us(m, *size[name]) for name in PRODUCTS}
    fused = {}
    for name, parts in FUSED.items():
        rows, cols = sum(size[p][0] for p in parts), size[parts[0]][1]
        fused[f"{name} f32 scales"] = product_us(m, rows, cols, tuple(size[p] for p in parts), nested=False)
        fused[f"{name} nested"] = product_us(m, rows, cols)
    apart = sum(us.values())
    with_fused = fused["qkv f32 scales"] + us["o"] + fused["gate_up f32 scales"] + us["down"]
    return {"shape": shape, "m": m, "apart_us": {k: round(v, 2) for k, v in us.items()},
            "fused_us": {k: round(v, 2) for k, v in fused.items()},
            "layer_us": {"seven apart": round(apart, 2), "four, q|k|v and gate|up fused": round(with_fused, 2)},
            "head_us": {k: round(v, 2) for k, v in head_us(m, s["hidden"], s["vocab"]).items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--m", type=int, default=1)
    a = p.parse_args(argv)
    import jax

    recs = [measure(shape, a.m) for shape in a.shapes.split(",")]
    for r in recs:
        print(json.dumps(r), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "fused_products.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": recs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
