"""The performance table in one command: the QLoRA training step (jqlora NF4, jqlora's bf16-weight
LoRA step as its ceiling, transformers + PEFT + bitsandbytes) at each sequence length, and decode
at batch 1, on one GPU, against the targets for that GPU:

    python -m benchmarks.step_table                       # 8B shape, 1 x 2048 and 1 x 4096, decode 8B and 1B
    python -m benchmarks.step_table --into FILE.json      # run the parts FILE lacks, write the merged table
    python -m benchmarks.step_table --shape tiny --seqs 64 --parts nf4,bf16 --decode none --surogate none --out /tmp/x  # CPU smoke

Every part runs in its own process (peak memory is per process), in priority order, within
--budget-s; what does not fit is recorded as skipped, and `--into` fills it in from a later call
(each part records the host it ran on; the table says when parts come from more than one host).
Training: `benchmarks.train_bench` with `--remat auto --attention cudnn` (what `jqlora train`
chooses on a GPU; einsum attention on a machine without one), batch 1, LoRA r=16 on all seven projections, random weights; tokens/s is the
pipelined loop (one step in flight, as `jqlora train` runs) and, beside it, the loop that reads
each loss before the next step. Decode: `benchmarks.profile.decode_profile`'s `default` variant
(the library's settings), random NF4, no LoRA, 256 new tokens. Last, Surogate's published
configuration (`--surogate`, NF4 and bf16 weights): the Qwen3-8B shape, 2 rows of 2,048 tokens with
4 documents packed in each, an optimizer update every step (Surogate accumulates 4 micro-steps).

Writes <out>/<device>-<date>_step_table.json and .md (device, date, commit, versions, command).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

from benchmarks.product_bench import (RESULTS_DIR, gpu_name, measured_commit, package_versions, run_part,
                                      write_json_and_md)

# tokens/s targets of the training step and of decode, per GPU (matched on the device name)
TRAIN_TARGETS = {"H200": {2048: 15_000, 4096: 15_000}, "H100": {2048: 13_000, 4096: 13_000}}
DECODE_TARGETS = {"H200": {"8b": 450, "1b": 1_500}, "H100": {"8b": 300}}
SUROGATE_TARGETS = {"H100": 11_600}  # Surogate's own FP8 step on one H100
# Surogate's configuration: train_bench arguments after --side/--weights
SUROGATE = ["--shape", "qwen3-8b", "--rows", "2", "--packed", "--docs", "4", "--seq", "2048"]
SIDES = {"nf4": ["--side", "jax", "--weights", "nf4"], "bf16": ["--side", "jax", "--weights", "bf16"],
         "torch": ["--side", "torch"]}
SIDE_LABELS = {"nf4": "jqlora NF4", "bf16": "jqlora bf16 weights", "torch": "transformers + PEFT + bitsandbytes NF4"}
LIMITS = {"train": 240, "decode": 200}  # seconds a part may take (the remaining budget cuts them further)
DECODE_TOKENS = 256


def part_names(sides: list[str], seqs: list[int], decode: list[str], surogate=()) -> list[str]:
    """The parts in the order they run: every side at the first length, then decode, then the other
    lengths, then Surogate's configuration (the headline cells first, so a short budget drops the
    least important ones)."""
    first = [f"{s}:{seqs[0]}" for s in sides] if seqs else []
    rest = [f"{s}:{t}" for t in seqs[1:] for s in sides]
    return first + [f"decode:{d}" for d in decode] + rest + [f"surogate:{w}" for w in surogate]


def target_for(table: dict, device: str):
    """The targets of the first GPU name in `table` that `device` contains, or None."""
    return next((v for k, v in table.items() if k.lower() in device.lower()), None)


def _last_json(text: str, prefix: str = "") -> dict | None:
    """The last line of `text` that is `prefix` + a JSON object, parsed (None if there is none)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith(prefix):
            continue
        line = line[len(prefix):]
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def part_command(name: str, shape: str, steps: int, attention: str = "cudnn") -> list[str]:
    py = sys.executable
    kind, arg = name.split(":")
    if kind == "decode":
        return [py, "-m", "benchmarks.profile.decode_profile", "--shape", arg, "--tokens", str(DECODE_TOKENS),
                "--child", "default"]
    model = [*SIDES[arg], *SUROGATE] if kind == "surogate" else [*SIDES[kind], "--shape", shape, "--seq", arg]
    return [py, "-m", "benchmarks.train_bench", *model, "--steps", str(steps), "--remat", "auto",
            "--attention", attention]


