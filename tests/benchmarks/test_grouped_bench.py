"""benchmarks/grouped_bench: the routing it times, and one tiny CPU run through main (the file it writes)."""
import json

import numpy as np

from benchmarks import grouped_bench


def test_routing_gives_top_k_distinct_experts_per_token():
    gs = grouped_bench.routing(2048, 8, 128, seed=0)
    assert gs.shape == (128,) and gs.dtype == np.int32 and gs.sum() == 2048 * 8
    assert gs.max() <= 2048  # distinct experts per token: an expert sees a token at most once
    assert np.array_equal(gs, grouped_bench.routing(2048, 8, 128, seed=0))


def test_tiny_run_writes_rows_with_ratios(tmp_path, monkeypatch):
    monkeypatch.setitem(grouped_bench.TINY, "projections", (("down", 128, 64),))
    assert grouped_bench.main(["--tiny", "--iterations", "1", "--only", "auto", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_grouped.json")
    res = json.loads(path.read_text())
    assert res["tiny"] and res["device"] and res["date"] and res["versions"]["jax"]
    rows = {r["contender"]: r for r in res["rows"]}
    assert set(rows) == {"qgmm nf4 auto", "qgmm bf16 auto"}
    for r in rows.values():
        assert r["m"] == 32 and r["experts"] == 4 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert "backend='xla'" in r["plan"]  # CPU: the jnp reference
    assert rows["qgmm bf16 auto"]["fwd_ratio"] == 1.0
    assert not list(tmp_path.glob("*.tmp"))


def test_a_spent_budget_skips_the_contenders_left_and_still_writes_the_file(tmp_path, monkeypatch):
    monkeypatch.setitem(grouped_bench.TINY, "projections", (("down", 128, 64),))
    assert grouped_bench.main(["--tiny", "--iterations", "1", "--only", "auto", "--budget-s", "0",
                               "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_grouped.json")
    res = json.loads(path.read_text())
    assert res["rows"] == [] and res["skipped"] == ["down: qgmm bf16 auto", "down: qgmm nf4 auto"]


def test_triton_configs_parse_to_keyword_overrides():
    assert grouped_bench.parse_configs("block_m=128,num_warps=8;method=select") == [
        {"block_m": 128, "num_warps": 8}, {"method": "select"}]
    assert grouped_bench.parse_configs(None) == [] and grouped_bench.parse_configs(" ; ") == []
    import pytest

    with pytest.raises(ValueError, match="block_m"):
        grouped_bench.parse_configs("block_m")
    with pytest.raises(ValueError, match="--mosaic-configs: 'compute_wgs' is not key=value"):
        grouped_bench.parse_configs("compute_wgs", "--mosaic-configs")
