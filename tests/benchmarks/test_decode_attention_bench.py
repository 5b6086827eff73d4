"""benchmarks/decode_attention_bench on CPU: each contender runs once for real (the kernel in
interpret mode), the timer stubbed; settings parse; a file names its device, commit and rows."""
import json

import jax
import pytest

import benchmarks.timing as timing
from benchmarks import decode_attention_bench as dab


def test_configs_parse():
    assert dab.parse_configs("block_s=16;block_s=32,splits=8") == [{"block_s": 16}, {"block_s": 32, "splits": 8}]
    assert dab.parse_configs(None) == [] and dab.parse_configs(" ") == []
    with pytest.raises(ValueError):
        dab.parse_configs("block_s")


def test_every_contender_runs_and_a_file_is_written(tmp_path, monkeypatch):
    ran = []

    def once(fn, *args, iterations=20):
        ran.append(jax.block_until_ready(jax.jit(fn)(*args)).shape)
        return 0.001 * len(ran)

    monkeypatch.setattr(timing, "jax_device_ms", once)
    monkeypatch.setenv("JQLORA_COMMIT", "abc1234")
    assert dab.main(["--shapes", "tiny", "--slots", "40", "--batch", "2", "--configs", "block_s=8,splits=3",
                     "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_decode_attention.json")
    res = json.loads(path.read_text())
    assert res["commit"] == "abc1234" and res["device"] and "jax" in res["versions"]
    names = [r["contender"] for r in res["rows"]]
    assert names[0] == "einsum" and names[1].startswith("kernel default (block_s=32, splits=")
    assert names[2] == "kernel {'block_s': 8, 'splits': 3}"
    assert [r["us"] for r in res["rows"]] == [1.0, 2.0, 3.0]
    s = dab.SHAPES["tiny"]
    assert ran == [(2, 1, s["heads"] * s["head_dim"])] + [(2, s["heads"], s["head_dim"])] * 2
