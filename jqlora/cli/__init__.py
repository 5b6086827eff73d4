"""The `jqlora` command line: `jqlora <command> --help` explains each command.

Commands (one module each; jax, torch, transformers and the models load only when a command runs,
so `jqlora --help` and `jqlora <command> --help` answer without them):

  inspect         what a bitsandbytes checkpoint holds: per tensor format, shapes, bytes; totals
  train           LoRA fine-tuning of a (quantized) checkpoint from a JSON/TOML config and/or flags
  generate        text generation with an optional PEFT adapter
  export-peft     a training checkpoint -> a PEFT adapter directory
  import-peft     check a PEFT adapter against a model (modules matched, shapes, effect on logits)
  export-merged   a training run or PEFT adapter merged into its base model: a bf16/float32 or NF4 folder
  export-gguf     a training run or PEFT adapter merged into its base model: one GGUF file for llama.cpp
  crosscheck      JAX vs transformers+bitsandbytes(+PEFT) in torch: per-layer and logits errors
  explain-kernel  which kernel variants a quantized product runs (forward, backward), and why
  bench           the GPU benchmark (benchmarks/run.py); GPU only, from a checkout of the repository
  demo            the end-to-end demo (`make demo`): build, quantize, fine-tune, export, cross-check

Defaults pick the fastest correct path on the machine (train, generate): bf16 compute, cuDNN
attention and the Pallas kernels on a GPU; float32, einsum attention and the jnp reference on a
CPU; remat chosen by memory. Compiled programs are kept in a persistent cache (default
$XDG_CACHE_HOME/jqlora/xla, else ~/.cache/jqlora/xla; JQLORA_COMPILE_CACHE=DIR chooses it,
JQLORA_COMPILE_CACHE=0 or --no-compile-cache turns it off), so a second run of the same shapes
skips compilation.

Exit status: 0 ok, 1 internal error (traceback), 2 bad input or failed check (one-line message),
130 interrupted (Ctrl-C; a compilation under way finishes first: XLA cannot stop it), 141
standard output closed early (`jqlora inspect ... --json | head -1`; nothing printed).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import socket
import sys
import threading
import traceback

from jqlora.cli._common import HelpFormatter, add_quantize_experts, expected_errors, message

# command name -> module (relative to jqlora.cli)
COMMANDS = {
    "inspect": "inspect_cmd",
    "train": "train_cmd",
    "generate": "generate_cmd",
    "export-peft": "peft_cmd:export",
    "import-peft": "peft_cmd:import_",
    "export-merged": "merge_cmd",
    "export-gguf": "gguf_cmd",
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


_NO_CACHE_HELP = ("do not use the persistent compilation cache (also: JQLORA_COMPILE_CACHE=0; "
                  "JQLORA_COMPILE_CACHE=DIR chooses its directory)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Every command is listed; `only` names the one command whose options
    are added (None: all of them). Adding a command's options may import what it needs to
    describe them (`train` reads the TrainConfig fields), so `main` adds only the command run."""
    p = argparse.ArgumentParser(
        prog="jqlora", description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    from jqlora import __version__

    p.add_argument("--version", action="version", version=f"jqlora {__version__}")
    p.add_argument("--no-compile-cache", dest="no_compile_cache", action="store_true", help=_NO_CACHE_HELP)
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        cmd = _command(name)
        sp = sub.add_parser(name, help=cmd.HELP, description=cmd.DESCRIPTION, formatter_class=HelpFormatter)
        if only is None or only == name:
            cmd.add_arguments(sp)
            if hasattr(cmd, "QUANTIZE_EXPERTS"):  # the commands that load a model to compute with
                add_quantize_experts(sp, cmd.QUANTIZE_EXPERTS)
            sp.add_argument("--no-compile-cache", dest="no_compile_cache", action="store_true",
                            default=argparse.SUPPRESS, help=_NO_CACHE_HELP)
        sp.set_defaults(_cmd=cmd, _name=name)
    return p


def _command_in(argv: list[str]) -> str:
    """The command `argv` runs: its first word that is not an option ("" when there is none).
    The top-level options (--help, --version, --no-compile-cache) take no value."""
    return next((a for a in argv if not a.startswith("-")), "")


def _enable_compile_cache(disabled: bool) -> None:
    """Turn on the persistent compilation cache before the command compiles anything; a cache
    directory that cannot be created is a warning, not an error (the command runs uncached)."""
    from jqlora import compile_cache

    path = compile_cache.cli_dir(disabled=disabled)
    if path is None:
        return
    try:
        compile_cache.enable(path)
    except ValueError as e:
        print(f"jqlora: warning: {message(e)}; running without the compilation cache", file=sys.stderr)


@contextlib.contextmanager
def _interrupt_notice(command: str):
    """Say at once that Ctrl-C was seen. Python raises KeyboardInterrupt only when the main
    thread runs Python again, and an XLA compilation (or any long native call) holds it until it
    returns; a thread woken by the signal (`signal.set_wakeup_fd`) prints that the command stops
    once the running native work ends. Only in the main thread of a process (not under a test
    runner's own handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        reader.close(), writer.close()
        yield
        return

    def watch():
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data:
                print(f"jqlora {command}: interrupt received; stopping once the running step or "
                      "compilation returns (XLA cannot stop it midway)", file=sys.stderr, flush=True)
                return

    unraisable = sys.unraisablehook

    def raise_again(u):
        # a KeyboardInterrupt that lands where Python ignores exceptions (a finalizer, a callback:
        # "Exception ignored in ...") would let the command run on: signal it again, so that it is
        # raised where the main thread next runs Python
        if isinstance(u.exc_value, KeyboardInterrupt):
            main_id = threading.main_thread().ident
            threading.Timer(0.01, signal.pthread_kill, (main_id, signal.SIGINT)).start()
            return
        unraisable(u)

    watcher = threading.Thread(target=watch, name="jqlora-interrupt-notice", daemon=True)
    watcher.start()
    sys.unraisablehook = raise_again
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        signal.set_wakeup_fd(previous)
        writer.close()
        reader.close()


def _exit_interrupted(real_process: bool) -> int:
    """Status 130 for an interrupted command. In a process of its own the CLI ends without the
    interpreter's shutdown: an XLA thread still running (a compilation, a cache write) can crash
    it (a segfault instead of status 130). Every file was closed or rolled back on the way here."""
    if real_process:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(130)
    return 130


def main(argv=None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to sys.exit)."""
    real_process = argv is None
    try:
        return _main(argv, real_process)
    except KeyboardInterrupt:  # before the command started (parsing, imports)
        print("jqlora: interrupted", file=sys.stderr)
        return _exit_interrupted(real_process)


def _main(argv, real_process: bool) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_command_in(argv))
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
    from jqlora._util import raise_host_offload_limit

    raise_host_offload_limit()  # before the GPU client starts: offloaded activations past 64 GB
    _enable_compile_cache(disabled=args.no_compile_cache)
    try:
        with _interrupt_notice(args.command):
            rc = args._cmd.run(args)
        sys.stdout.flush()  # a reader that went away (`| head -1`) shows up here for buffered output
        return int(rc or 0)
    except BrokenPipeError:
        # The standard recipe (Python docs, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit quietly, as a tool killed by
        # SIGPIPE does (128 + 13).
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (captured in-process): nothing to flush
            pass
        return 141
    except KeyboardInterrupt:
        print(f"jqlora {args.command}: interrupted", file=sys.stderr)
        return _exit_interrupted(real_process)
    except expected_errors() as e:
        print(f"jqlora {args.command}: error: {message(e)}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - a bug: show the traceback
        traceback.print_exc()
        return 1


__all__ = ["main", "build_parser", "COMMANDS"]
