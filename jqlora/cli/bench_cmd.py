"""`jqlora bench`: the GPU benchmark (benchmarks.run), which lives in the repository, not in the package."""
from __future__ import annotations

import sys

HELP = "GPU benchmark of the dequant-matmul kernels (benchmarks/run.py); GPU only, from a checkout"
DESCRIPTION = """\
Runs benchmarks.run.main with the remaining arguments (see `python -m benchmarks.run --help`:
--ms, --shapes, --iterations, --skip, --out, --tag ...). Results go to benchmarks/results/.
Needs a GPU visible to JAX: on a CPU-only machine it prints a message and exits with status 2.
The benchmarks/ package is part of the repository, not of the installed jqlora package: run
from the root of a checkout (or there: `make bench` or `python -m benchmarks.run ...`)."""

ACCEPTS_EXTRA = True

NOT_INSTALLED = ("the benchmark is not part of the installed jqlora package; from a checkout of the jqlora "
                 "repository run `make bench` or `python -m benchmarks.run ...` in its root")


def add_arguments(p):
    p.add_argument("bench_args", nargs="*", metavar="ARG",
                   help="arguments passed to benchmarks.run (put them after --, e.g. jqlora bench -- --ms 1,16)")


def _bench_main():
    """`benchmarks.run.main`, or None where the benchmark is not importable (an installed package:
    the benchmarks/ folder ships only with a checkout of the repository)."""
    try:
        from benchmarks import run as bench_run
    except ImportError:
        return None
    return bench_run.main


def run(args) -> int:
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        print(f"jqlora bench: no GPU found (JAX backend: {backend}); the benchmark measures GPU kernels only. "
              "Run it on a GPU machine.", file=sys.stderr)
        return 2
    bench_main = _bench_main()
    if bench_main is None:
        print(f"jqlora bench: {NOT_INSTALLED}", file=sys.stderr)
        return 2
    argv = list(args.bench_args) + list(getattr(args, "extra", []) or [])
    return int(bench_main(argv) or 0)
