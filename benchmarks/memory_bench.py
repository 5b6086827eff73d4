"""Memory proof: forward+backward through a stack of NF4 layers keeps no dense weight per layer.

Runs in its own process (peak_bytes_in_use is process-wide). Prints one JSON line.
Usage: python -m benchmarks.memory_bench [--layers 32] [--m 2048] [--mode qmatmul|dense_residuals]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--mode", choices=["qmatmul", "dense_residuals"], default="qmatmul")
    p.add_argument("--backend", default="auto")
    a = p.parse_args(argv)

    from jqlora import ops, quant

    dev = jax.devices()[0]
    ws = []
    for i in range(a.layers):  # alternate up (inter, hidden) and down (hidden, inter) so shapes chain
        n, k = (a.inter, a.hidden) if i % 2 == 0 else (a.hidden, a.inter)
        w = jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
        ws.append(quant.quantize_4bit(w, "nf4", 64, True))
        del w
    x = jax.random.normal(jax.random.key(99), (a.m, a.hidden), jnp.bfloat16)
    jax.block_until_ready((ws, x))
    packed_bytes = sum(q.nbytes for q in ws)
    before = dev.memory_stats() or {}

    if a.mode == "qmatmul":
        layer = lambda h, q: jnp.tanh(ops.qmatmul(h, q, backend=a.backend))
    else:  # what a naive port does: autodiff through a dense dequantized weight saves it per layer
        layer = lambda h, q: jnp.tanh(h @ quant.dequantize(q, jnp.bfloat16).T)

    def loss(x):
        h = x
        for q in ws:
            h = layer(h, q)
        return jnp.sum(h.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss)).lower(x).compile()
    analysis = compiled.memory_analysis()  # XLA's own plan: temp buffers of the whole fwd+bwd
    g = compiled(x)
    jax.block_until_ready(g)
    after = dev.memory_stats() or {}
    one_dense = a.inter * a.hidden * 2
    act = a.layers * a.m * max(a.hidden, a.inter) * 2
    res = {
        "mode": a.mode, "layers": a.layers, "m": a.m, "shape": [a.inter, a.hidden],
        "packed_weight_bytes": packed_bytes,
        "bytes_in_use_before": before.get("bytes_in_use"),
        "peak_bytes_in_use": after.get("peak_bytes_in_use"),
        "one_dense_layer_bytes": one_dense,
        "activation_bytes_estimate": act,
        "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
    }
    if res["peak_bytes_in_use"] and res["bytes_in_use_before"] is not None:
        growth = res["peak_bytes_in_use"] - res["bytes_in_use_before"]
        res["peak_growth_bytes"] = growth
        res["growth_minus_activations_in_dense_layers"] = (growth - act) / one_dense
    print(json.dumps(res))


if __name__ == "__main__":
    main()
