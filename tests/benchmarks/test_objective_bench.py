"""benchmarks/objective_bench --tiny: one GRPO and one DPO step of jqlora's training code on a CPU,
timed by part; the record's parts add up to its step, its token counts follow from the shapes
asked for, and the result file is written (the GPU numbers come from the same code)."""
import contextlib
import io
import json
import math

import pytest

from benchmarks import objective_bench as ob


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("objectives")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert ob.main(["--tiny", "--steps", "2", "--out", str(out), "--tag", "_t"]) == 0
    files = sorted(p.name for p in out.iterdir())
    lines = [json.loads(ln) for ln in printed.getvalue().splitlines()]
    return json.loads((out / files[0]).read_text()), files, lines


def test_file_and_printed_lines(result):
    res, files, lines = result
    assert files == [f"cpu-{res['date']}_t_objectives.json"]  # written whole: no .tmp left
    assert [r["objective"] for r in res["records"]] == ["grpo", "dpo"] and lines == res["records"]
    assert res["device"] == "cpu" and res["commit"] and res["versions"]["jax"]
    for r in res["records"]:
        assert r["shape"] == "tiny" and r["platform"] == "cpu" and r["compute_dtype"] == "float32"
        assert r["frozen_formats"]["nf4"] == 7  # every decoder projection NF4, LoRA unmerged over it
        assert len(r["per_step"]) == r["steps"] == 2
        assert r["step_s"] in [s["step_s"] for s in r["per_step"]]  # the median step, with its parts


def test_grpo_parts_and_counts(result):
    g = result[0]["records"][0]
    rows = 2 * 2
    assert g["rows"] == rows and g["new_tokens"] == 8 and g["prompt_tokens"] == 8
    # completions of 1..8 tokens; every completion token (its EOS included) is scored, nothing else
    assert rows <= g["generated_tokens"] <= rows * 8
    assert g["scored_tokens"] == g["generated_tokens"]
    assert g["mean_completion_length"] == pytest.approx(g["generated_tokens"] / rows)
    assert g["update_slots"] == rows * (8 + 8 - 1)  # right-padded rows: prompt + completion - 1 slots
    assert g["rollout_tokens_per_s"] == pytest.approx(g["generated_tokens"] / g["parts_s"]["rollout"], rel=2e-2)
    parts = g["parts_s"]
    assert set(parts) == {"rollout", "reward", "update"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) + g["other_s"] == pytest.approx(g["step_s"], abs=1e-3)
    assert -1e-3 <= g["other_s"] < 0.5 * g["step_s"]  # the host work between the parts is small
    assert 0 < g["reference_alone_s"] < parts["update"]  # a forward pass, inside the update
    assert all(math.isfinite(x) for x in g["losses"])
    assert g["kl"] > 0  # LoRA B is random: the reference (LoRA off) differs from the policy


def test_dpo_parts_and_counts(result):
    d = result[0]["records"][1]
    assert d["rows"] == 4 and d["tokens"] == 2 * 2 * 32  # chosen and rejected rows, no padding
    parts = d["parts_s"]
    assert set(parts) == {"reference", "update"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) + d["other_s"] == pytest.approx(d["step_s"], abs=1e-3)
    assert abs(d["other_s"]) < 1e-3 + 0.05 * d["step_s"]  # the two parts run back to back
    assert d["tokens_per_s"] == pytest.approx(d["tokens"] / d["step_s"], rel=1e-2)
    assert d["default_step_s"] > 0 and len(d["default_losses"]) == 2
    # LoRA B is small: the policy is near its reference and the sigmoid loss near ln 2
    for x in d["losses"] + d["default_losses"]:
        assert abs(x - math.log(2)) < 0.2


def test_reward_and_tokenizer_spell_ids_as_numbers():
    tok = ob.IdTokenizer(10)
    assert tok.decode([4, 7, 2]) == "4 7 2" and tok.token_to_id("7") == 7 and tok.token_to_id("10") is None
    assert tok.token_to_id("<pad>") is None and max(tok.get_vocab().values()) == 9
    assert ob.even_share(prompts=["p", "p"], completions=["4 7 2", ""]) == [2 / 3, 0.0]


def test_data_has_the_shapes_asked_for():
    ps = ob.prompt_set(3, 5, vocab=50)
    assert len(ps) == 3 and all(len(p) == 5 and p[0] == ob.BOS_ID and p[1:].min() > ob.EOS_ID for p in ps.ids)
    pairs = ob.pair_set(2, 16, vocab=50)
    for c, cs, r, rs in pairs.seqs:
        assert len(c) == len(r) == 17 and (c[:4] == r[:4]).all() and not (c[4:] == r[4:]).all()
        assert not cs[:4].any() and cs[4:].all() and (cs == rs).all()
