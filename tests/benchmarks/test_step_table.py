"""benchmarks.step_table: the order of its parts, the budget, merging a later call into an earlier
table, and the table's ratios and targets (the child processes replaced by recorded lines)."""
import json

import pytest

from benchmarks import step_table as st


def _train_line(tps, piped, peak):
    return json.dumps({"tokens_per_s": tps, "pipelined_tokens_per_s": piped, "peak_gib": peak, "step_s": 1.0,
                       "pipelined_step_s": 1.0, "losses": [1.0]})


def _fake_runner(lines, calls):
    def run_part(name, cmd, limit, env, poll=None):
        calls.append((name, cmd, limit))
        if name not in lines:
            return {"part": name, "status": "failed (exit 1)", "wall_s": 1.0, "stderr_tail": "boom", "_stdout": ""}
        return {"part": name, "status": "ok", "wall_s": 1.0, "_stdout": "noise\n" + lines[name] + "\n"}
    return run_part


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(st, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(st, "measured_commit", lambda: "abc1234")
    monkeypatch.setattr(st, "package_versions", lambda: {"jax": "0.0"})


def test_parts_run_headline_first():
    assert st.part_names(["nf4", "bf16", "torch"], [2048, 4096], ["8b", "1b"]) == [
        "nf4:2048", "bf16:2048", "torch:2048", "decode:8b", "decode:1b", "nf4:4096", "bf16:4096", "torch:4096"]


def test_commands_are_the_benchmarks_with_cli_defaults():
    cmd = st.part_command("bf16:4096", "8b", 5)
    assert cmd[1:3] == ["-m", "benchmarks.train_bench"]
    joined = " ".join(cmd)
    assert "--weights bf16" in joined and "--seq 4096" in joined and "--remat auto" in joined
    assert "--attention cudnn" in joined
    dec = st.part_command("decode:1b", "8b", 5)
    assert dec[1:3] == ["-m", "benchmarks.profile.decode_profile"] and dec[-2:] == ["--child", "default"]


def test_table_ratios_targets_and_merge(h200, monkeypatch, tmp_path):
    lines = {"nf4:2048": _train_line(11_000.0, 12_000.0, 21.9), "bf16:2048": _train_line(13_000.0, 16_000.0, 30.0),
             "torch:2048": _train_line(2_600.0, 2_640.0, 12.8),
             "decode:8b": "decode_profile: " + json.dumps({"decode_tokens_per_s": 308.4, "gpu_us_per_token": 2956.6,
                                                           "wall_us_per_token_traced": 5185.7,
                                                           "kernels_per_token": 796.6})}
    calls = []
    monkeypatch.setattr(st, "run_part", _fake_runner(lines, calls))
    res = st.run("8b", [2048, 4096], ["nf4", "bf16", "torch"], ["8b"], 5, 10_000, str(tmp_path))
    status = {p["part"]: p["status"] for p in res["parts"]}
    assert status["nf4:2048"] == "ok" and status["nf4:4096"].startswith("failed")
    md = (tmp_path / "nvidia-h200-{}_step_table.md".format(res["date"])).read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| 2048 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "12,000 (11,000)"
    assert cells[5] == "0.75"            # NF4 / bf16, pipelined
    assert cells[8] == "4.55"            # NF4 / torch
    assert cells[9:] == ["15,000", "no"]  # the H200 target
    dec = next(ln for ln in md.splitlines() if ln.startswith("| 8b |"))
    assert "308.4" in dec and dec.rstrip().endswith("| 450 | no |")
    assert "Not measured: nf4:4096" in md

    # a later call fills in what failed and keeps what was measured
    first = json.loads((tmp_path / "nvidia-h200-{}_step_table.json".format(res["date"])).read_text())
    lines.update({f"{s}:4096": _train_line(14_000.0, 15_500.0, 37.0) for s in ("nf4", "bf16", "torch")})
    calls.clear()
    merged = st.run("8b", [2048, 4096], ["nf4", "bf16", "torch"], ["8b"], 5, 10_000, str(tmp_path), into=first)
    assert [c[0] for c in calls] == ["nf4:4096", "bf16:4096", "torch:4096"]
    assert all(p["status"] == "ok" for p in merged["parts"]) and len(merged["parts"]) == 7
    assert len(merged["commands"]) == 2
    md = (tmp_path / "nvidia-h200-{}_step_table.md".format(res["date"])).read_text()
    assert next(ln for ln in md.splitlines() if ln.startswith("| 4096 |")).rstrip().endswith("| 15,000 | yes |")


def test_budget_skips_what_does_not_fit(h200, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(st, "run_part", _fake_runner({}, calls))
    res = st.run("8b", [2048], ["nf4"], ["1b"], 5, 40, str(tmp_path))
    assert calls == [] and all(p["status"].startswith("skipped (budget") for p in res["parts"])


def test_into_refuses_another_device(h200, tmp_path):
    with pytest.raises(SystemExit, match="H100"):
        st.run("8b", [2048], ["nf4"], [], 5, 100, str(tmp_path), into={"device": "NVIDIA H100 80GB HBM3",
                                                                          "shape": "8b", "parts": []})


def test_unknown_target_device_shows_no_verdict():
    res = {"device": "NVIDIA A100", "shape": "8b", "date": "d", "commit": "c", "parts": [
        {"part": "nf4:2048", "status": "ok", "tokens_per_s": 1.0, "pipelined_tokens_per_s": 2.0, "peak_gib": 1.0}]}
    row = next(ln for ln in st.markdown(res).splitlines() if ln.startswith("| 2048 |"))
    assert row.rstrip().endswith("| - | - |")


def test_surogate_configuration_runs_last_and_has_its_own_table(monkeypatch, tmp_path):
    """Surogate's configuration (Qwen3-8B shape, 2 packed rows of 2,048 tokens): after every other
    part, the train_bench command with its arguments, and a table with NF4 / bf16 and the H100 target."""
    names = st.part_names(["nf4"], [2048], ["8b"], ["nf4", "bf16"])
    assert names == ["nf4:2048", "decode:8b", "surogate:nf4", "surogate:bf16"]
    cmd = st.part_command("surogate:nf4", "8b", 5)
    joined = " ".join(cmd)
    assert cmd[1:3] == ["-m", "benchmarks.train_bench"] and cmd[-2:] == ["--attention", "cudnn"]
    assert "--weights nf4" in joined and "--shape qwen3-8b --rows 2 --packed --docs 4 --seq 2048" in joined
    monkeypatch.setattr(st, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(st, "measured_commit", lambda: "abc1234")
    monkeypatch.setattr(st, "package_versions", lambda: {"jax": "0.0"})
    lines = {"surogate:nf4": _train_line(11_900.0, 12_100.0, 41.5), "surogate:bf16": _train_line(10_900.0, 11_000.0, 51.1)}
    calls = []
    monkeypatch.setattr(st, "run_part", _fake_runner(lines, calls))
    res = st.run("8b", [], [], [], 5, 10_000, str(tmp_path), surogate=["nf4", "bf16"])
    assert [c[0] for c in calls] == ["surogate:nf4", "surogate:bf16"]
    md = st.markdown(res)
    nf4 = [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith("| nf4 |")).strip("|").split("|")]
    assert nf4 == ["nf4", "12,100 (11,900)", "41.5", "1.10", "11,600", "yes"]
    bf16 = next(ln for ln in md.splitlines() if ln.startswith("| bf16 |"))
    assert bf16.rstrip().endswith("| - | - | - |")
    assert "| 2048 |" not in md  # no training-step rows without those parts
