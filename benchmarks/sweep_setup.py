"""What the kernel sweeps share: NF4 weight copies that defeat L2, and the bf16 GEMM baseline
timed the same way (benchmarks/timing.py: distinct x per product, device time per product)."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product
from jqlora import quant


def nf4_weight_copies(k: int, n: int):
    """(copies, dense bf16 weights, NF4 blocksize-64 double-quant weights), enough copies that
    one sweep over the packed weights is at least twice the L2 size."""
    copies = l2_defeating_copies(n * k // 2)
    dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
             for i in range(copies)]
    return copies, dense, [quant.quantize_4bit(w, "nf4", 64, True) for w in dense]


def bf16_us(x, dense: list, k: int, n: int):
    """Device µs per `x @ W.T` of the dense bf16 weights (enough copies to defeat L2)."""
    dense_copies = l2_defeating_copies(n * k * 2)
    return us_per_product(lambda xs, ws: [a @ w.T for a, w in zip(xs, ws)],
                          (distinct_copies(x, dense_copies), dense[:dense_copies]), dense_copies)


def time_configs_into(res: dict, label: str, configs, make_cfg, call, xs, qs, copies) -> None:
    """res[f"{label} {text}"] = us per product of `call(x, q, make_cfg(text))` for each config
    text; a config that is invalid (ValueError: shape, shared memory) records its error."""
    for text in configs:
        try:
            cfg = make_cfg(text)
            res[f"{label} {text}"] = us_per_product(
                lambda xs, qs, cfg=cfg: [call(a, q, cfg) for a, q in zip(xs, qs)], (xs, qs),
                copies)
        except ValueError as e:
            res[f"{label} {text}"] = f"error: {str(e)[:300]}"


def record_row(res: dict, out: list) -> None:
    """Add `ratios` (every float timing over res["bf16"]) to one probe row, keep and print it."""
    res["ratios"] = {key: round(v / res["bf16"], 3) for key, v in res.items()
                     if isinstance(v, float) and key != "bf16"}
    out.append(res)
    print(json.dumps(res), flush=True)


def write_rows(out: list, name: str) -> None:
    """All rows of a probe as one JSON file in $OUT (default /tmp)."""
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(out, f, indent=1)
