"""XLA's compiled memory plan of the QLoRA train step, for LM-head/loss chunk variants.

    python -m benchmarks.train_memory_plan --shape 8b --layers 4

Builds the `train_bench` model (optionally with fewer layers: the loss part of the plan does not
depend on depth, and compiling 32 layers takes 80 s) and prints argument / temp / output sizes
from `compiled.memory_analysis()` for: `loop512`, the per-chunk Python loop this repo used before
(kept here as the comparison), and `lax.scan` over chunks of 512, 256 and 128 tokens.
"""
from __future__ import annotations

import argparse
import functools
import time


def _loop_chunked(lm_logits, h, targets, mask, chunk=512):
    """The previous implementation: independent per-chunk checkpointed calls XLA may overlap."""
    import jax
    import jax.numpy as jnp

    from jqlora.train import loop

    @jax.checkpoint
    def part(hc, tc, mc):
        return loop.masked_cross_entropy(lm_logits(hc), tc, mc)

    total, count = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    for start in range(0, h.shape[1], chunk):
        sl = slice(start, min(h.shape[1], start + chunk))
        s_, n_ = part(h[:, sl], targets[:, sl], mask[:, sl])
        total, count = total + s_, count + n_
    return total, count


def main(argv=None):
    import jax

    from benchmarks import train_bench as tb
    from jqlora.train import loop
    from jqlora.train.frozen_jit import frozen_jit

    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(tb.SHAPES), default="8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    a = p.parse_args(argv)
    att = "cudnn" if jax.default_backend() == "gpu" else "einsum"
    model, opt, batch = tb.build_jax(a.shape, a.seq, "auto", att, layers=a.layers)
    scan_chunked = loop.chunked_cross_entropy
    gib = 2**30
    try:
        for name, fn, chunk in (("loop512", _loop_chunked, 512), ("scan512", scan_chunked, 512),
                                ("scan256", scan_chunked, 256), ("scan128", scan_chunked, 128)):
            loop.chunked_cross_entropy = fn  # read by loop._forward_sums at trace time
            step = frozen_jit(functools.partial(loop._train_step_impl, loss_chunk=chunk), nodes=2, donate=True)
            t0 = time.time()
            ma = step.lower(model, opt, batch).compile().memory_analysis()
            print(f"{name}: layers={a.layers} args {ma.argument_size_in_bytes / gib:.3f} GiB "
                  f"temp {ma.temp_size_in_bytes / gib:.3f} GiB out {ma.output_size_in_bytes / gib:.3f} "
                  f"alias {ma.alias_size_in_bytes / gib:.3f} (compile {time.time() - t0:.0f}s)", flush=True)
    finally:
        loop.chunked_cross_entropy = scan_chunked


if __name__ == "__main__":
    main()