def read_part(name: str, rec: dict) -> dict:
    """The fields the table shows, from the part's printed JSON line."""
    kind = name.split(":")[0]
    out = rec.pop("_stdout", "")
    if rec["status"] != "ok":
        return rec
    if kind == "decode":
        r = _last_json(out, "decode_profile: ") or {}
        rec.update({k: r.get(k) for k in ("decode_tokens_per_s", "gpu_us_per_token", "wall_us_per_token_traced",
                                          "kernels_per_token", "compile_s", "by_category_us")})
    else:
        r = _last_json(out) or {}
        rec.update({k: r.get(k) for k in ("tokens_per_s", "pipelined_tokens_per_s", "peak_gib", "step_s",
                                          "pipelined_step_s", "model_tflops", "pipelined_model_tflops", "remat",
                                          "losses", "compile_s", "warmup_s")})
    if not r:
        rec["status"] = "failed (no result line)"
    return rec


def run(shape: str, seqs: list[int], sides: list[str], decode: list[str], steps: int, budget_s: float,
        out_dir: str, into: dict | None = None, log=print, surogate=()) -> dict:
    t_start = time.perf_counter()
    device = gpu_name()
    res = into or {"benchmark": "step_table", "shape": shape, "device": device, "parts": []}
    if into is not None and into.get("device") != device:
        raise SystemExit(f"step_table: --into holds a {into.get('device')} table; this machine has {device}")
    if into is not None and into.get("shape") != shape:
        raise SystemExit(f"step_table: --into holds a {into.get('shape')} table; --shape is {shape}")
    res.update(date=datetime.date.today().isoformat(), commit=measured_commit(), versions=package_versions(),
               budget_s=budget_s)
    res.setdefault("commands", []).append(" ".join([os.path.basename(sys.executable), "-m",
                                                    "benchmarks.step_table", *sys.argv[1:]]))
    have = {p["part"] for p in res["parts"] if p["status"] == "ok"}
    res["parts"] = [p for p in res["parts"] if p["part"] in have]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in part_names(sides, seqs, decode, surogate):
        if name in have:
            continue
        left = budget_s - (time.perf_counter() - t_start)
        limit = min(LIMITS["decode" if name.startswith("decode") else "train"], left - 15)
        if limit < 30:
            rec = {"part": name, "status": f"skipped (budget: {max(left, 0):.0f} s left)"}
        else:
            log(f"[{time.perf_counter() - t_start:6.1f} s] {name} (limit {limit:.0f} s)")
            cmd = part_command(name, shape, steps, "einsum" if device == "cpu" else "cudnn")
            rec = read_part(name, run_part(name, cmd, limit, env))
            rec.update(host=socket.gethostname(), commit=res["commit"], date=res["date"], attention=cmd[-1]
                       if not name.startswith("decode") else None)
        log(f"  -> {rec['status']}" + (f", {rec['wall_s']} s" if "wall_s" in rec else ""))
        res["parts"].append(rec)
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    write_results(res, out_dir, log)
    return res


