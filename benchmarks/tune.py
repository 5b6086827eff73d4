"""One registry-driven config sweep for any matmul kernel variant.

    python -m benchmarks.tune --variant mgpu_mma_pair_table --ms 1,16 \
        --configs "default;default,tile_k=512;default,k_splits=2" [--shapes 4096:4096,4096:14336]
    python -m benchmarks.tune --variant mgpu_decoded_wgmma_t --bwd --ms 16,128 \
        --configs "default;default,tile_n=128" --against dequant_dot_t
    python -m benchmarks.tune --variant gemv_block_scaled --ms 1 \
        --configs "default;block_n=32|64,block_k=256|512" --against auto,xla --out gemv.json

A config text is `;`-separated. For a variant whose `config_type` is a dataclass, "default" is
`v.default_config(m, n, k, blocksize)`, "default,f=v" that config with fields replaced, and
"f=v,..." a config built from those fields alone; it is passed as `config=`. For a variant
without one, the `f=v` pairs are keyword arguments of `v.fn`: "f=v" alone (the kernel derives
the rest), "default,f=v" on top of the keywords `v.default_config` lists, "default" those.
`f=a|b|c` expands to one config per value (a grid: the product over every such field).

Each config is first checked against `v.reference` on one product (relative L2 error, `--tol`);
a config that fails the check, does not fit or does not compile is recorded with its error and
not timed. Timing is `benchmarks/timing.py`'s: device time per product over L2-defeating weight
copies with a distinct activation per product; every ratio is to `jnp.dot` bf16 of the same
shape in the same process (`x @ W.T`, or `dy @ W` with `--bwd`). `--against` adds other
variants at their defaults, `auto` (`qmatmul`'s plan, forward only) or `xla` (jnp dequant +
dot). Weights: NF4 blocksize 64 with double quant (4-bit ops) or LLM.int8-style int8 rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import sys
import time

FORWARD_OPS = ("matmul_4bit", "matmul_int8")
BACKWARD_OPS = ("matmul_4bit_t", "matmul_int8_t")
SHAPES = "4096:4096,4096:14336,14336:4096"


def parse_configs(text: str) -> list[str]:
    """`;`-separated config texts, each `f=a|b` field expanded into one text per value."""
    out = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        parts = [p.strip() for p in item.split(",") if p.strip()]
        choices = [[p] if "|" not in p else [f"{p.split('=', 1)[0]}={v}"
                                             for v in p.split("=", 1)[1].split("|")]
                   for p in parts]
        out.extend(",".join(c) for c in itertools.product(*choices))
    if not out:
        raise ValueError(f"--configs {text!r} names no config")
    return out


def _value(raw: str, like=None):
    """A field's text as the type of `like` (the default's value), else as a literal."""
    low = raw.lower()
    if isinstance(like, bool) or (like is None and low in ("true", "false")):
        if low not in ("0", "1", "true", "false"):
            raise ValueError(f"expected a bool (0/1/true/false), got {raw!r}")
        return low in ("1", "true")
    if like is None and low == "none":
        return None
    for cast in (int, float):
        if like is None or isinstance(like, cast):
            try:
                return cast(raw)
            except ValueError:
                if like is not None:
                    raise ValueError(f"expected {cast.__name__}, got {raw!r}") from None
    return raw


def _fields(text: str) -> tuple[bool, dict[str, str]]:
    """"default,a=1,b=x" -> (True, {"a": "1", "b": "x"})."""
    parts = [p for p in text.split(",") if p]
    from_default = bool(parts) and parts[0] == "default"
    fields = {}
    for p in parts[from_default:]:
        if "=" not in p:
            raise ValueError(f"config {text!r}: {p!r} is not field=value")
        key, raw = p.split("=", 1)
        fields[key.strip()] = raw.strip()
    return from_default, fields


def resolve_config(v, text: str, m: int, n: int, k: int, blocksize: int) -> dict:
    """The keyword arguments that run variant `v` with config `text` at (m, n, k).

    Args:
      v: a `pallas_kernels.registry.Variant` (uses `config_type`, `default_config`, `fn`).
      text: one config text ("default", "default,f=v,...", "f=v,...").
      m, n, k, blocksize: the product's shape and the 4-bit scale blocksize.

    Returns:
      `{"config": <config_type instance>}` for a dataclass config, else `{field: value}`.
    """
    from_default, fields = _fields(text)
    config_type = getattr(v, "config_type", None)
    default_config = getattr(v, "default_config", None)
    if config_type is None:
        params = inspect.signature(v.fn).parameters
        unknown = [f for f in fields if f not in params]
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            tunable = [p for p, par in params.items() if par.kind == par.KEYWORD_ONLY
                       and p not in ("blocksize", "out_dtype", "interpret", "nested")]
            raise ValueError(f"variant {v.name!r}: {unknown} are not keyword arguments of its "
                             f"function; it takes {tunable}")
        base = dict(default_config(m, n, k, blocksize)) if from_default and default_config else {}
        likes = {f: base.get(f, params[f].default if f in params else None) for f in fields}
        return {**base, **{f: _value(raw, None if likes[f] in (None, inspect.Parameter.empty)
                                     else likes[f]) for f, raw in fields.items()}}
    names = {f.name: f for f in dataclasses.fields(config_type)}
    unknown = [f for f in fields if f not in names]
    if unknown:
        raise ValueError(f"variant {v.name!r}: {unknown} are not fields of "
                         f"{config_type.__name__}; its fields: {sorted(names)}")
    if not from_default:
        likes = {f: names[f].default for f in fields}
        return {"config": config_type(**{f: _value(raw, None if likes[f] is dataclasses.MISSING
                                                    else likes[f])
                                         for f, raw in fields.items()})}
    # a field default_config also takes (e.g. tile_k) steers the other defaults: pass it there
    extra = {f: _value(raw) for f, raw in fields.items()
             if default_config is not None and f in inspect.signature(default_config).parameters}
    if default_config is None:
        raise ValueError(f"variant {v.name!r}: config {text!r} starts from its default, but it "
                         "has no default_config")
    base = default_config(m, n, k, blocksize, **extra)
    return {"config": dataclasses.replace(
        base, **{f: _value(raw, getattr(base, f)) for f, raw in fields.items()})}


def _weights(op: str, n: int, k: int, copies: int, quant_type: str, blocksize: int):
    """(dense bf16 weights, quantized weights) for `op`, `copies` of each."""
    import jax
    import jax.numpy as jnp

    from jqlora import quant

    dense = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02
             for i in range(copies)]
    if op.startswith("matmul_4bit"):
        return dense, [quant.quantize_4bit(w, quant_type, blocksize, True) for w in dense]
    return dense, [quant.quantize_int8(w) for w in dense]


def _caller(v, kw: dict, interpret: bool):
    """f(a, q) running variant `v` on activation a and quantized weight q (operands prepared
    inside, as `qmatmul` does: an XLA de-nest for a variant that does not de-nest itself)."""
    from jqlora.ops.products import kernel_operands_4bit, nested_kernel_operands_4bit

    extra = dict(kw, interpret=True) if interpret else kw
    if v.op.startswith("matmul_4bit"):
        def call(a, q):
            if v.accepts_nested:
                packed, codes, nested = nested_kernel_operands_4bit(q)
                return v.fn(a, packed, codes, q.code, blocksize=q.blocksize, nested=nested, **extra)
            packed, absmax = kernel_operands_4bit(q)
            return v.fn(a, packed, absmax, q.code, blocksize=q.blocksize, **extra)
        return call
    return lambda a, q: v.fn(a, q.cb, q.scb, **extra)


def _reference(v, kw: dict, a, q):
    """`v.reference` in float32 on one product; keyword arguments it also takes (numerics
    options such as exact_codes or lookup) are passed on."""
    import jax.numpy as jnp

    from jqlora.ops.products import kernel_operands_4bit

    params = inspect.signature(v.reference).parameters
    opts = {f: val for f, val in kw.items() if f in params}
    if v.op.startswith("matmul_4bit"):
        packed, absmax = kernel_operands_4bit(q)
        return v.reference(a, packed, absmax, q.code, blocksize=q.blocksize,
                           out_dtype=jnp.float32, **opts)
    return v.reference(a, q.cb, q.scb, out_dtype=jnp.float32, **opts)


def _against(name: str, op: str, interpret: bool):
    """f(a, q) for an --against entry: a registered variant at its defaults, auto or xla."""
    from jqlora import ops, quant
    from pallas_kernels import registry

    backward = op in BACKWARD_OPS
    if name == "xla":
        if backward:
            return lambda d, q: d @ quant.dequantize(q, d.dtype)
        return lambda a, q: ops.qmatmul(a, q, backend="xla")
    if name == "auto":
        if backward:
            raise ValueError("--against auto: forward only; name the backward variant instead")
        backend = "interpret" if interpret else "pallas"
        return lambda a, q: ops.qmatmul(a, q, backend=backend)
    other = registry.get(name)
    if other.op != op:
        raise ValueError(f"--against {name!r}: op {other.op!r}, but the tuned variant's is {op!r}")
    return _caller(other, {}, interpret)


def tune(v, configs, ms, shapes, *, against=(), quant_type="nf4", blocksize=64, iterations=10,
         tol=1e-2, budget_s=0.0, interpret=False, log=print) -> list[dict]:
    """One row per (shape, M): bf16 time, each config's check and time, the --against times.

    Args:
      v: the registry Variant to tune (op matmul_4bit[_t] or matmul_int8[_t]).
      configs: config texts (see `parse_configs`).
      ms, shapes: token counts and (K, N) pairs (K = in, N = out features).
      against: other contenders ("auto", "xla" or variant names).
      interpret: Pallas interpret mode, one weight copy (a CPU check of the whole path).
      budget_s: stop timing further configs of a cell after this many seconds (0: no limit).

    Returns:
      The rows, also logged as JSON lines.
    """
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import distinct_copies, l2_defeating_copies, us_per_product

    if v.op not in FORWARD_OPS + BACKWARD_OPS:
        raise ValueError(f"variant {v.name!r} has op {v.op!r}; tune times {FORWARD_OPS + BACKWARD_OPS}")
    if interpret and not v.interpret:
        raise ValueError(f"variant {v.name!r} has no interpret mode (platform {v.platform!r})")
    backward = v.op in BACKWARD_OPS
    rows = []
    for k, n in shapes:
        nbytes = n * k // 2 if v.op.startswith("matmul_4bit") else n * k
        copies = 1 if interpret else l2_defeating_copies(nbytes)
        dense_copies = 1 if interpret else l2_defeating_copies(n * k * 2)
        dense, qs = _weights(v.op, n, k, max(copies, dense_copies), quant_type, blocksize)
        qs = qs[:copies]
        for m in ms:
            a = jax.random.normal(jax.random.key(m), (m, n if backward else k), jnp.bfloat16)
            row = dict(variant=v.name, op=v.op, k=k, n=n, m=m, configs={}, against={})
            if not v.supports(m, n, k, blocksize):
                row["skipped"] = f"{v.name} does not support M={m} N={n} K={k} bs={blocksize}"
                log(json.dumps(row))
                rows.append(row)
                continue
            dot = (lambda d, w: d @ w) if backward else (lambda x, w: x @ w.T)
            row["bf16_us"] = us_per_product(lambda xs, ws: [dot(x, w) for x, w in zip(xs, ws)],
                                            (distinct_copies(a, dense_copies), dense[:dense_copies]),
                                            dense_copies, iterations)
            xs = distinct_copies(a, copies)
            t0 = time.time()
            for text in configs:
                rec = row["configs"][text] = {}
                if budget_s and time.time() - t0 > budget_s:
                    rec["skipped"] = "budget spent"
                    continue
                try:
                    kw = resolve_config(v, text, m, n, k, blocksize)
                    rec["resolved"] = repr(kw.get("config", kw))
                    call = _caller(v, kw, interpret)
                    got = jax.jit(call)(a, qs[0]).astype(jnp.float32)
                    want = _reference(v, kw, a.astype(jnp.float32), qs[0])
                    rec["rel_err"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                except Exception as e:  # noqa: BLE001 - a config that fails is a result
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    continue
                if not rec["rel_err"] <= tol:
                    rec["error"] = f"check failed: relative error {rec['rel_err']:.3g} > {tol}"
                    continue
                rec["us"] = us_per_product(lambda xs, qs, call=call: [call(x, q) for x, q in zip(xs, qs)],
                                           (xs, qs), copies, iterations)
            for name in against:
                call = _against(name, v.op, interpret)
                row["against"][name] = {"us": us_per_product(
                    lambda xs, qs, call=call: [call(x, q) for x, q in zip(xs, qs)], (xs, qs),
                    copies, iterations)}
            for rec in [*row["configs"].values(), *row["against"].values()]:
                if isinstance(rec.get("us"), float) and isinstance(row["bf16_us"], float):
                    rec["ratio"] = round(rec["us"] / row["bf16_us"], 3)
            log(json.dumps(row))
            rows.append(row)
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table: ratio to bf16 per (shape, M) and contender."""
    names = list(dict.fromkeys(name for r in rows for name in [*r["configs"], *r["against"]]))
    lines = ["| K x N | M | bf16 us | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for name in names:
            rec = r["configs"].get(name) or r["against"].get(name) or {}
            cells.append(f"{rec['ratio']:.3f}" if "ratio" in rec
                         else ("err" if "error" in rec or isinstance(rec.get("us"), str) else "-"))
        base = r.get("bf16_us")
        b = f"{base:.1f}" if isinstance(base, float) else "-"
        lines.append(f"| {r['k']}x{r['n']} | {r['m']} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--variant", required=True, help="registry variant name")
    ap.add_argument("--configs", default="default", help='e.g. "default;default,tile_k=512"')
    ap.add_argument("--ms", default="1,16,128", help="token counts, comma-separated")
    ap.add_argument("--shapes", default=SHAPES, help="K:N pairs (in:out), comma-separated")
    ap.add_argument("--bwd", action="store_true",
                    help="the variant is a backward product dx = dy @ W (required for *_t ops)")
    ap.add_argument("--against", default="", help="auto, xla or variant names, comma-separated")
    ap.add_argument("--quant-type", default="nf4", choices=("nf4", "fp4"))
    ap.add_argument("--blocksize", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-2, help="largest relative error accepted")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="per (shape, M): time no further configs after this many seconds")
    ap.add_argument("--interpret", action="store_true",
                    help="Pallas interpret mode, one weight copy: checks the path on CPU")
    ap.add_argument("--out", default=None, help="write the rows to this JSON file")
    a = ap.parse_args(argv)

    from pallas_kernels import registry

    v = registry.get(a.variant)
    if a.bwd != (v.op in BACKWARD_OPS):
        ap.error(f"variant {v.name!r} has op {v.op!r}: "
                 + ("pass --bwd" if v.op in BACKWARD_OPS else "--bwd is for *_t variants"))
    try:
        shapes = [tuple(int(s) for s in p.split(":")) for p in a.shapes.split(",") if p]
        ms = [int(s) for s in a.ms.split(",") if s]
        if any(len(s) != 2 for s in shapes):
            raise ValueError
    except ValueError:
        ap.error(f"--shapes {a.shapes!r} / --ms {a.ms!r}: expected K:N,... and M,...")
    rows = tune(v, parse_configs(a.configs), ms, shapes,
                against=[s for s in a.against.split(",") if s], quant_type=a.quant_type,
                blocksize=a.blocksize, iterations=a.iterations, tol=a.tol,
                budget_s=a.budget_s, interpret=a.interpret)
    print(summary(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
