"""One command for the GPU benchmark: `python -m benchmarks.run` (also `jqlora bench`).

Writes <out>/<gpu>-<yyyy-mm-dd><tag>.json and .md with device name and versions (default out:
benchmarks/results/; once committed they are filed under results/history/<date>_<commit>/, and a
run that replaces a cited one is copied to results/latest/: docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax

from benchmarks import matmul_bench, targets

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def versions() -> dict:
    out = {"python": platform.python_version(), "jax": jax.__version__}
    for mod in ("jaxlib", "torch", "bitsandbytes", "triton", "flax"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", str(d))


def _memory_runs(log, backend="pallas"):
    out = {}
    for mode in ("qmatmul", "dense_residuals"):
        cmd = [sys.executable, "-m", "benchmarks.memory_bench", "--mode", mode, "--backend", backend]
        # this process has preallocated most of the GPU: the child must allocate as it goes
        # (peak_bytes_in_use is unaffected) or it cannot even load its kernels
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = (r.stdout.strip().splitlines() or [""])[-1]
        try:
            out[mode] = json.loads(line)
        except json.JSONDecodeError:
            out[mode] = {"error": (r.stderr or r.stdout)[-500:]}
        log(f"memory {mode}: {out[mode]}")
    return out


def markdown(res: dict) -> str:
    lines = [f"# jqlora benchmark: {res['device']} ({res['date']})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items() if v), "",
             "Ratio = device time / device time of `jnp.dot` bf16 (same shape, same run); "
             "NF4 blocksize 64 with double quant, bf16 activations. K x N = in x out.", ""]
    names = []
    for cell in res["matmul"]:
        for n in cell["ratios"]:
            if n not in names:
                names.append(n)
    for key, title in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward (dx)")):
        lines += [f"## {title}", "", "| M | K x N | bf16 us | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for cell in res["matmul"]:
            base = cell["rows"].get("jnp.dot bf16", {}).get(key)
            vals = []
            for n in names:
                r = cell["ratios"].get(n, {}).get(key)
                err = cell["rows"].get(n, {}).get("error")
                vals.append(f"{r:.2f}" if r is not None else ("err" if err else "-"))
            b = f"{base * 1e3:.1f}" if base else "-"
            lines.append(f"| {cell['m']} | {cell['k']}x{cell['n']} | {b} | " + " | ".join(vals) + " |")
        lines.append("")
    if res.get("dequant"):
        d = res["dequant"]
        lines += ["## standalone dequant (NF4 -> bf16)", "",
                  f"shape {d['shape']}, device copy bandwidth {d['copy_tb_s']:.2f} TB/s", "",
                  "| variant | TB/s | fraction of copy |", "|---|---|---|"]
        for name, v in d["variants"].items():
            if "error" in v:
                lines.append(f"| {name} | err | {v['error'][:60]} |")
            else:
                lines.append(f"| {name} | {v['tb_s']:.2f} | {v['fraction_of_copy']:.2f} |")
        lines.append("")
    if res.get("skipped_cells"):
        lines += ["Not measured (time budget of the run spent): " + ", ".join(
            f"M={c['m']} {c['k']}x{c['n']}" for c in res["skipped_cells"]), ""]
    if res.get("memory"):
        lines += ["## memory: fwd+bwd through a stack of NF4 layers", "", "```",
                  json.dumps(res["memory"], indent=1), "```", ""]
    lines.append(targets.markdown(res))
    return "\n".join(lines)


def results_from_log(path: str, device: str, date: str, versions_text: str) -> dict:
    """Rebuild a run's results from its log (the lines `log` printed: one per matmul contender,
    then dequant and memory), for a run stopped before it wrote its files (a device call's time
    limit). Device, date and versions are not in the log: the caller states them."""
    import ast
    import re

    res = {"device": device, "date": date, "from_log": os.path.basename(path),
           "versions": dict(kv.split("=", 1) for kv in versions_text.split(",") if kv),
           "variants": [], "matmul": []}
    cells: dict = {}
    pat = re.compile(r"^  M=(\d+) K=(\d+) N=(\d+) (.+?): (\{.*\})$")
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if mt := pat.match(line):
                m, k, n = (int(v) for v in mt.groups()[:3])
                try:
                    row = ast.literal_eval(mt.group(5))
                except (ValueError, SyntaxError) as e:
                    raise ValueError(f"{path}:{number}: unreadable contender line: {e}") from e
                cells.setdefault((m, k, n), {})[mt.group(4)] = row
            elif sk := re.match(r"^  M=(\d+) K=(\d+) N=(\d+): skipped", line):
                m, k, n = (int(v) for v in sk.groups())
                res.setdefault("skipped_cells", []).append({"m": m, "k": k, "n": n})
            elif line.startswith("dequant: "):
                res["dequant"] = ast.literal_eval(line[len("dequant: "):])
            elif line.startswith("memory "):
                mode, _, body = line[len("memory "):].partition(": ")
                res.setdefault("memory", {})[mode] = ast.literal_eval(body)
    if not cells:
        raise ValueError(f"{path}: no matmul contender lines (\"  M=.. K=.. N=.. name: {{...}}\")")
    res["matmul"] = [{"m": m, "k": k, "n": n, "rows": rows} for (m, k, n), rows in cells.items()]
    res["variants"] = sorted({name.removeprefix("variant ") for rows in cells.values()
                              for name in rows if name.startswith("variant ")})
    return res


def write_rows(rows: list[dict], out_dir: str | None, kind: str, log=print) -> dict:
    """A sweep's result: its rows with device, date, commit and versions; written to
    <out_dir>/<gpu>-<date>_<kind>.json where out_dir is given."""
    from benchmarks.product_bench import measured_commit

    res = {"rows": rows, "device": device_name(), "date": datetime.date.today().isoformat(),
           "commit": measured_commit() or "unknown", "versions": versions(), "argv": sys.argv[1:]}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{res['device'].lower().replace(' ', '-')}-{res['date']}_{kind}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        log(f"wrote {path}")
    return res


def write_results(res: dict, out_dir: str, tag: str, log=print) -> str:
    """<out>/<gpu>-<date><tag>.json and .md, each written to a temporary name and renamed."""
    for c in res["matmul"]:
        c["ratios"] = matmul_bench.ratios(c["rows"])
    os.makedirs(out_dir, exist_ok=True)
    gpu = res["device"].lower().replace(" ", "-")
    stem = os.path.join(out_dir, f"{gpu}-{res['date']}{tag}")
    for ext, text in ((".json", json.dumps(res, indent=1)), (".md", markdown(res))):
        tmp = stem + ext + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, stem + ext)
    log(f"wrote {stem}.json and {stem}.md")
    return stem


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ms", default=",".join(map(str, matmul_bench.MS)))
    p.add_argument("--shapes", default="all", help="'all' or e.g. 4096x4096,4096x14336 (K x N)")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--skip", default="", help="comma list of: matmul,dequant,memory")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    p.add_argument("--variants", choices=["all", "none"], default="all",
                   help="also time every registered matmul_4bit variant (forward)")
    p.add_argument("--variant-ms", default=None,
                   help="M values at which the variants run (default: every M of --ms)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="matmul cells started after this many seconds are recorded as skipped, so "
                        "dequant, memory, torch and the result files still come out in a time limit")
    p.add_argument("--from-log", default=None, metavar="LOG",
                   help="no measuring: rebuild the result files from the log of a run that was "
                        "stopped before writing them (with --device-name, --date, --versions)")
    p.add_argument("--device-name", default=None)
    p.add_argument("--date", default=None)
    p.add_argument("--versions", default="", help="with --from-log: e.g. jax=0.11.2,triton=3.6.0")
    a = p.parse_args(argv)
    if a.from_log:
        if not (a.device_name and a.date):
            p.error("--from-log needs --device-name and --date (the log holds neither)")
        write_results(results_from_log(a.from_log, a.device_name, a.date, a.versions), a.out,
                      a.tag)
        return 0
    if jax.default_backend() != "gpu":
        print("jqlora bench: no GPU found; the benchmark measures GPU kernels only.", file=sys.stderr)
        return 2
    from pallas_kernels import registry

    log = lambda s: print(s, flush=True)
    skip = set(filter(None, a.skip.split(",")))
    shapes = matmul_bench.SHAPES_KN if a.shapes == "all" else tuple(
        tuple(int(v) for v in s.split("x")) for s in a.shapes.split(","))
    variants = ([v.name for op in ("matmul_4bit", "matmul_int8") for v in registry.for_op(op)]
                if a.variants == "all" else [])
    res = {"device": device_name(), "date": datetime.date.today().isoformat(), "versions": versions(),
           "variants": [v.name for v in registry.all_variants()], "matmul": []}
    variant_ms = {int(v) for v in (a.variant_ms or a.ms).split(",")}
    t0 = time.monotonic()
    if "matmul" not in skip:
        for k, n in shapes:
            for m in (int(v) for v in a.ms.split(",")):
                if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
                    log(f"  M={m} K={k} N={n}: skipped (time budget {a.budget_s:g} s spent)")
                    res.setdefault("skipped_cells", []).append({"m": m, "k": k, "n": n})
                    continue
                rows = matmul_bench.bench_shape(k, n, m, variants if m in variant_ms else [],
                                                iterations=a.iterations, with_torch=False, log=log)
                res["matmul"].append({"m": m, "k": k, "n": n, "rows": rows})
    if "dequant" not in skip:
        res["dequant"] = matmul_bench.dequant_throughput()
        log(f"dequant: {res['dequant']}")
    if "memory" not in skip:
        res["memory"] = _memory_runs(log)
    if res["matmul"] and not a.no_torch:  # last, and in another process (see torch_bench.py)
        cells = ",".join(f"{c['m']}x{c['k']}x{c['n']}" for c in res["matmul"])
        r = subprocess.run([sys.executable, "-m", "benchmarks.torch_bench", "--cells", cells,
                            "--iterations", str(a.iterations)], capture_output=True, text=True)
        log(r.stderr[-2000:])
        try:
            torch_res = json.loads((r.stdout.strip().splitlines() or ["{}"])[-1])
        except json.JSONDecodeError:
            torch_res = {}
        for c in res["matmul"]:
            c["rows"].update(torch_res.get(f"{c['m']}x{c['k']}x{c['n']}", {}))
    write_results(res, a.out, a.tag, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
