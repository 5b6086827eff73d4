"""benchmarks/rollout_bench --tiny: the rollout benchmark end to end on CPU (tiny shape), its
records' fields and arithmetic, its stop cases and its --profile path (the GPU numbers come from the
same code; on a CPU the trace holds no GPU kernels)."""
import json

import pytest

from benchmarks import rollout_bench
from jqlora.models import rollout


def test_tiny_run_writes_consistent_records(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    before = rollout.compiled_programs()
    run = rollout._run
    assert rollout_bench.main(["--tiny", "--profile", "--out", str(out)]) == 0
    *recs, prof = [json.loads(ln) for ln in out.read_text().splitlines()]
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rollout_bench: ")]
    assert len(printed) == 3 and [r["case"] for r in recs] == ["none", "random"]
    none, rand = recs
    # --profile: one traced call of case none, read against both rollout programs' compiled HLO
    assert prof["bench"] == "rollout_profile" and prof["steps"] == 8
    assert prof["hlo_programs"] == ["rollout_prefill", "rollout_decode"] and prof["hlo_instructions"] > 100
    assert prof["gpu_us_per_step"] == 0 and prof["kernels_per_step"] == 0  # a CPU trace: no GPU kernels
    assert rollout._run is run  # the spy is gone
    for r in recs:
        assert r["batch"] == 4 and r["new_tokens"] == 8 and r["seconds"] > 0 and r["platform"] == "cpu"
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["seconds"], rel=1e-2)
        assert r["slot_tokens_per_s"] == pytest.approx(r["batch"] * r["steps"] / r["seconds"], rel=1e-2)
        assert {"device", "date", "commit", "jax", "decode_step_ms", "compile_s"} <= set(r)
    # a prefill and a decode program per case (the stop lists differ in length; case none decodes in
    # one call, case random in calls of 32 steps), the same for both lengths of case none
    assert recs[-1]["programs"] - before == 4
    # no stop ids: every row runs to the end
    assert none["generated_tokens"] == 4 * 8 and none["finished_rows"] == 0 and none["steps"] == 8
    # stop ids of a quarter of the vocabulary: rows end early, and their lengths are what is counted
    assert rand["finished_rows"] >= 1 and rand["generated_tokens"] < 4 * 8
    assert rand["mean_length"] == pytest.approx(rand["generated_tokens"] / 4, abs=0.051)


def test_prompts_have_the_lengths_asked_for():
    ps = rollout_bench.prompts_for(50, 3, 7, vocab=11, seed=1)
    assert len(ps) == 50 and {len(p) for p in ps} <= set(range(3, 8)) and len({len(p) for p in ps}) > 2
    assert all(0 <= t < 11 for p in ps for t in p)
