"""The command line's defaults: start-up without jax or torch for --help, the persistent compilation
cache on by default (and off when asked), `auto` attention and remat, and the product-path
benchmark's own bookkeeping (benchmarks/product_bench.py; its end-to-end run is the slow test)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jqlora import compile_cache
from jqlora._util import resolve_attention
from jqlora.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
# jqlora.train itself is light (its names load lazily; TrainConfig lives in jqlora.train.config):
# the training modules that pull jax in are named one by one
HEAVY = ("jax", "jaxlib", "torch", "transformers", "flax", "optax", "jqlora.train.loop", "jqlora.train.step",
         "jqlora.train.data", "jqlora.models")


def _env(**extra):
    """The environment of a child process: this one's, without the tests' cache opt-out."""
    env = {k: v for k, v in os.environ.items() if k not in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
    return env


def _heavy_after_help(argvs) -> dict:
    """{argv: heavy modules imported} after `jqlora <argv>` (each a --help) in one fresh process."""
    script = f"""
import contextlib, io, json, sys
from jqlora.cli import main
out = {{}}
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    assert rc == 0, (argv, rc)
    out[" ".join(argv)] = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_help_imports_neither_jax_nor_torch():
    """`jqlora --help` and `jqlora <command> --help` build only what they print: no jax, torch,
    transformers, flax or training modules (they took about 0.8 s of every --help before)."""
    argvs = [["--help"]] + [[c, "--help"] for c in COMMANDS]
    heavy = _heavy_after_help(argvs)
    assert set(heavy) == {" ".join(a) for a in argvs}
    assert all(not mods for mods in heavy.values()), heavy


def test_generate_and_train_import_neither_torch_nor_transformers(tmp_path):
    """`jqlora generate` and `jqlora train` on a bitsandbytes-format checkpoint run on jax alone:
    importing transformers took 3 s of every warm start on the GPU machine."""
    script = f"""
import json, sys
import interop, jax.numpy as jnp
from pathlib import Path
from jqlora.cli import main
from jqlora.demo import task
from jqlora.models import init_params
config = {{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "vocab_size": task.MODEL_VOCAB_SIZE}}
ckpt = Path({str(tmp_path)!r}) / "ckpt"
interop.save_bnb_checkpoint(ckpt, init_params(config), config)
task.save_tokenizer(ckpt)
(ckpt.parent / "d.jsonl").write_text('{{"text": "abcabc"}}\\n' * 8)
rcs = [main(["generate", str(ckpt), "--prompt-ids", "5,6", "--max-new-tokens", "2"]),
       main(["train", "--model", str(ckpt), "--data-path", str(ckpt.parent / "d.jsonl"), "--seq-len", "16",
             "--batch-size", "1", "--steps", "1", "--quantize", "nf4", "--out-dir", str(ckpt.parent / "run")])]
print(json.dumps([rcs, sorted(m for m in ("torch", "transformers", "bitsandbytes", "peft") if m in sys.modules)]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=_env(JQLORA_COMPILE_CACHE="0"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[0, 0], []]


def test_no_compile_cache_flag_before_or_after_the_command():
    for argv in (["--no-compile-cache", "generate", "m", "--prompt-ids", "1"],
                 ["generate", "m", "--prompt-ids", "1", "--no-compile-cache"]):
        args, extra = build_parser(only="generate").parse_known_args(argv)
        assert args.no_compile_cache is True and not extra, argv
    args, _ = build_parser(only="generate").parse_known_args(["generate", "m", "--prompt-ids", "1"])
    assert args.no_compile_cache is False


def test_cli_cache_dir_from_the_environment(tmp_path):
    home = {"HOME": str(tmp_path / "home")}
    assert compile_cache.cli_dir(home) == tmp_path / "home" / ".cache" / "jqlora" / "xla"
    xdg = dict(home, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert compile_cache.cli_dir(xdg) == tmp_path / "xdg" / "jqlora" / "xla"
    for off in ("0", "off", "false", "no", "OFF"):
        assert compile_cache.cli_dir(dict(xdg, JQLORA_COMPILE_CACHE=off)) is None, off
    assert compile_cache.cli_dir(dict(xdg, JQLORA_COMPILE_CACHE="1")) == tmp_path / "xdg" / "jqlora" / "xla"
    assert compile_cache.cli_dir(dict(xdg, JQLORA_COMPILE_CACHE=str(tmp_path / "c"))) == tmp_path / "c"
    assert compile_cache.cli_dir(dict(xdg, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "j"))) == tmp_path / "j"
    assert compile_cache.cli_dir(xdg, disabled=True) is None


_CACHE_CHILD = """
import json, sys
import jax, jax.numpy as jnp
from jqlora.cli import main
events = []
jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
rc = main(sys.argv[1:])
jax.jit(lambda x: jnp.tanh(x) @ x.T + 3.0)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"rc": rc, "dir": jax.config.jax_compilation_cache_dir,
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""
_EXPLAIN = ["explain-kernel", "--weight", "nf4", "--m", "1", "--n", "64", "--k", "64", "--device", "cpu"]


