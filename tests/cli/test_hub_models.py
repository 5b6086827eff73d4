"""Models named as people name them: a Hugging Face id `org/name[@revision]` found in the cache
(HF_HOME / HF_HUB_CACHE, offline), a cache repo folder (`models--org--name`), and the one-line
error with the download command for an id that is not there. The cache is built here in the
standard layout (refs/<name> holding a commit, snapshots/<commit>/<files>) around a tiny model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import run_cli
from jqlora import hub

CFG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
MAIN, V1 = "a" * 40, "b" * 40  # two commits of the repo: refs/main and the tag refs/v1


def tiny_model(path: Path, seed: int) -> Path:
    """A tiny plain Llama checkpoint with the demo's character tokenizer (no torch needed)."""
    import interop
    from jqlora.demo import task
    from jqlora.models import init_params

    interop.save_bnb_checkpoint(path, init_params(CFG, seed=seed, std=0.1), CFG)
    task.save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME with hub/models--jq-test--tiny: main and v1 two different models."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--jq-test--tiny"
    for commit, ref, seed in ((MAIN, "main", 0), (V1, "v1", 1)):
        tiny_model(repo / "snapshots" / commit, seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return home


def _jqlora(args, hf_env, cwd=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(hf_env, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "jqlora.cli", "--no-compile-cache", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_resolve_model_folders_cache_repos_and_ids(hf_home, tmp_path, monkeypatch):
    repo = hf_home / "hub" / "models--jq-test--tiny"
    assert hub.resolve_model(repo) == repo / "snapshots" / MAIN  # the repo folder: refs/main's snapshot
    assert hub.resolve_model(repo / "snapshots" / V1) == repo / "snapshots" / V1  # a folder is itself
    plain = tiny_model(tmp_path / "jq-test" / "tiny", 2)  # a local folder named like an id wins
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("jq-test/tiny") == Path("jq-test/tiny")
    # one snapshot and no refs: that snapshot; several and no ref naming one: an error saying so
    lone = tmp_path / "models--x--y"
    shutil.copytree(plain, lone / "snapshots" / "c1")
    assert hub.resolve_model(lone) == lone / "snapshots" / "c1"
    shutil.copytree(plain, lone / "snapshots" / "c2")
    with pytest.raises(hub.ModelNotFoundError, match="refs/main names no snapshot"):
        hub.resolve_model(lone)
    assert hub.parse_model_id("org/name@v1.2") == ("org/name", "v1.2")
    assert hub.parse_model_id("runs/x/y") is None and hub.parse_model_id("/abs/path") is None


def test_hf_home_and_offline_are_respected(hf_home):
    """A fresh process reads HF_HOME (and HF_HUB_OFFLINE) as huggingface_hub does."""
    r = _jqlora(["inspect", "jq-test/tiny", "--json"], {"HF_HOME": str(hf_home)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(hf_home / "hub" / "models--jq-test--tiny" / "snapshots" / MAIN)


def test_generate_and_train_take_a_cached_model_id_offline(hf_home, tmp_path, monkeypatch, capsys):
    """`jqlora generate org/name` and `jqlora train --model org/name@rev`, offline, in-process:
    huggingface_hub's cache and offline settings set as HF_HUB_CACHE / HF_HUB_OFFLINE set them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = hf_home / "hub" / "models--jq-test--tiny"
    gen = ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    rc, out, err = run_cli(capsys, "generate", "jq-test/tiny", *gen)
    assert rc == 0, err
    assert len(json.loads(out)["ids"]) <= 4  # new tokens, up to an EOS

    from jqlora.demo import task

    data = task.write_jsonl(tmp_path / "train.jsonl", task.make_split(8, 0, seed=1).train)
    rc, _, err = run_cli(capsys, "train", "--model", "jq-test/tiny@v1", "--data-path", data, "--steps", "1",
                         "--seq-len", "16", "--batch-size", "1", "--rank", "2", "--out-dir", tmp_path / "run",
                         "--compute-dtype", "float32", "--no-tensorboard")
    assert rc == 0, err
    record = json.loads((tmp_path / "run" / "jqlora_run.json").read_text())
    assert record["model"] == str((repo / "snapshots" / V1).resolve())


def test_an_id_not_in_the_cache_offline_is_one_line_with_the_download_command(hf_home, tmp_path):
    r = _jqlora(["generate", "jq-test/absent@v2", "--prompt-ids", "1"], {"HF_HUB_CACHE": str(hf_home / "hub")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "hf download jq-test/absent --revision v2" in lines[0] and "HF_HUB_OFFLINE" in lines[0], lines[0]
    assert "huggingface-cli download jq-test/absent" in lines[0]


def test_cache_repo_folder_and_missing_paths_through_the_cli(hf_home, tmp_path, capsys):
    repo = hf_home / "hub" / "models--jq-test--tiny"
    rc, out, err = run_cli(capsys, "inspect", repo, "--json")
    assert rc == 0, err
    assert json.loads(out)["path"] == str(repo / "snapshots" / MAIN)
    rc, _, err = run_cli(capsys, "train", "--model", tmp_path / "nowhere", "--data-path", tmp_path / "x.jsonl")
    assert rc == 2 and "no such model folder" in err and "Traceback" not in err
