"""The `jqlora` command line: `jqlora <command> --help` explains each command.

Commands (one module each; torch, transformers and the models load only when a command runs):

  inspect         what a bitsandbytes checkpoint holds: per tensor format, shapes, bytes; totals
  train           LoRA fine-tuning of a (quantized) checkpoint from a JSON/TOML config and/or flags
  generate        text generation with an optional PEFT adapter
  export-peft     a training checkpoint -> a PEFT adapter directory
  import-peft     check a PEFT adapter against a model (modules matched, shapes, effect on logits)
  crosscheck      JAX vs transformers+bitsandbytes(+PEFT) in torch: per-layer and logits errors
  explain-kernel  which kernel variants a quantized product runs (forward, backward), and why
  bench           the GPU benchmark (benchmarks/run.py); GPU only, from a checkout of the repository
  demo            the end-to-end demo (`make demo`): build, quantize, fine-tune, export, cross-check

Exit status: 0 ok, 1 internal error (traceback), 2 bad input or failed check (one-line message).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from jqlora.cli._common import HelpFormatter, expected_errors, message

# command name -> module (relative to jqlora.cli)
COMMANDS = {
    "inspect": "inspect_cmd",
    "train": "train_cmd",
    "generate": "generate_cmd",
    "export-peft": "peft_cmd:export",
    "import-peft": "peft_cmd:import_",
    "crosscheck": "crosscheck_cmd",
    "explain-kernel": "explain_cmd",
    "bench": "bench_cmd",
    "demo": "demo_cmd",
}


def _command(name: str):
    """The object that defines a command: a module, or an attribute of one (`mod:attr`)."""
    spec = COMMANDS[name]
    mod, _, attr = spec.partition(":")
    m = importlib.import_module(f"jqlora.cli.{mod}")
    return getattr(m, attr) if attr else m


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jqlora", description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    from jqlora import __version__

    p.add_argument("--version", action="version", version=f"jqlora {__version__}")
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        cmd = _command(name)
        sp = sub.add_parser(name, help=cmd.HELP, description=cmd.DESCRIPTION, formatter_class=HelpFormatter)
        cmd.add_arguments(sp)
        sp.set_defaults(_cmd=cmd, _name=name)
    return p


def main(argv=None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse already printed
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args._cmd, "ACCEPTS_EXTRA", False):
        print(f"jqlora {args.command}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    if extra:
        args.extra = extra
    try:
        rc = args._cmd.run(args)
        return int(rc or 0)
    except KeyboardInterrupt:
        print(f"jqlora {args.command}: interrupted", file=sys.stderr)
        return 130
    except expected_errors() as e:
        print(f"jqlora {args.command}: error: {message(e)}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - a bug: show the traceback
        traceback.print_exc()
        return 1


__all__ = ["main", "build_parser", "COMMANDS"]
