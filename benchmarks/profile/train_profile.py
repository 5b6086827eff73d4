"""Where the device time of one jqlora QLoRA training step goes, kernel by kernel.

    OUT=/tmp/out python -m benchmarks.profile.train_profile --shape 8b [--layers 32] [--steps 2]
    OUT=/tmp/out python -m benchmarks.profile.train_profile --shape moe [--layers 48] [--optimizer adamw8bit]

Builds the step of `benchmarks.train_bench` (same model, batch and optimizer; `--shape moe`: the
Qwen3-30B-A3B-shaped step of `benchmarks.moe_bench`), runs it twice to
warm up, then traces `--steps` steps with `jax.profiler` and sums the GPU kernel times of the
Perfetto trace. Each kernel is put in a category (GEMM, dequant, attention, XLA fusion, ...);
cuBLAS GEMMs are labelled with their operand shapes from the optimized HLO, so the frozen-weight
GEMMs (K or N of the model's hidden/intermediate size, M = tokens) and the LoRA GEMMs (a rank-r
operand) are told apart. XLA's command buffers (CUDA graphs) are off in this process unless
`--command-buffers`: inside one, the trace gives the buffer, not the instruction, as each kernel's
HLO op. Writes $OUT/train_profile_<shape>.json and prints a summary table.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

_GEMM_NAME = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)
_ATTN_NAME = re.compile(r"cudnn|fmha|flash|sdpa|attention", re.I)
_SHAPE = re.compile(r"[a-z0-9]+\[[0-9,]*\]")


def kernel_events(trace: dict) -> list[dict]:
    """Complete ('X') events of the trace's GPU device processes: one per kernel launch."""
    gpu_pids = {e["pid"] for e in trace.get("traceEvents", [])
                if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def hlo_lines(hlo_text: str) -> dict[str, str]:
    """{instruction name: its line} of an optimized HLO module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m:
            out[m.group(1)] = line.strip()
    return out


def result_shape(line: str) -> str:
    """The result shape text of an HLO instruction line ('bf16[2048,4096]'), or ''."""
    m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\(?([a-z0-9]+\[[0-9,]*\])", line)
    return m.group(1) if m else ""


def gemm_label(line: str | None, lines: dict, lora_rank: int) -> str:
    """'gemm lora' if the result or an operand has a dimension equal to the LoRA rank, else
    'gemm frozen/head'; with the result and operand shapes (operands looked up by name, since
    optimized HLO prints fusion operands without shapes)."""
    if line == "":
        return "gemm (inside a command buffer)"
    if not line:
        return "gemm (no HLO line)"
    call = line.split("=", 1)[1].split("custom_call_target")[0].split("calls=")[0]
    operands = re.findall(r"%([\w.\-]+)", call)
    shapes = [result_shape(line)] + [result_shape(lines.get(o, "")) for o in operands]
    shapes = [sh for sh in shapes if sh]
    dims = {int(d) for sh in shapes for d in re.findall(r"\d+", sh.split("[", 1)[1])}
    kind = "lora" if lora_rank in dims else "frozen/head"
    return f"gemm {kind} " + " ".join(shapes[:4])


NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def without_command_buffers(xla_flags: str) -> str:
    """XLA_FLAGS with XLA's command buffers (CUDA graphs) off. Inside a command buffer the trace
    names the buffer (`command_buffer_16`) as every kernel's HLO op, so no kernel could be told
    from another by its instruction (a frozen GEMM from a LoRA GEMM); kernel times are the same."""
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_gpu_enable_command_buffer")]
    return " ".join(kept + [NO_COMMAND_BUFFERS])


def categorize(name: str, hlo_op: str | None, lines: dict, lora_rank: int) -> tuple[str, str]:
    """(category, label) of one kernel."""
    low = name.lower()
    line = lines.get(hlo_op or "")
    if line is None and (hlo_op or "").startswith("command_buffer"):
        line = ""  # run with command buffers off (`without_command_buffers`) to attribute it
    if "dequantize_4bit" in low or "dequantize_int8" in low or "dequant" in low:
        return "dequant", name
    if _ATTN_NAME.search(name):
        return "attention", name
    own = (line or "").split("metadata=")[0]  # the instruction itself, not its operands' names
    if _GEMM_NAME.search(name) or "__cublas" in own or "calls=%gemm_fusion" in own:
        label = gemm_label(line, lines, lora_rank)
        return ("gemm lora" if " lora " in label else "gemm frozen/head"), label
    if "matmul_" in low or "_kernel" in low:
        return "pallas", name
    if low.startswith("rms_norm"):  # pallas_kernels.triton.rms_norm, the decoding rows' norms
        return "norm", name
    if "memcpy" in low or "memset" in low:
        return "memory", name
    if "fusion" in low or "reduce" in low or "transpose" in low or "convert" in low or low.startswith(("loop_", "input_")):
        return "xla fusion", name
    return "other", name


def summarize(events: list[dict], lines: dict, steps: int, lora_rank: int) -> dict:
    """Per-step totals by category and by (category, label), in microseconds."""
    by_cat, by_label = collections.defaultdict(float), collections.defaultdict(float)
    count = collections.Counter()
    example_line = {}
    for e in events:
        args = e.get("args", {})
        hlo_op = args.get("hlo_op") or args.get("long_name")
        cat, label = categorize(e["name"], hlo_op, lines, lora_rank)
        by_cat[cat] += e["dur"] / steps
        by_label[(cat, label)] += e["dur"] / steps
        count[(cat, label)] += 1
        if hlo_op and (cat, label) not in example_line:
            example_line[(cat, label)] = (lines.get(hlo_op) or hlo_op)[:400]
    total = sum(by_cat.values())
    top = sorted(by_label.items(), key=lambda kv: -kv[1])
    return {"total_us": round(total, 1),
            "by_category_us": {k: round(v, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"category": c, "label": lab, "us_per_step": round(v, 1),
                             "launches_per_step": count[(c, lab)] / steps,
                             "hlo": example_line.get((c, lab), "")} for (c, lab), v in top[:60]]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--backend", default="auto")
    p.add_argument("--attention", default="cudnn")
    p.add_argument("--packed", action="store_true", help="pass segment ids (attention gets the (T, T) mask)")
    p.add_argument("--optimizer", default="adamw", help="adamw or adamw8bit (make_optimizer)")
    p.add_argument("--weights", default="nf4", help="nf4 or bf16: the base weights (train_bench --weights)")
    p.add_argument("--command-buffers", action="store_true",
                   help="keep XLA's command buffers (CUDA graphs): kernels inside them cannot be attributed")
    a = p.parse_args(argv)
    if not a.command_buffers:  # read when jax initialises its backend, so set before that
        os.environ["XLA_FLAGS"] = without_command_buffers(os.environ.get("XLA_FLAGS", ""))
    if a.shape == "moe" and (a.weights, a.backend, a.attention, a.packed) != ("nf4", "auto", "cudnn", False):
        p.error("--shape moe builds moe_bench's step (NF4, the CLI's attention and kernels, unpacked rows): "
                "--weights, --backend, --attention and --packed do not apply")

    import jax

    if a.shape == "moe":
        from benchmarks import moe_bench

        side = moe_bench.build_jax(moe_bench.config(False, a.layers), a.seq, False, optimizer=a.optimizer)
        step, batch = side.run, side.batch
    else:
        from benchmarks.train_bench import build_jax
        from jqlora.train.step import train_step

        model, opt, batch = build_jax(a.shape, a.seq, a.backend, a.attention, layers=a.layers, optimizer=a.optimizer,
                                      weights=a.weights)
        if not a.packed:  # as train_bench: one unpacked sequence per row unless --packed
            del batch["segment_ids"]
        step = train_step.bind(model, opt)
    compiled = step.lower(batch).compile()
    hlo, ma = compiled.as_text(), compiled.memory_analysis()
    plan = {k: round(getattr(ma, f"{k}_size_in_bytes", 0) / 2**30, 3)
            for k in ("argument", "output", "alias", "temp", "generated_code")} if ma is not None else {}
    for _ in range(2):
        jax.block_until_ready(step(batch)["loss"])
    times = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.steps):
                t0 = time.perf_counter()
                jax.block_until_ready(step(batch)["loss"])
                times.append(time.perf_counter() - t0)
        paths = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise SystemExit(f"no Perfetto trace under {d}")
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    events = kernel_events(trace)
    res = summarize(events, hlo_lines(hlo), a.steps, lora_rank=16)
    stats = jax.devices()[0].memory_stats() or {}
    res.update(shape=a.shape, layers=a.layers, optimizer=a.optimizer,
               peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30, compiled_gib=plan, weights=a.weights,
               seq=a.seq, steps=a.steps, attention=a.attention, packed=a.packed,
               wall_step_s=[round(t, 4) for t in times], device=jax.devices()[0].device_kind,
               jax=jax.__version__, kernel_events=len(events), xla_flags=os.environ.get("XLA_FLAGS", ""))
    out_dir = os.environ.get("OUT", "/tmp")
    tag = f"{a.shape}" + (f"_{a.layers}l" if a.layers else "") + ("" if a.weights == "nf4" else f"_{a.weights}") \
        + ("" if a.optimizer == "adamw" else f"_{a.optimizer}")
    with open(os.path.join(out_dir, f"train_profile_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    with gzip.open(os.path.join(out_dir, f"train_profile_{tag}.hlo.txt.gz"), "wt") as f:
        f.write(hlo)
    print(f"device time per step {res['total_us'] / 1e3:.1f} ms (wall {min(times) * 1e3:.1f} ms), {len(events)} kernels, "
          f"peak {res['peak_gib']:.2f} GiB, compiled plan (GiB) {plan}")
    for cat, us in res["by_category_us"].items():
        print(f"  {cat:18s} {us / 1e3:8.2f} ms  {100 * us / res['total_us']:5.1f}%")
    for row in res["top_kernels"][:30]:
        print(f"  {row['us_per_step'] / 1e3:7.2f} ms x{row['launches_per_step']:6.0f}  {row['label'][:110]}")


if __name__ == "__main__":
    main()
