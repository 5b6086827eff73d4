"""Where the time of one decoded token goes: `jqlora.models.generate` at batch 1, kernel by kernel.

    OUT=/tmp/out python -m benchmarks.profile.decode_profile --shape 1b [--tokens 256] [--prompt 16] \
        [--variants hoisted,scanned,cmdbuf]

Each variant runs in its own process (XLA flags are read once per process) on a random-weight NF4
model of `benchmarks.train_bench`'s shape (`--shape gemma3-1b` / `gemma3-12b`: `benchmarks.gemma_bench`'s
Gemma 3) without LoRA (what `jqlora generate` runs without an
adapter), bf16, remat off. Per variant: generation of 1 and of `--tokens` new tokens, each timed on
its second call; decode tokens/s = (tokens - 1) / (time(tokens) - time(1)); then one traced call
of `--tokens` tokens: GPU kernel time per token by category (`train_profile.categorize`) against
the wall time per token (the gap is time the GPU waits for the host: launches, loop predicates),
and one token's kernels in launch order (`one_token_sequence`: HLO instruction, us). With
`XLA_FLAGS=--xla_dump_to=DIR` the optimized HLO names what each fusion computes.

Variants: default (the library's settings: `decode_layers="auto"`); hoisted / scanned (the layers
sliced once before the decode loop, or by a scan on every token: `generate(decode_layers=...)`);
apart (hoisted, each projection its own product: `generate(fuse_projections=False)`);
lora / lora_apart (default / apart with a LoRA adapter attached: r = 16 on the 7 projections, its B
random, what `jqlora generate --adapter` and the RL rollouts run);
einsum_attention / lora_einsum_attention (default / lora with the decoding steps' attention and
norms on XLA instead of the `decode_attention` and `rms_norm` kernels: the model's backend "xla",
which only those read); xla_norm (the defaults with the norms alone on XLA); kernel_norm (the
norms in the `rms_norm` kernel at every width it takes: under the defaults a width that is not a
power of two, Gemma's, runs on XLA);
cmdbuf (the defaults with XLA command buffers, i.e. CUDA graphs, for while loops and conditionals
too: `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`).
Writes $OUT/decode_profile_<shape>.json (one record per variant) and prints a table.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FLAGS = {"cmdbuf": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"}
PROMPT_LEN = 16


def child(shape: str, tokens: int, variant: str, n_layers: int | None, prompt_len: int = PROMPT_LEN) -> dict:
    import jax
    import numpy as np

    from benchmarks.profile.train_profile import hlo_lines, kernel_events, summarize
    from benchmarks.rollout_bench import randomize_lora_b
    from benchmarks.train_bench import build_jax
    from jqlora import models

    t0 = time.perf_counter()
    ids = np.asarray([[5 + (7 * i) % 26 for i in range(prompt_len)]], np.int32)
    lora = variant.startswith("lora")
    if shape.startswith("gemma3-"):  # gemma3-1b, gemma3-12b, gemma3-tiny (CPU)
        from benchmarks import gemma_bench

        size = shape.removeprefix("gemma3-")
        model = gemma_bench.decode_model(gemma_bench.config(size == "tiny", n_layers, shape=size),
                                         size == "tiny", lora)
    else:
        model, _, _ = build_jax(shape, 2048, "auto", "cudnn", layers=n_layers, remat=False, lora=lora)
    if lora:
        randomize_lora_b(model)
    if variant.endswith("einsum_attention"):
        model.backend = "xla"
    if variant.endswith("xla_norm"):  # the decoding norms on XLA, everything else as the defaults
        from jqlora.ops import decode_norm

        decode_norm.norm_problem = lambda backend, shape: "decode_profile: xla_norm"
    if variant.endswith("kernel_norm"):  # the norm kernel at every width it takes, powers of two or not
        from jqlora.ops import decode_norm

        rule = decode_norm.norm_problem
        decode_norm.norm_problem = lambda backend, shape: rule("pallas" if backend == "auto" else backend, shape)
    layers = {"hoisted": "hoisted", "scanned": "scanned", "apart": "hoisted"}.get(variant.removeprefix("lora_"), "auto")
    fuse = not variant.endswith("apart")
    gen = lambda n: models.generate(model, ids, n, decode_layers=layers, fuse_projections=fuse)  # noqa: E731
    build_s = time.perf_counter() - t0
    times, compile_s = {}, {}
    for n in (1, tokens):
        t = time.perf_counter()
        np.asarray(gen(n))
        compile_s[n] = time.perf_counter() - t
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            np.asarray(gen(n))
            runs.append(time.perf_counter() - t)
        times[n] = statistics.median(runs)
    extra = times[tokens] - times[1]
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t = time.perf_counter()
            np.asarray(gen(tokens))
            traced_s = time.perf_counter() - t
        paths = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    events = kernel_events(trace)
    res = summarize(events, hlo_lines(""), tokens, lora_rank=16)
    # one token's kernels in launch order, from the middle of the trace: which fusions a layer runs
    ordered = sorted(events, key=lambda e: e["ts"])
    mid, per_token = len(ordered) // 2, -(-len(ordered) // tokens)
    sequence = [[e["name"][:60], round(e["dur"], 2)]
                for e in ordered[mid:mid + per_token]]
    return {"shape": shape, "layers": n_layers, "variant": variant, "prompt_len": prompt_len, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "tokens": tokens, "build_s": round(build_s, 1), "compile_s": {str(k): round(v, 2) for k, v in compile_s.items()},
            "one_token_s": round(times[1], 4), f"tokens_{tokens}_s": round(times[tokens], 4),
            "decode_tokens_per_s": round((tokens - 1) / extra, 1) if extra > 1e-4 else None,
            "wall_us_per_token_traced": round(traced_s / tokens * 1e6, 1),
            "gpu_us_per_token": round(res["total_us"], 1), "kernels_per_token": round(len(events) / tokens, 1),
            "by_category_us": res["by_category_us"], "top_kernels": res["top_kernels"][:25],
            "one_token_sequence": sequence,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", type=int, default=PROMPT_LEN, help="prompt tokens (the cache holds prompt + tokens)")
    p.add_argument("--variants", default="hoisted,scanned,cmdbuf")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=240)
    a = p.parse_args(argv)
    if a.child:
        print("decode_profile: " + json.dumps(child(a.shape, a.tokens, a.child, a.layers, a.prompt)), flush=True)
        return 0
    out = os.environ.get("OUT", "/tmp")
    recs = []
    for v in a.variants.split(","):
        env = dict(os.environ)
        if v in FLAGS:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAGS[v]).strip()
        cmd = [sys.executable, "-m", "benchmarks.profile.decode_profile", "--shape", a.shape, "--tokens",
               str(a.tokens), "--prompt", str(a.prompt), "--child", v] + (["--layers", str(a.layers)] if a.layers else [])
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout_s)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("decode_profile: ")]
            rec = json.loads(lines[-1][len("decode_profile: "):]) if lines else \
                {"variant": v, "rc": r.returncode, "error": r.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            rec = {"variant": v, "error": f"timed out after {a.timeout_s} s"}
        recs.append(rec)
        print(json.dumps({k: rec.get(k) for k in ("variant", "decode_tokens_per_s", "wall_us_per_token_traced",
                                                  "gpu_us_per_token", "kernels_per_token", "compile_s",
                                                  "by_category_us", "error")}), flush=True)
        for row in rec.get("top_kernels", [])[:12]:
            print(f"    {row['us_per_step']:8.1f} us x{row['launches_per_step']:5.1f}  {row['label'][:100]}")
    os.makedirs(out, exist_ok=True)
    name = f"decode_profile_{a.shape}" + ("" if a.prompt == PROMPT_LEN else f"_prompt{a.prompt}")
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
