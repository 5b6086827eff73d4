"""Rollout throughput: `jqlora.models.rollout.generate_batch` on a random NF4 model with LoRA unmerged.

    python -m benchmarks.rollout_bench --shape 8b [--batch 64] [--new-tokens 256] [--eos none,random]
    python -m benchmarks.rollout_bench --tiny        # CPU smoke run: tiny shape, small batch

The model is `benchmarks.train_bench.build_jax`'s (random NF4 weights, blocksize 64, double quant;
LoRA r = 16 on every projection, its B random so the branch is not a no-op; bf16, remat off),
generation runs with the library's defaults (`decode_layers="auto"`). A batch of `--batch` prompts of
random lengths in [--prompt-min, --prompt-max] is sampled at temperature 1 (top-p `--top-p`) for
`--new-tokens` tokens, in two cases:
  none    no row stops: every row generates `--new-tokens` tokens;
  random  each row stops at a random point: a set of `vocab / --mean-len` stop ids, so that a
          token of this random model stops its row with probability about 1 / mean-len.
Case none decodes in one call; case random in calls of 32 steps, dropping finished rows between
them (`generate_batch(compact=True)`). Per case: the median over `--reps` timed calls after one
untimed call (compilation, of the smaller batch buckets too): seconds, decode positions run (`steps`), generated tokens (the rows' lengths
summed) and tokens/s = generated tokens / seconds; slot tokens/s = batch x steps / seconds; the decode step time (case none) from two
lengths in one token bucket (one compiled program): (t(n) - t(n - 63)) / 63, and the prefill
time the rest of t(n). Case generate: the same prompts through
`jqlora.models.generate` (the reference). --profile adds GPU time per decode step by kernel
category from one traced call. Writes one JSON record per case to --out (JSON
lines) with the device, date, commit and versions, and prints them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time


def short_commit() -> str:
    """The checkout's HEAD as a short hash, "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def randomize_lora_b(model, seed: int = 0) -> None:
    """LoRA B = N(0, 0.01) everywhere (fresh adapters have B = 0: the products would still run,
    but an adapter that changes nothing would hide a wrong branch from the generated tokens)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    new = [jax.random.normal(k, a.shape, a.dtype) * 0.01 if "lora_B" in p else a
           for k, a, p in zip(keys, leaves, paths)]
    nnx.update(model, jax.tree.unflatten(tree, new))


def prompts_for(batch: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(lo, hi + 1, batch)]


def run(shape: str, batch: int, new_tokens: int, lo: int, hi: int, cases: list, reps: int, top_p: float,
        mean_len: int, decode_layers: str, profile: bool = False) -> list:
    import jax
    import numpy as np

    from benchmarks.train_bench import build_jax, hf_config
    from jqlora.models import rollout
    from jqlora.models.generate import TOKEN_BUCKET, token_bucket

    t0 = time.perf_counter()
    model, _, _ = build_jax(shape, 128, "auto", "einsum", remat=False, lora=True)
    randomize_lora_b(model)
    build_s = time.perf_counter() - t0
    vocab = int(hf_config(shape)["vocab_size"])
    prompts = prompts_for(batch, lo, hi, vocab)
    n_stop = max(1, vocab // mean_len)
    stops = {"none": [], "random": list(range(1, 1 + n_stop))}
    key = jax.random.key(0)

    def call(n, stop_ids):
        t = time.perf_counter()
        r = rollout.generate_batch(model, prompts, n, key=key, temperature=1.0, top_p=top_p,
                                   stop_token_ids=stop_ids, decode_layers=decode_layers)
        return time.perf_counter() - t, r

    recs = []
    t = time.perf_counter()
    call(new_tokens, stops["none"])
    compile_s = time.perf_counter() - t
    # the step time from two lengths in one token bucket (one compiled program): t(n) - t(n_small)
    small = max(1, token_bucket(new_tokens) - TOKEN_BUCKET + 1)
    t_small = statistics.median(call(small, stops["none"])[0] for _ in range(reps))
    t_full = statistics.median(call(new_tokens, stops["none"])[0] for _ in range(reps))
    step_ms = (t_full - t_small) / max(new_tokens - small, 1) * 1e3
    for case in cases:
        if case == "generate":
            recs.append(_baseline(model, prompts, new_tokens, reps, shape, batch))
            continue
        call(new_tokens, stops[case])  # compiles the decode programs of the smaller buckets rows reach
        runs = [call(new_tokens, stops[case]) for _ in range(reps)]
        secs = statistics.median(s for s, _ in runs)
        r = runs[0][1]
        tokens = int(r.lengths.sum())
        recs.append({
            "bench": "rollout", "shape": shape, "case": case, "batch": batch, "new_tokens": new_tokens,
            "prompt_lengths": [lo, hi], "top_p": top_p, "decode_layers": decode_layers, "lora_rank": 16,
            "seconds": round(secs, 4), "steps": r.steps, "generated_tokens": tokens,
            "tokens_per_s": round(tokens / secs, 1), "slot_tokens_per_s": round(batch * r.steps / secs, 1),
            "decode_step_ms": round(step_ms, 3), "prefill_s": round(t_full - step_ms * 1e-3 * (new_tokens - 1), 4),
            "mean_length": round(float(np.mean(r.lengths)), 1), "finished_rows": int(r.finished.sum()),
            "compile_s": round(compile_s, 2), "build_s": round(build_s, 1), "programs": rollout.compiled_programs(),
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
            "commit": short_commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        })
    if profile:
        recs.append(_profile(model, lambda: call(new_tokens, stops["none"])[1]))
    return recs


def _baseline(model, prompts, new_tokens: int, reps: int, shape: str, batch: int) -> dict:
    """The same prompts (left-padded) through `jqlora.models.generate`, no stop: the reference."""
    import jax
    import numpy as np

    from jqlora import models

    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1

    def call():
        t = time.perf_counter()
        np.asarray(models.generate(model, ids, new_tokens, temperature=1.0, rng=jax.random.key(0),
                                   attention_mask=mask))
        return time.perf_counter() - t

    compile_s = call()
    secs = statistics.median(call() for _ in range(reps))
    return {"bench": "rollout", "shape": shape, "case": "generate", "batch": batch, "new_tokens": new_tokens,
            "seconds": round(secs, 4), "tokens_per_s": round(batch * new_tokens / secs, 1),
            "compile_s": round(compile_s, 2)}


def _profile(model, once) -> dict:
    """GPU kernel time per decode step by category (`benchmarks.profile.train_profile`), from one
    traced call (its prefill included); the LoRA GEMMs are told apart by the compiled programs' HLO
    (a rank-16 operand). The rollout programs run as `jax.jit` compiles them, past the
    lowered-program cache, so that the HLO read here is that of the kernels traced."""
    import glob
    import gzip
    import tempfile

    import jax

    from benchmarks.profile.train_profile import hlo_lines, kernel_events, summarize
    from jqlora.models import rollout

    seen = {}  # program name -> (its jitted function, arguments, statics) of its last call

    def direct(program, jitted, name, *args, **static):
        seen[name] = (jitted, args, static)
        return jitted(*args, **static)

    real = rollout._run
    rollout._run = direct
    try:
        once()
        # the decode program last: where two programs name an instruction alike, its line is kept
        order = sorted(seen, key=lambda n: n == "rollout_decode")
        lines = {}
        for name in order:
            jitted, args, static = seen[name]
            lines.update(hlo_lines(jitted.lower(*args, **static).compile().as_text()))
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                r = once()
            with gzip.open(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]) as f:
                trace = json.load(f)
    finally:
        rollout._run = real
    events = kernel_events(trace)
    res = summarize(events, lines, r.steps, lora_rank=16)
    return {"bench": "rollout_profile", "steps": r.steps, "hlo_programs": order, "hlo_instructions": len(lines),
            "kernels_per_step": round(len(events) / r.steps, 1), "gpu_us_per_step": res["total_us"],
            "by_category_us": res["by_category_us"], "top_kernels": res["top_kernels"][:30]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8b", help="benchmarks.train_bench shape (1b, 8b, ...)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, batch 4, 8 new tokens")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--mean-len", type=int, default=128, help="case random: mean row length aimed at")
    p.add_argument("--eos", default="none,random",
                   help="cases, comma-separated: none, random, generate (jqlora.models.generate, no stop)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-layers", default="auto", choices=("auto", "hoisted", "scanned"))
    p.add_argument("--profile", action="store_true",
                   help="also trace one call (case none): GPU time by kernel category")
    p.add_argument("--out", default=None, help="append the JSON records to this file")
    a = p.parse_args(argv)
    if a.tiny:
        a.shape, a.batch, a.new_tokens, a.prompt_min, a.prompt_max, a.reps, a.mean_len = "tiny", 4, 8, 3, 12, 1, 4
    cases = [c for c in a.eos.split(",") if c]
    bad = [c for c in cases if c not in ("none", "random", "generate")]
    if bad:
        p.error(f"--eos: unknown case {bad[0]!r} (none, random, generate)")
    recs = run(a.shape, a.batch, a.new_tokens, a.prompt_min, a.prompt_max, cases, a.reps, a.top_p, a.mean_len,
               a.decode_layers, a.profile)
    for r in recs:
        print("rollout_bench: " + json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