def _num(v, digits=0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def markdown(res: dict) -> str:
    parts = {p["part"]: p for p in res["parts"]}
    ok = lambda name: parts.get(name) if parts.get(name, {}).get("status") == "ok" else None  # noqa: E731
    train_t, decode_t = target_for(TRAIN_TARGETS, res["device"]), target_for(DECODE_TARGETS, res["device"])
    hosts = sorted({p["host"] for p in res["parts"] if p.get("host")})
    commits = sorted({p["commit"] for p in res["parts"] if p.get("commit")})
    attention = sorted({p["attention"] for p in res["parts"] if p.get("attention")})
    v = res.get("versions", {})
    lines = [f"# Training step and decode: {res['device']} ({res['date']}, commit {', '.join(commits) or res['commit']})",
             "", f"Shape {res['shape']}, batch 1, LoRA r=16 on q/k/v/o/gate/up/down, random weights, `remat auto`, "
             f"attention {', '.join(attention) or '-'}. Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + ".",
             "Commands: " + "; ".join(f"`{c}`" for c in res.get("commands", [])) + "."]
    if len(hosts) > 1:
        lines.append(f"Parts ran on {len(hosts)} machines of this kind ({', '.join(hosts)}).")
    lines += ["", "## Training step, tokens/s (pipelined; each loss read before the next step in brackets)", "",
             "| seq | jqlora NF4 | peak GiB | jqlora bf16 weights | peak GiB | NF4 / bf16 | torch QLoRA | peak GiB "
             "| jqlora NF4 / torch | target | met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    seqs = sorted({int(n.split(":")[1]) for n in parts if n.split(":")[0] in SIDES})
    for t in seqs:
        n, b, tq = ok(f"nf4:{t}"), ok(f"bf16:{t}"), ok(f"torch:{t}")
        g = lambda r, k: None if r is None else r.get(k)  # noqa: E731
        cell = lambda r: "-" if r is None else f"{_num(r['pipelined_tokens_per_s'])} ({_num(r['tokens_per_s'])})"  # noqa: E731
        target = None if train_t is None else train_t.get(t)
        nf4 = g(n, "pipelined_tokens_per_s")
        met = "-" if target is None or nf4 is None else ("yes" if nf4 >= target else "no")
        lines.append(f"| {t} | {cell(n)} | {_num(g(n, 'peak_gib'), 1)} | {cell(b)} | {_num(g(b, 'peak_gib'), 1)} | "
                     f"{_ratio(nf4, g(b, 'pipelined_tokens_per_s'))} | {cell(tq)} | {_num(g(tq, 'peak_gib'), 1)} | "
                     f"{_ratio(nf4, g(tq, 'pipelined_tokens_per_s'))} | {_num(target)} | {met} |")
    dec = [n for n in parts if n.startswith("decode")]
    if dec:
        lines += ["", f"## Decode at batch 1, NF4, {DECODE_TOKENS} new tokens", "",
                  "| shape | tokens/s | GPU us/token | wall us/token (traced) | kernels/token | target | met |",
                  "|---|---|---|---|---|---|---|"]
        for name in dec:
            shape, r = name.split(":")[1], ok(name)
            target = None if decode_t is None else decode_t.get(shape)
            tps = None if r is None else r.get("decode_tokens_per_s")
            met = "-" if target is None or tps is None else ("yes" if tps >= target else "no")
            lines.append(f"| {shape} | {_num(tps, 1)} | {_num(None if r is None else r.get('gpu_us_per_token'), 1)} | "
                         f"{_num(None if r is None else r.get('wall_us_per_token_traced'), 1)} | "
                         f"{_num(None if r is None else r.get('kernels_per_token'), 1)} | {_num(target)} | {met} |")
    sur = [n for n in parts if n.startswith("surogate:")]
    if sur:
        target = target_for(SUROGATE_TARGETS, res["device"])
        lines += ["", "## Surogate's configuration: Qwen3-8B shape, 2 x 2,048 tokens, 4 documents packed a row, "
                  "tokens/s (pipelined; each loss read before the next step in brackets)", "",
                  "| weights | tokens/s | peak GiB | NF4 / bf16 | target | met |", "|---|---|---|---|---|---|"]
        bf16 = (ok("surogate:bf16") or {}).get("pipelined_tokens_per_s")
        for name in sur:
            r = ok(name)
            tps = None if r is None else r.get("pipelined_tokens_per_s")
            nf4 = name == "surogate:nf4"
            met = "-" if target is None or tps is None or not nf4 else ("yes" if tps >= target else "no")
            cell = "-" if r is None else f"{_num(tps)} ({_num(r.get('tokens_per_s'))})"
            lines.append(f"| {name.split(':')[1]} | {cell} | {_num(None if r is None else r.get('peak_gib'), 1)} | "
                         f"{_ratio(tps, bf16) if nf4 else '-'} | {_num(target) if nf4 else '-'} | {met} |")
    missing = [f"{p['part']} ({p['status']})" for p in res["parts"] if p["status"] != "ok"]
    if missing:
        lines += ["", "Not measured: " + "; ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def write_results(res: dict, out_dir: str, log=print) -> str:
    """<out>/<device>-<date>_step_table.json and .md."""
    return write_json_and_md(res, markdown(res), out_dir, "_step_table", log)


def _csv(text: str) -> list[str]:
    return [] if text in ("", "none") else [s for s in text.split(",") if s]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_table", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="train_bench shape of the training step (default 8b)")
    p.add_argument("--seqs", default="2048,4096", help="sequence lengths of the training step")
    p.add_argument("--parts", default="nf4,bf16,torch", help=f"training sides: {', '.join(SIDES)}")
    p.add_argument("--decode", default="8b,1b", help="decode shapes ('none': no decode)")
    p.add_argument("--surogate", default="nf4,bf16", help="weights of Surogate's configuration ('none': not run)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per loop")
    p.add_argument("--budget-s", type=float, default=570.0, help="time for everything; parts that do not fit are skipped")
    p.add_argument("--into", default=None, help="an earlier step_table .json: run only the parts it lacks, then merge")
    p.add_argument("--out", default=RESULTS_DIR, help="where the .json and .md go")
    a = p.parse_args(argv)
    sides, surogate = _csv(a.parts), _csv(a.surogate)
    unknown = [s for s in sides if s not in SIDES] + [w for w in surogate if w not in ("nf4", "bf16")]
    if unknown:
        p.error(f"unknown --parts / --surogate {unknown}; choose from {', '.join(SIDES)} / nf4, bf16")
    into = None
    if a.into:
        with open(a.into) as f:
            into = json.load(f)
    res = run(a.shape, [int(s) for s in _csv(a.seqs)], sides, _csv(a.decode), a.steps, a.budget_s, a.out, into,
              surogate=surogate)
    return 0 if all(r["status"] == "ok" for r in res["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
