"""benchmarks/profile/fused_products on CPU (wall-clock timing there): every product of a layer is
timed apart and fused, and the per-layer sums add up what was timed."""
import json

import pytest

from benchmarks.profile import fused_products as fp


def test_a_tiny_layer_is_timed_apart_and_fused(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert fp.main(["--shapes", "tiny"]) == 0
    rec = json.loads((tmp_path / "fused_products.json").read_text())["results"][0]
    assert set(rec["apart_us"]) == set(fp.PRODUCTS)
    assert set(rec["fused_us"]) == {"qkv f32 scales", "qkv nested", "gate_up f32 scales", "gate_up nested"}
    assert all(v > 0 for part in ("apart_us", "fused_us", "head_us") for v in rec[part].values())
    assert rec["layer_us"]["seven apart"] == pytest.approx(sum(rec["apart_us"].values()), abs=0.05)
    fused = rec["fused_us"]["qkv f32 scales"] + rec["apart_us"]["o"] + rec["fused_us"]["gate_up f32 scales"] \
        + rec["apart_us"]["down"]
    assert rec["layer_us"]["four, q|k|v and gate|up fused"] == pytest.approx(fused, abs=0.05)
