"""jqlora.runs (run records, config files, finding a run's checkpoint) and jqlora._util, without
a model: the export itself is tested on a trained run in test_cli.py."""
from __future__ import annotations

import json

import pytest

from jqlora import runs
from jqlora._util import fmt_bytes, jnp_dtype
from jqlora.runs import RunError


def test_load_config_file_json_toml_and_errors(tmp_path):
    j = tmp_path / "a.json"
    j.write_text(json.dumps({"model": "m", "lora": {"rank": 4}}))
    assert runs.load_config_file(j) == {"model": "m", "lora": {"rank": 4}}
    t = tmp_path / "a.TOML"  # the suffix picks the parser, in any case
    t.write_text('model = "m"\n[lora]\nrank = 4\n')
    assert runs.load_config_file(t) == {"model": "m", "lora": {"rank": 4}}
    cases = {"bad.json": ("{not json", "invalid JSON"), "bad.toml": ("model = ", "invalid TOML"),
             "list.json": ("[1, 2]", "top level must be an object/table, got list")}
    for name, (text, msg) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(RunError, match=msg) as e:
            runs.load_config_file(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
    with pytest.raises(RunError, match="cannot read config file") as e:
        runs.load_config_file(tmp_path / "missing.json")
    assert "missing.json" in str(e.value)
    assert issubclass(RunError, ValueError)  # the CLI maps it to exit status 2


def test_run_record_roundtrip_and_lookup(tmp_path):
    from jqlora.lora import LoraConfig

    for targets in (("q_proj", "v_proj"), r".*\.(q|v)_proj"):
        cfg = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=targets, use_rslora=True)
        rec = runs.lora_record(cfg)
        assert json.loads(json.dumps(rec)) == rec  # JSON types only
        assert runs.lora_config_from_record(rec) == cfg
    run_dir = tmp_path / "run"
    path = runs.write_run_record(run_dir, {"model": "/m", "lora": runs.lora_record(cfg), "train": {"steps": 3}})
    assert path == run_dir / runs.RUN_FILE
    rec = runs.load_config_file(path)
    assert rec["format"] == runs.RUN_FORMAT and rec["version"] == runs.RUN_VERSION and rec["model"] == "/m"
    step = run_dir / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    for d in (run_dir, run_dir / "checkpoints", step):  # the run dir, its checkpoints/ or one step
        assert runs.find_run_file(d) == path
    assert runs.find_run_file(tmp_path) is None


def _checkpoint(root, step):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text("{}")
    return d


def test_find_checkpoint(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    s2, s3 = _checkpoint(ck, 2), _checkpoint(ck, 3)
    (ck / "step_00000009").mkdir()  # incomplete: no state.json
    assert runs.find_checkpoint(tmp_path / "run") == s3  # newest
    assert runs.find_checkpoint(ck, 2) == s2
    assert runs.find_checkpoint(s2) == s2 and runs.find_checkpoint(s2, 2) == s2
    with pytest.raises(RunError, match=r"no checkpoint for step 9 \(have \[2, 3\]\)"):
        runs.find_checkpoint(ck, 9)
    with pytest.raises(RunError, match="single checkpoint; --step 3 does not name it"):
        runs.find_checkpoint(s2, 3)
    with pytest.raises(RunError, match="no training checkpoint found"):
        runs.find_checkpoint(tmp_path / "empty")


def test_export_adapter_input_errors(tmp_path):
    with pytest.raises(RunError, match="no such directory"):
        runs.export_adapter(tmp_path / "nope", tmp_path / "out")
    ck = _checkpoint(tmp_path / "run" / "checkpoints", 1)
    with pytest.raises(RunError, match="no jqlora_run.json found near"):
        runs.export_adapter(tmp_path / "run", tmp_path / "out")
    runs.write_run_record(tmp_path / "run", {"lora": {"rank": 4, "alpha": 8}})
    with pytest.raises(RunError, match="no 'model' recorded"):
        runs.export_adapter(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_util_dtype_and_bytes():
    assert jnp_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'float8'; expected one of float32, bfloat16, float16"):
        jnp_dtype("float8")
    assert [fmt_bytes(n) for n in (0, 1023, 1536, 3 * 2**30, 2**50)] == [
        "0 B", "1023 B", "1.50 KiB", "3.00 GiB", "1024.00 TiB"]
