"""benchmarks/profile/fused_products on CPU: each timing path runs for real once (wall-clock
timing here), and a layer's record sums what was timed (the timer stubbed, so the sums are exact)."""
import json

import pytest

from benchmarks.profile import fused_products as fp


def test_one_product_apart_and_stacked_and_the_head_time_on_cpu():
    assert fp.product_us(1, 32, 128) > 0
    assert fp.product_us(1, 32, 128, stacked_from=((16, 128), (16, 128)), nested=False) > 0
    assert all(v > 0 for v in fp.head_us(1, 64, 256).values())


def test_a_layer_record_sums_seven_products_apart_and_four_fused(tmp_path, monkeypatch):
    timed = []

    def fake_product(m, rows, cols, stacked_from=(), nested=True):
        timed.append((rows, cols, stacked_from, nested))
        return float(rows + cols) / 100 + (0.5 if stacked_from else 0.0)

    monkeypatch.setattr(fp, "product_us", fake_product)
    monkeypatch.setattr(fp, "head_us", lambda m, h, v: {"lm_head bf16 x @ E.T": 1.0, "lm_head qmatmul": 2.0})
    monkeypatch.setenv("OUT", str(tmp_path))
    assert fp.main(["--shapes", "tiny"]) == 0
    rec = json.loads((tmp_path / "fused_products.json").read_text())["results"][0]
    s = fp.SHAPES["tiny"]
    assert set(rec["apart_us"]) == set(fp.PRODUCTS)
    assert (s["q"] + 2 * s["kv"], s["hidden"], ((s["q"], s["hidden"]), (s["kv"], s["hidden"]), (s["kv"], s["hidden"])),
            False) in timed  # q|k|v stacked from its three pieces, f32 scales
    assert rec["layer_us"]["seven apart"] == pytest.approx(sum(rec["apart_us"].values()), abs=0.05)
    fused = rec["fused_us"]["qkv f32 scales"] + rec["apart_us"]["o"] + rec["fused_us"]["gate_up f32 scales"] \
        + rec["apart_us"]["down"]
    assert rec["layer_us"]["four, q|k|v and gate|up fused"] == pytest.approx(fused, abs=0.05)
