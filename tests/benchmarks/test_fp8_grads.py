"""benchmarks.profile.fp8_grads on the tiny random model (CPU): the comparison it prints is real."""
import json

from benchmarks.profile import fp8_grads


def test_fp8_gradients_differ_from_compute_and_only_from_256_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert fp8_grads.main(["--shape", "tiny", "--seq", "256", "--steps", "0", "--modes", "compute,fp8,fp8_bwd"]) == 0
    recs = {r["mode"]: r for r in json.loads((tmp_path / "fp8_grads_tiny.json").read_text())}
    fp8 = recs["fp8"]["grads_vs_compute"]
    assert len(fp8) == 14  # lora_A and lora_B of the seven projections
    for leaf in fp8.values():  # E4M3 rounding: a few percent, same direction
        assert 1e-3 < leaf["rel_err_mean"] < 0.2 and leaf["cos_min"] > 0.98, leaf
    # with the forward in the compute dtype, the forward's loss is compute's exactly
    assert recs["fp8_bwd"]["loss_random_b"] == recs["compute"]["loss_random_b"]
    assert recs["fp8"]["loss_random_b"] != recs["compute"]["loss_random_b"]


def test_below_fp8_min_rows_the_modes_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert fp8_grads.main(["--shape", "tiny", "--seq", "128", "--steps", "0", "--modes", "compute,fp8"]) == 0
    fp8 = json.loads((tmp_path / "fp8_grads_tiny.json").read_text())[1]["grads_vs_compute"]
    assert all(leaf["rel_err_mean"] == 0.0 for leaf in fp8.values())
