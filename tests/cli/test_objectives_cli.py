"""`jqlora train --objective dpo | grpo` on a tiny bitsandbytes NF4 Llama with the demo's char
tokenizer: runs that finish and write their metrics, and bad input (pairs, prompts, reward
functions that cannot be loaded, raise, or return NaN / the wrong count) that ends with exit
status 2 and one line naming the row or the function."""
from __future__ import annotations

import csv
import json
import math
import shutil

import pytest

from cli_runner import run_cli

pytestmark = pytest.mark.torch

REWARDS = '''
def letters_right(prompts, completions, answer, **kw):
    return [sum(a == b for a, b in zip(c, t)) / len(t) for c, t in zip(completions, answer)]

def boom(prompts, completions, **kw):
    raise RuntimeError("no score today")

def not_a_number(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def too_few(prompts, completions, **kw):
    return [1.0]
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint_factory = pytest.importorskip("checkpoint_factory")
    from jqlora.demo import task

    src = checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4",
                                                     config_overrides={"initializer_range": 0.1})
    root = tmp_path_factory.mktemp("objectives")
    ckpt = root / "nf4"
    shutil.copytree(src, ckpt)
    task.save_tokenizer(ckpt)
    pairs = [{"prompt": f"{w}=", "chosen": w[::-1], "rejected": w} for w in ("abc", "hello", "xyz", "qwerty")]
    write_jsonl(root / "pairs.jsonl", pairs)
    prompts = [{"prompt": f"{w}=", "answer": w[::-1]} for w in ("abc", "hello", "xyz", "qwerty")]
    write_jsonl(root / "prompts.jsonl", prompts)
    (root / "rewards.py").write_text(REWARDS)
    return root


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _common(root, out):
    return ["--model", root / "nf4", "--compute-dtype", "float32", "--rank", "4", "--alpha", "8",
            "--target-modules", "q_proj,v_proj", "--batch-size", "2", "--steps", "2", "--lr", "0.01",
            "--out-dir", out, "--log-every", "1", "--save-every", "0", "--no-tensorboard"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_dpo_from_the_command_line(setup, tmp_path, capsys):
    out = tmp_path / "dpo"
    rc, stdout, err = run_cli(capsys, "train", *_common(setup, out), "--objective", "dpo",
                              "--data-path", setup / "pairs.jsonl", "--eval-data-path", setup / "pairs.jsonl",
                              "--eval-every", "2", "--seq-len", "16", "--dpo-beta", "0.5")
    assert rc == 0, err
    rows = _rows(out / "loss.csv")
    assert [r["step"] for r in rows] == ["1", "2"]
    # policy == reference at step 1 (the two passes may differ in the last bit: see docs/training.md)
    assert float(rows[0]["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert key in rows[0]
    assert abs(float(rows[0]["rewards/margins"])) < 1e-5
    ev = _rows(out / "eval.csv")
    assert ev[0]["step"] == "2" and "rewards/accuracies" in ev[0]
    assert (out / "adapter" / "adapter_config.json").is_file()
    record = json.loads((out / "jqlora_run.json").read_text())
    assert record["train"]["objective"] == "dpo" and record["train"]["dpo_beta"] == 0.5


def test_grpo_from_the_command_line(setup, tmp_path, capsys):
    out = tmp_path / "grpo"
    rc, stdout, err = run_cli(capsys, "train", *_common(setup, out), "--objective", "grpo",
                              "--data-path", setup / "prompts.jsonl", "--seq-len", "16",
                              "--reward", f"{setup / 'rewards.py'}:letters_right",
                              "--reward", f"{setup / 'rewards.py'}:letters_right", "--reward-weights", "1,0.5",
                              "--num-generations", "2", "--max-completion-length", "6", "--grpo-beta", "0.04")
    assert rc == 0, err
    rows = _rows(out / "loss.csv")
    assert len(rows) == 2
    for key in ("reward", "reward_std", "rewards/letters_right/mean", "kl", "clip_ratio/region_mean",
                "completions/mean_length", "rollout_tokens_per_s"):
        assert key in rows[0], key
    r = float(rows[0]["rewards/letters_right/mean"])
    assert float(rows[0]["rewards/letters_right_2/mean"]) == r  # the same function twice: two metrics
    assert float(rows[0]["reward"]) == pytest.approx(1.5 * r, rel=1e-5)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "jqlora_run.json").read_text())["train"]["reward"] == [
        f"{setup / 'rewards.py'}:letters_right"] * 2


@pytest.mark.parametrize("fn, says", [("boom", "raised RuntimeError: no score today"),
                                      ("not_a_number", "returned nan for completion 1"),
                                      ("too_few", "returned 1 values for 4 completions"),
                                      ("missing", "has no function 'missing'")])
def test_grpo_bad_reward_function_exits_2_naming_it(setup, tmp_path, capsys, fn, says):
    spec = f"{setup / 'rewards.py'}:{fn}"
    rc, _, err = run_cli(capsys, "train", *_common(setup, tmp_path / "g"), "--objective", "grpo",
                         "--data-path", setup / "prompts.jsonl", "--seq-len", "16", "--reward", spec,
                         "--num-generations", "2", "--max-completion-length", "4", "--steps", "1")
    assert rc == 2
    assert spec in err and says in err
    assert "Traceback" not in err


def test_bad_pairs_and_settings_exit_2(setup, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ab=", "chosen": "ba", "rejected": "ab"},
                                                    {"prompt": "ab=", "chosen": "ba"}])
    rc, _, err = run_cli(capsys, "train", *_common(setup, tmp_path / "d"), "--objective", "dpo",
                         "--data-path", bad)
    assert rc == 2 and f"{bad}, line 2" in err and "'rejected'" in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, "train", *_common(setup, tmp_path / "d"), "--objective", "grpo",
                         "--data-path", setup / "prompts.jsonl")
    assert rc == 2 and "reward" in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, "train", *_common(setup, tmp_path / "d"), "--objective", "grpo",
                         "--data-path", setup / "prompts.jsonl", "--reward", "no_such_module_xyz:f")
    assert rc == 2 and "no_such_module_xyz" in err and "Traceback" not in err
