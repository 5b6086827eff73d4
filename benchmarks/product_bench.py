"""The product path, timed as a user walks it: `jqlora train` and `jqlora generate` with their defaults
on a transformers + bitsandbytes NF4 checkpoint, against transformers + PEFT + bitsandbytes training
and transformers + bitsandbytes `generate` on the same GPU, in one command:

    python -m benchmarks.product_bench --shape 1b      # (bash benchmarks/gpu_session.sh product)
    python -m benchmarks.product_bench --shape tiny --out /tmp/x   # CPU smoke run, about a minute

Parts, each in its own process (peak memory is per process), in this order:
  checkpoint   a random-weight Llama (1b: hidden 2048, 16 layers, intermediate 8192, GQA 32/8, vocab
               128256; 8b: Llama-3-8B; tiny: CPU) saved by transformers, quantized to NF4 with double
               quant by bitsandbytes (`from_pretrained(quantization_config=...)` + `save_pretrained`),
               with a character tokenizer; and data.jsonl (random letters, two documents per row)
  train cold   `jqlora train --model CKPT --data-path data.jsonl --seq-len S --batch-size 1 --steps N
               --log-every 1` with an empty compilation cache directory (JQLORA_COMPILE_CACHE=DIR)
  train warm   the same command, same cache directory
  gen cold     `jqlora generate CKPT --prompt-ids ... --max-new-tokens T --timing` (its own empty cache)
  gen warm     the same command, same cache directory
  torch train  `python -m benchmarks.train_bench --side torch` (transformers + PEFT + bitsandbytes)
  torch gen    transformers + bitsandbytes `generate` on CKPT, greedy, exactly T new tokens
  jqlora decode  in one process: `jqlora.models.generate` with the CLI's defaults, 1 and T new tokens,
               after a first call of each; decode tokens/s = (T - 1) / (time(T) - time(1))

Measured per part: wall seconds of the process; for training, seconds from launch to the first step
(the first row of the CLI's loss.csv, flushed per step; with one step in flight it is written once
step 2 is dispatched) and the steady tokens/s (median of the CLI's per-step rates after step 2);
for generation, the CLI's own `--timing` line (load_s, generate_s, tokens/s: the CLI prints every
token at the end, so its time to first token is its wall time); peak device memory (JAX's
`peak_bytes_in_use`, torch's `max_memory_allocated`); the attention the CLI chose and the remat
line it logged. Each part has a time limit and the run a budget (--budget-s): what does not fit is
recorded as skipped. The checkpoint has no EOS id, so both sides generate exactly T tokens.

Writes <out>/<device>-<date>_product_<shape>.json and .md (device, date, commit, versions, command).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MARK = "product_bench: "  # prefix of the machine-readable line a child process prints on stderr
SEQ = {"tiny": 64, "1b": 2048, "8b": 2048}
STEPS = {"tiny": 6, "1b": 30, "8b": 20}
NEW_TOKENS = {"tiny": 16, "1b": 256, "8b": 256}
PROMPT = [5 + (7 * i) % 26 for i in range(16)]  # 16 letter tokens of the character tokenizer
# seconds each part may take at most (the run's remaining budget cuts them further)
LIMITS = {"checkpoint": 150, "train": 240, "generate": 200, "torch_train": 200, "torch_generate": 150,
          "decode": 150}
# where a shape needs longer: the 8B checkpoint writes 16 GB of dense weights, reads them back
# through bitsandbytes' quantization and writes 5.7 GB
SHAPE_LIMITS = {("checkpoint", "8b"): 330}


def part_limit(kind: str, shape: str) -> float:
    """Seconds a part of `kind` may take at `shape` (before the run's budget cuts it)."""
    return SHAPE_LIMITS.get((kind, shape), LIMITS[kind])


# ------------------------------------------------------------------------------------ children
def child_cli(argv: list[str]) -> int:
    """`jqlora <argv>` in this process (what the console script does), then one line on stderr
    with the exit status and JAX's peak device memory."""
    from jqlora.cli import main

    rc = main(argv)
    print(MARK + json.dumps({"rc": rc, "peak_bytes": _jax_peak()}), file=sys.stderr, flush=True)
    return rc


def _jax_peak():
    if "jax" not in sys.modules:
        return None
    import jax

    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory stats (CPU)
        return None


def child_checkpoint(shape: str, ckpt: str) -> int:
    """Random weights -> transformers dense checkpoint -> bitsandbytes NF4 (double quant) checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from benchmarks.train_bench import hf_config, transformers_config
    from jqlora.demo import task

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    c = hf_config(shape)
    c["eos_token_id"] = None  # no EOS: every generation runs to its full length on both sides
    cfg = transformers_config(c)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(ckpt)) as dense:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
        model.save_pretrained(dense)
        del model
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(dense, quantization_config=q, device_map=dev, torch_dtype=dtype)
        model.save_pretrained(ckpt)
    task.save_tokenizer(ckpt)
    print(MARK + json.dumps({"rc": 0, "seconds": time.perf_counter() - t0,
                             "bytes": sum(f.stat().st_size for f in Path(ckpt).iterdir())}), file=sys.stderr)
    return 0


def child_torch_generate(ckpt: str, new_tokens: int) -> int:
    """transformers + bitsandbytes `generate` on the checkpoint: greedy, exactly `new_tokens`
    tokens; the time of each token from a streamer."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(ckpt, device_map=dev,
                                                 torch_dtype=torch.bfloat16 if cuda else torch.float32)
    load_s = time.perf_counter() - t0

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    ids = torch.tensor([PROMPT], device=dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    got = int(out.shape[1] - ids.shape[1])
    first, last = clock.times[1], clock.times[-1]
    print(MARK + json.dumps({
        "rc": 0, "load_s": load_s, "first_token_s": first - t0, "new_tokens": got,
        "decode_tokens_per_s": (got - 1) / max(last - first, 1e-9),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}), file=sys.stderr)
    return 0


def child_decode(ckpt: str, new_tokens: int) -> int:
    """jqlora's decode rate with the CLI's defaults: generation of 1 and of `new_tokens` tokens,
    each timed on its second call (the first compiles or loads from the cache)."""
    t0 = time.perf_counter()
    from jqlora import compile_cache

    path = compile_cache.cli_dir()
    if path is not None:
        compile_cache.enable(path)
    import numpy as np

    from jqlora import models
    from jqlora._util import default_compute_dtype, jnp_dtype, resolve_attention

    dtype = default_compute_dtype()
    attention, _ = resolve_attention("auto", dtype)
    model = models.load_causal_lm(ckpt, compute_dtype=jnp_dtype(dtype), attention=attention)
    ids = np.asarray([PROMPT], np.int32)
    times = {}
    for n in (1, new_tokens):
        np.asarray(models.generate(model, ids, n))  # compile (or load from the cache)
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            np.asarray(models.generate(model, ids, n))
            runs.append(time.perf_counter() - t)
        times[n] = statistics.median(runs)
    extra = times[new_tokens] - times[1]  # too small to resolve on a tiny model: no rate
    print(MARK + json.dumps({
        "rc": 0, "setup_s": time.perf_counter() - t0, "one_token_s": times[1], f"tokens_{new_tokens}_s": times[new_tokens],
        "decode_tokens_per_s": (new_tokens - 1) / extra if extra > 1e-3 else None,
        "attention": attention, "peak_bytes": _jax_peak()}), file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------ parent
def run_part(part: str, cmd: list[str], limit: float, env: dict, poll=None) -> dict:
    """Run one part's process with a time limit; `poll(elapsed)` is called every 50 ms while it
    runs. Returns its record: status, wall_s, the child's MARK line, stdout/stderr tails."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        status = "ok"
        while proc.poll() is None:
            if poll is not None:
                poll(time.perf_counter() - t0)
            if time.perf_counter() - t0 > limit:
                proc.kill()
                status = "timeout"
                break
            time.sleep(0.05)
        proc.wait()
        wall = time.perf_counter() - t0
        if poll is not None:
            poll(wall)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    child = {}
    for line in stderr.splitlines():
        if line.startswith(MARK):
            child = json.loads(line[len(MARK):])
    if status == "ok" and (proc.returncode != 0 or child.get("rc", 0) != 0):
        status = f"failed (exit {proc.returncode})"
    rec = {"part": part, "status": status, "wall_s": round(wall, 3), "command": " ".join(cmd[cmd.index("--") + 1:])
           if "--" in cmd else " ".join(cmd), **{k: v for k, v in child.items() if k != "rc"}}
    logged = [ln for ln in stderr.splitlines() if ln.startswith(("remat:", "attention:"))]
    if logged:
        rec["logged"] = logged
    for line in stderr.splitlines():
        if line.startswith("timing: "):  # `jqlora generate --timing`
            rec.update(json.loads(line[len("timing: "):]))
    if status != "ok":
        rec["stderr_tail"] = stderr[-2000:]
    rec["_stdout"] = stdout
    return rec


def _first_row_watcher(csv_path: Path, rec: dict):
    """A poll function that records, once, the elapsed time at which loss.csv has a data row."""
    def poll(elapsed):
        if "first_step_s" not in rec and csv_path.is_file():
            with open(csv_path) as f:
                if sum(1 for line in f if line.strip()) >= 2:  # header + step 1
                    rec["first_step_s"] = round(elapsed, 3)
    return poll


def _steady(csv_path: Path) -> float | None:
    """Median of the per-step tokens/s the CLI logged after step 2 (step 1 includes compiling)."""
    import csv

    if not csv_path.is_file():
        return None
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    rates = [float(r["tokens_per_s"]) for r in rows if int(r["step"]) > 2]
    return round(statistics.median(rates), 1) if rates else None


def write_data(path: Path, seq_len: int, rows: int, seed: int = 0) -> None:
    """JSONL of random lowercase strings, two documents per `seq_len` row when packed."""
    import random

    rng = random.Random(seed)
    n = max(4, seq_len // 2 - 2)  # + BOS and EOS per document
    with open(path, "w") as f:
        for _ in range(2 * rows):
            f.write(json.dumps({"text": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))}) + "\n")


def gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "cpu"


def package_versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("jax", "jaxlib", "flax", "torch", "transformers", "bitsandbytes", "peft"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def measured_commit() -> str | None:
    """The measured commit: $JQLORA_COMMIT where set (a copy of the tree whose .git is not the
    source's, as on the GPU machine), else git's HEAD here (+dirty)."""
    if os.environ.get("JQLORA_COMMIT"):
        return os.environ["JQLORA_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def gib(n) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def run(shape: str, out_dir: str, *, steps: int, new_tokens: int, budget_s: float, workdir: str | None,
        skip: set[str], log=print) -> dict:
    """Every part in order within `budget_s` seconds; returns the result record (also written)."""
    t_start = time.perf_counter()
    py = sys.executable
    res = {"benchmark": "product", "shape": shape, "device": gpu_name(),
           "date": datetime.date.today().isoformat(), "commit": measured_commit(), "versions": package_versions(),
           "command": " ".join([os.path.basename(py), "-m", "benchmarks.product_bench", *sys.argv[1:]]),
           "seq_len": SEQ[shape], "steps": steps, "new_tokens": new_tokens, "budget_s": budget_s, "parts": []}
    work = Path(tempfile.mkdtemp(prefix="jqlora-product-", dir=workdir))
    base_env = dict(os.environ)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    ckpt, data = work / "ckpt-nf4", work / "data.jsonl"

    def left() -> float:
        return budget_s - (time.perf_counter() - t_start)

    def part(name: str, kind: str, cmd: list[str], env=None, poll=None, rec_extra=None) -> dict:
        limit = min(part_limit(kind, shape), left() - 20)  # 20 s kept for writing the results
        if kind in skip or name in skip:
            rec = {"part": name, "status": "skipped (--skip)"}
        elif limit < 10:
            rec = {"part": name, "status": f"skipped (budget: {max(left(), 0):.0f} s left)"}
        else:
            log(f"[{time.perf_counter() - t_start:6.1f} s] {name} (limit {limit:.0f} s)")
            holder = dict(rec_extra or {})
            rec = run_part(name, cmd, limit, env or base_env, poll=poll(holder) if poll else None)
            rec.update(holder)
        res["parts"].append(rec)
        log(f"  -> {rec['status']}" + (f", {rec['wall_s']} s" if "wall_s" in rec else ""))
        return rec

    try:
        write_data(data, SEQ[shape], rows=steps + 8)
        ck = part("checkpoint", "checkpoint", [py, "-m", "benchmarks.product_bench", "checkpoint", shape, str(ckpt)])
        if ck["status"] != "ok":
            return res
        child = [py, "-m", "benchmarks.product_bench", "cli", "--"]
        train_cmd = ["train", "--model", str(ckpt), "--data-path", str(data), "--seq-len", str(SEQ[shape]),
                     "--batch-size", "1", "--steps", str(steps), "--log-every", "1"]
        gen_cmd = ["generate", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                   str(new_tokens), "--timing"]
        train_cache, gen_cache = work / "cache-train", work / "cache-generate"
        for cache_state in ("cold", "warm"):
            run_dir = work / f"run-{cache_state}"
            csv_path = run_dir / "loss.csv"
            env = dict(base_env, JQLORA_COMPILE_CACHE=str(train_cache))
            rec = part(f"jqlora train ({cache_state} cache)", "train",
                       child + train_cmd + ["--out-dir", str(run_dir)], env=env,
                       poll=lambda holder, p=csv_path: _first_row_watcher(p, holder))
            if rec.get("status") == "ok":
                rec["steady_tokens_per_s"] = _steady(csv_path)
                rec["peak_gib"] = gib(rec.pop("peak_bytes", None))
                rec["cache_files"] = sum(1 for _ in train_cache.rglob("*") if _.is_file())
        for cache_state in ("cold", "warm"):
            env = dict(base_env, JQLORA_COMPILE_CACHE=str(gen_cache))
            rec = part(f"jqlora generate ({cache_state} cache)", "generate", child + gen_cmd, env=env)
            if rec.get("status") == "ok":
                rec["peak_gib"] = gib(rec.pop("peak_bytes", None))
        rec = part("torch train (transformers + PEFT + bitsandbytes)", "torch_train",
                   [py, "-m", "benchmarks.train_bench", "--side", "torch", "--shape", shape, "--seq",
                    str(SEQ[shape]), "--steps", str(min(steps, 5))])
        if rec.get("status") == "ok":
            line = (rec["_stdout"].strip().splitlines() or ["{}"])[-1]
            r = json.loads(line)
            rec.update(steady_tokens_per_s=round(r["tokens_per_s"], 1), first_step_s=None,
                       warmup_step_s=round(r["warmup_s"], 3), peak_gib=round(r["peak_gib"], 3),
                       gradient_checkpointing=r["gradient_checkpointing"])
        rec = part("torch generate (transformers + bitsandbytes)", "torch_generate",
                   [py, "-m", "benchmarks.product_bench", "torch-generate", str(ckpt), str(new_tokens)])
        if rec.get("status") == "ok":
            rec["peak_gib"] = gib(rec.pop("peak_bytes", None))
        env = dict(base_env, JQLORA_COMPILE_CACHE=str(gen_cache))
        rec = part("jqlora decode (library, CLI defaults)", "decode",
                   [py, "-m", "benchmarks.product_bench", "decode", str(ckpt), str(new_tokens)], env=env)
        if rec.get("status") == "ok":
            rec["peak_gib"] = gib(rec.pop("peak_bytes", None))
        return res
    finally:
        for rec in res["parts"]:
            rec.pop("_stdout", None)
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        write_results(res, out_dir, log=log)
        shutil.rmtree(work, ignore_errors=True)


def markdown(res: dict) -> str:
    lines = [f"# jqlora product path: {res['device']} ({res['date']}, commit {res['commit']})", "",
             f"`{res['command']}`; shape {res['shape']}, seq_len {res['seq_len']}, {res['steps']} train steps, "
             f"{res['new_tokens']} new tokens; versions: "
             + ", ".join(f"{k} {v}" for k, v in res["versions"].items() if v), "",
             "| part | status | wall s | first step / token s | train tokens/s | generation tokens/s | peak GiB | chosen |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["parts"]:
        first = r.get("first_step_s", r.get("first_token_s"))
        chosen = "; ".join(r.get("logged", []))
        cells = [r["part"], r["status"], r.get("wall_s"), first, r.get("steady_tokens_per_s"),
                 r.get("decode_tokens_per_s", r.get("tokens_per_s")), r.get("peak_gib"), chosen]
        lines.append("| " + " | ".join("-" if c is None else (f"{c:.2f}" if isinstance(c, float) else str(c))
                                       for c in cells) + " |")
    lines += ["", "first step: seconds from launch until the CLI's loss.csv has step 1 (load, compile, step). "
              "train tokens/s: the median step after step 2. jqlora generate prints every token at the end: its "
              "time to first token is its wall time, and its tokens/s is new tokens / generate_s (program load "
              "or compile, prefill and decode). torch generate and jqlora decode: decode tokens/s after the "
              "first token. "
              f"Total {res.get('total_s')} s of a {res['budget_s']:.0f} s budget."]
    return "\n".join(lines) + "\n"


def write_json_and_md(res: dict, md: str, out_dir: str, suffix: str, log=print) -> str:
    """<out>/<device>-<date><suffix>.json (`res`) and .md (`md`), each written to a temporary name
    and renamed, so that a reader never sees half a file. Returns the path without extension."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{res['device'].lower().replace(' ', '-')}-{res['date']}{suffix}")
    for ext, text in ((".json", json.dumps(res, indent=1)), (".md", md)):
        with open(stem + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(stem + ext + ".tmp", stem + ext)
    log(f"wrote {stem}.json and {stem}.md")
    return stem


def write_results(res: dict, out_dir: str, log=print) -> str:
    """<out>/<device>-<date>_product_<shape>.json and .md."""
    return write_json_and_md(res, markdown(res), out_dir, f"_product_{res['shape']}", log)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cli"]:
        return child_cli(argv[argv.index("--") + 1:] if "--" in argv else argv[1:])
    if argv[:1] == ["checkpoint"]:
        return child_checkpoint(argv[1], argv[2])
    if argv[:1] == ["torch-generate"]:
        return child_torch_generate(argv[1], int(argv[2]))
    if argv[:1] == ["decode"]:
        return child_decode(argv[1], int(argv[2]))
    p = argparse.ArgumentParser(prog="python -m benchmarks.product_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SEQ), default="1b")
    p.add_argument("--steps", type=int, default=None, help="train steps per jqlora run (default by shape)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per generation (default by shape)")
    p.add_argument("--budget-s", type=float, default=560.0, help="time for everything; parts that do not fit are skipped")
    p.add_argument("--out", default=RESULTS_DIR, help="where the .json and .md go")
    p.add_argument("--workdir", default=None, help="parent of the temporary checkpoint/run directory")
    p.add_argument("--skip", default="", help="comma-separated kinds to skip: train, generate, torch_train, "
                                              "torch_generate, decode")
    a = p.parse_args(argv)
    res = run(a.shape, a.out, steps=a.steps or STEPS[a.shape], new_tokens=a.new_tokens or NEW_TOKENS[a.shape],
              budget_s=a.budget_s, workdir=a.workdir, skip={s for s in a.skip.split(",") if s})
    bad = [r["part"] for r in res["parts"] if not (r["status"] == "ok" or r["status"].startswith("skipped"))]
    return 1 if bad or not res["parts"] or res["parts"][0]["status"] != "ok" else 0


if __name__ == "__main__":
    sys.exit(main())
