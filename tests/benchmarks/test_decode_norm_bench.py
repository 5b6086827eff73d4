"""benchmarks/decode_norm_bench on CPU: each contender runs once for real (the kernel in interpret
mode), the timer stubbed; settings parse; a file names its device, commit and rows."""
import json

import jax
import pytest

import benchmarks.timing as timing
from benchmarks import decode_norm_bench as dnb


def test_configs_parse():
    assert dnb.parse_configs("num_warps=1;num_warps=8") == [{"num_warps": 1}, {"num_warps": 8}]
    with pytest.raises(ValueError):
        dnb.parse_configs("num_warps")


def test_every_contender_runs_and_a_file_is_written(tmp_path, monkeypatch):
    ran = []

    def once(fn, *args, iterations=20):
        r, h = jax.block_until_ready(jax.jit(fn)(*args))
        ran.append((r.shape, h.shape))
        return 0.001 * len(ran)

    monkeypatch.setattr(timing, "jax_device_ms", once)
    monkeypatch.setenv("JQLORA_COMMIT", "abc1234")
    assert dnb.main(["--widths", "640", "--rows", "2", "--configs", "num_warps=2", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_decode_norm.json")
    res = json.loads(path.read_text())
    assert res["commit"] == "abc1234" and res["device"] and "jax" in res["versions"]
    assert [r["contender"] for r in res["rows"]] == ["xla", "kernel default", "kernel {'num_warps': 2}"]
    assert [r["us"] for r in res["rows"]] == [1.0, 2.0, 3.0]
    assert ran == [((2, 640), (2, 640))] * 3
