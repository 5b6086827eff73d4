"""Device time of one decoding step's attention for one layer: the `decode_attention` kernel at
its defaults and at given (block_s, splits) settings, against the einsum path the models run
otherwise (the layer's slab sliced out of the cache, `einsum_attention` with its mask).

    python -m benchmarks.decode_attention_bench [--shapes 1b,8b] [--slots 272,2304] [--batch 1,16] \
        [--configs "block_s=16;block_s=32,splits=8"] [--out DIR]

Random bf16 caches of the shape's layers and heads (1b: 16 layers, 32 heads over 8 kv heads of 64;
8b: 32 layers, 32 over 8 of 128), the query at the last slot (every slot seen). Times are
`benchmarks.timing.jax_device_ms` (CUPTI kernel sums, no launch gaps), microseconds. Writes
<out>/<gpu>-<date>_decode_attention.json with device, date, commit and versions.
"""
from __future__ import annotations

import argparse

SHAPES = {"1b": dict(layers=16, heads=32, kv_heads=8, head_dim=64),
          "8b": dict(layers=32, heads=32, kv_heads=8, head_dim=128),
          "tiny": dict(layers=2, heads=4, kv_heads=2, head_dim=16)}


def parse_configs(text: str | None) -> list[dict]:
    """'block_s=16;block_s=32,splits=8' -> [{'block_s': 16}, {'block_s': 32, 'splits': 8}]."""
    from benchmarks.grouped_bench import parse_configs as parse

    return parse(text, "--configs")


def bench(shapes, slots, batches, configs, log=print) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import timed_rows
    from jqlora.models.attention import einsum_attention
    from pallas_kernels.triton.decode_attention import block_slots, decode_attention, default_splits

    rows = []
    for name in shapes:
        c = SHAPES[name]
        h, kvh, d, layers = c["heads"], c["kv_heads"], c["head_dim"], c["layers"]
        for s in slots:
            for b in batches:
                key = jax.random.key(s + b)
                cache = jax.random.normal(key, (layers, b, s, kvh, d), jnp.bfloat16)
                q = jax.random.normal(jax.random.key(1), (b, h, d), jnp.bfloat16)
                index = jnp.int32(s - 1)
                layer = jnp.int32(layers // 2)
                q_seg, k_seg = jnp.ones((b,), jnp.int32), jnp.ones((b, s), jnp.int32)
                scale = d ** -0.5

                def einsum(q, ck, cv, layer, index, q_seg, k_seg):
                    k = jax.lax.dynamic_index_in_dim(ck, layer, 0, keepdims=False)
                    v = jax.lax.dynamic_index_in_dim(cv, layer, 0, keepdims=False)
                    slots_ = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
                    return einsum_attention(q[:, None], k, v, jnp.full((b, 1), index), slots_, q_seg[:, None], k_seg,
                                            scale=scale, cap=None, window=None, dtype=q.dtype)

                args = (q, cache, cache + 1, layer, index, q_seg, k_seg)
                interp = jax.default_backend() != "gpu"  # interpret mode: a CPU smoke run
                bs = block_slots(s, d)
                contenders = [("einsum", einsum),
                              (f"kernel default (block_s={bs}, splits={default_splits(b, kvh, -(-s // bs))})",
                               lambda *a: decode_attention(*a, scale=scale, interpret=interp))]
                contenders += [(f"kernel {cfg}",
                                lambda *a, cfg=cfg: decode_attention(*a, scale=scale, interpret=interp, **cfg))
                               for cfg in configs]
                rows += timed_rows(contenders, args, {"shape": name, "slots": s, "batch": b}, log)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--slots", default="272,2304")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--configs", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from benchmarks.run import write_rows

    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    write_rows(bench(a.shapes.split(","), ints(a.slots), ints(a.batch), parse_configs(a.configs)), a.out,
               "decode_attention")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