def _cache_child(argv, **env) -> dict:
    r = subprocess.run([sys.executable, "-c", _CACHE_CHILD, *argv], capture_output=True, text=True,
                       env=_env(**env), timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_compile_cache_on_by_default_second_process_hits(tmp_path):
    """A command turns the cache on in $XDG_CACHE_HOME/jqlora/xla before anything compiles: the
    first process compiles and writes entries, a second process running the same program loads
    them (JAX's cache_hits events) and compiles nothing."""
    xdg = tmp_path / "xdg"
    first = _cache_child(_EXPLAIN, XDG_CACHE_HOME=str(xdg))
    cache = xdg / "jqlora" / "xla"
    assert first["rc"] == 0 and first["dir"] == str(cache)
    assert first["misses"] >= 1 and first["hits"] == 0
    files = sorted(p.name for p in cache.iterdir())
    assert files, "nothing was written to the cache"
    second = _cache_child(_EXPLAIN, XDG_CACHE_HOME=str(xdg))
    assert second["hits"] >= 1 and second["misses"] == 0, second
    assert sorted(p.name for p in cache.iterdir()) == files


def test_compile_cache_opt_outs_leave_the_directory_alone(tmp_path):
    """JQLORA_COMPILE_CACHE=0 and --no-compile-cache: no cache directory, no cache in use;
    JQLORA_COMPILE_CACHE=DIR: that directory."""
    xdg = tmp_path / "xdg"
    off_env = _cache_child(_EXPLAIN, XDG_CACHE_HOME=str(xdg), JQLORA_COMPILE_CACHE="0")
    off_flag = _cache_child(_EXPLAIN + ["--no-compile-cache"], XDG_CACHE_HOME=str(xdg))
    for res in (off_env, off_flag):
        assert res["rc"] == 0 and res["dir"] is None and res["hits"] == 0, res
    assert not xdg.exists()
    chosen = _cache_child(_EXPLAIN, XDG_CACHE_HOME=str(xdg), JQLORA_COMPILE_CACHE=str(tmp_path / "mine"))
    assert chosen["dir"] == str(tmp_path / "mine") and any((tmp_path / "mine").iterdir())
    assert not xdg.exists()


def test_compile_cache_dir_that_cannot_be_created_is_a_warning(tmp_path, capsys, monkeypatch):
    """enable() names the directory; the CLI warns in one line and runs the command uncached."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=str(blocker)):
        compile_cache.enable(blocker / "xla")
    monkeypatch.setenv(compile_cache.ENV, str(blocker / "xla"))
    assert main(_EXPLAIN) == 0
    err = capsys.readouterr().err
    assert "warning" in err and str(blocker / "xla") in err and len(err.strip().splitlines()) == 1


def test_auto_attention_resolves_by_device_and_dtype(monkeypatch):
    """auto: einsum off a GPU (this machine), cuDNN on a GPU with cuDNN attention and bf16/fp16
    compute, einsum on a GPU for float32 or without cuDNN; explicit names pass through."""
    import jax

    from jqlora import _util

    assert resolve_attention("auto", "bfloat16")[0] == "einsum"  # CPU
    for name in ("einsum", "xla", "cudnn"):
        assert resolve_attention(name, "float32") == (name, "requested")
    with pytest.raises(ValueError, match="flash"):
        resolve_attention("flash", "bfloat16")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_util, "cudnn_attention_available", lambda: True)
    assert resolve_attention("auto", "bfloat16")[0] == "cudnn"
    assert resolve_attention("auto", "float16")[0] == "cudnn"
    assert resolve_attention("auto", "float32")[0] == "einsum"
    monkeypatch.setattr(_util, "cudnn_attention_available", lambda: False)
    assert resolve_attention("auto", "bfloat16")[0] == "einsum"


def test_train_defaults_are_auto_and_flags_override(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    from jqlora.demo import task

    task.save_tokenizer(model)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "abc"}\n')
    base = ["train", "--model", str(model), "--data-path", str(data), "--dry-run"]
    assert main(base) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["attention"] == "auto" and rec["train"]["remat"] == "auto"
    assert main(base + ["--attention", "cudnn", "--remat", "false"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["attention"] == "cudnn" and rec["train"]["remat"] is False


def test_generate_help_says_what_auto_is(capsys):
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "auto = cudnn" in out and "--timing" in out and "--no-compile-cache" in out


# ----------------------------------------------------------------------- benchmarks/product_bench
def test_product_bench_reads_the_cli_outputs(tmp_path):
    """The parent's bookkeeping: a child's MARK line and `timing:` line are parsed, the steady
    rate is the median after step 2, a failing child is recorded as failed."""
    from benchmarks import product_bench as pb

    child = ("import sys, json; print('attention: einsum (auto)', file=sys.stderr); "
             "print('timing: ' + json.dumps({'load_s': 1.5, 'new_tokens': 4}), file=sys.stderr); "
             f"print({pb.MARK!r} + json.dumps({{'rc': 0, 'peak_bytes': 2**30}}), file=sys.stderr)")
    rec = pb.run_part("x", [sys.executable, "-c", child], 60, dict(os.environ))
    assert rec["status"] == "ok" and rec["peak_bytes"] == 2**30 and rec["load_s"] == 1.5
    assert rec["logged"] == ["attention: einsum (auto)"]
    bad = pb.run_part("y", [sys.executable, "-c", "raise SystemExit(3)"], 60, dict(os.environ))
    assert bad["status"] == "failed (exit 3)"
    path = tmp_path / "loss.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "lr", "tokens_per_s"])
        for step, rate in enumerate([5.0, 50.0, 100.0, 300.0, 200.0], start=1):
            w.writerow([step, 1.0, 1e-4, rate])
    assert pb._steady(path) == 200.0
    # the 8B checkpoint part gets its own, longer limit; every other part keeps the shared one
    assert pb.part_limit("checkpoint", "8b") > pb.part_limit("checkpoint", "1b") == pb.LIMITS["checkpoint"]
    assert pb.part_limit("train", "8b") == pb.LIMITS["train"]


def test_product_bench_budget_skips_and_still_writes(tmp_path):
    from benchmarks import product_bench as pb

    res = pb.run("tiny", str(tmp_path), steps=2, new_tokens=2, budget_s=5, workdir=str(tmp_path),
                 skip=set(), log=lambda *a: None)
    assert [r["status"].split(" ")[0] for r in res["parts"]] == ["skipped"]
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == [f"cpu-{res['date']}_product_tiny.json", f"cpu-{res['date']}_product_tiny.md"]
    assert json.loads((tmp_path / files[0]).read_text())["parts"][0]["part"] == "checkpoint"


@pytest.mark.slow
def test_product_bench_tiny_end_to_end(tmp_path):
    """Every part on CPU at the tiny shape (about 2 minutes): checkpoint by transformers +
    bitsandbytes, `jqlora train` and `jqlora generate` cold and warm, torch training and generation,
    jqlora decode. The warm train reaches its first step sooner than the cold one."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.product_bench", "--shape", "tiny", "--out", str(tmp_path),
                        "--workdir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=400,
                       env=_env(XLA_FLAGS=""))  # one device, as on the one-GPU machine it is for
    found = list(tmp_path.glob("*_product_tiny.json"))
    assert found, r.stdout + r.stderr
    res = json.loads(found[0].read_text())
    parts = {p["part"].split(" (")[0] + " " + p["part"].split(" (")[1].split(" ")[0] if "cache)" in p["part"]
             else p["part"].split(" (")[0]: p for p in res["parts"]}
    assert all(p["status"] == "ok" for p in parts.values()), {k: (p["status"], p.get("stderr_tail"))
                                                             for k, p in parts.items() if p["status"] != "ok"}
    assert r.returncode == 0, r.stdout + r.stderr
    cold, warm = parts["jqlora train cold"], parts["jqlora train warm"]
    assert warm["first_step_s"] < cold["first_step_s"] and warm["cache_files"] > 0
    assert cold["steady_tokens_per_s"] > 0
    assert parts["jqlora generate warm"]["new_tokens"] == res["new_tokens"]
    assert parts["torch generate"]["new_tokens"] == res["new_tokens"]
