"""`jqlora bench`: the GPU benchmark (benchmarks/run.py)."""
from __future__ import annotations

import sys

HELP = "GPU benchmark of the dequant-matmul kernels (benchmarks/run.py); GPU only"
DESCRIPTION = """\
Runs benchmarks.run.main with the remaining arguments (see `python -m benchmarks.run --help`:
--ms, --shapes, --iterations, --skip, --out, --tag ...). Results go to benchmarks/results/.
Needs a GPU visible to JAX: on a CPU-only machine it prints a message and exits with status 2.
The benchmarks/ package is not installed with jqlora: run from the repository root."""

ACCEPTS_EXTRA = True


def add_arguments(p):
    p.add_argument("bench_args", nargs="*", metavar="ARG",
                   help="arguments passed to benchmarks.run (put them after --, e.g. jqlora bench -- --ms 1,16)")


def run(args) -> int:
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        print(f"jqlora bench: no GPU found (JAX backend: {backend}); the benchmark measures GPU kernels only. "
              "Run it on a GPU machine.", file=sys.stderr)
        return 2
    try:
        from benchmarks import run as bench_run
    except ImportError as e:
        print(f"jqlora bench: cannot import benchmarks.run ({e}); run from the repository root", file=sys.stderr)
        return 2
    argv = list(args.bench_args) + list(getattr(args, "extra", []) or [])
    return int(bench_run.main(argv) or 0)
