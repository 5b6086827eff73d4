"""benchmarks/target_status: the issue's targets read off one benchmark run."""
import json

from benchmarks import run, target_status as ts


def _result(ratio_nf4: float, ratio_int8: float, skip=()):
    cells = []
    for m in (1, 16, 128, 2048, 8192):
        for k, n in ts.SHAPES_KN:
            if (m, k, n) in skip:
                continue
            base = {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0}
            rows = {
                ts.BASELINE: base,
                ts.NF4: {"fwd_ms": ratio_nf4, "fwd_bwd_ms": 2.0 * ratio_nf4},
                ts.INT8: {"fwd_ms": ratio_int8, "fwd_bwd_ms": 2.0 * ratio_int8},
                ts.TORCH: base,
                ts.BNB: {"fwd_ms": 3.0, "fwd_bwd_ms": 6.0},
            }
            ratios = {name: {key: row[key] / base[key] for key in base} for name, row in rows.items()}
            cells.append({"m": m, "k": k, "n": n, "rows": rows, "ratios": ratios})
    return {"device": "test", "date": "2026-11-22", "versions": {}, "matmul": cells,
            "dequant": {"shape": [8, 8], "copy_tb_s": 1.0,
                        "variants": {"a": {"ms": 1.0, "tb_s": 0.9, "fraction_of_copy": 0.9}}},
            "memory": {"qmatmul": {"growth_minus_activations_in_dense_layers": 1.5}}}


def test_each_target_is_met_exactly_when_every_shape_is_at_or_below_it():
    rows = ts.status_rows(_result(1.02, 0.6))
    met = {(r["weights"], r["m"], r["pass_"]): r["met"] for r in rows}
    assert met[("NF4", 8192, "fwd")] and met[("NF4", 2048, "fwd")] and met[("NF4", 8192, "fwd_bwd")]
    assert not met[("NF4", 1, "fwd")] and not met[("NF4", 128, "fwd_bwd")]
    assert met[("INT8", 1, "fwd")] and met[("INT8", 2048, "fwd")]
    assert all(r["bitsandbytes"] == [3.0] * 3 for r in rows if r["weights"] == "NF4")


def test_an_unmeasured_shape_leaves_its_target_unmet():
    res = _result(0.1, 0.1, skip={(2048, 4096, 14336)})
    rows = {(r["weights"], r["m"], r["pass_"]): r for r in ts.status_rows(res)}
    assert rows[("NF4", 2048, "fwd")]["ratios"][1] is None
    assert not rows[("NF4", 2048, "fwd")]["met"] and rows[("NF4", 8192, "fwd")]["met"]


def test_markdown_lists_targets_dequant_and_memory(tmp_path, capsys):
    res = _result(1.0, 0.7)
    text = ts.markdown(res)
    assert "| NF4 | 1 | fwd | <= 0.33 | 1.00 / 1.00 / 1.00 | no | 3.00 / 3.00 / 3.00 |" in text
    assert "| INT8 | 1 | fwd | <= 0.6 | 0.70 / 0.70 / 0.70 | no |  |" in text
    assert "| 0.90 | yes |" in text and "+1.50 layers | no |" in text
    assert text in run.markdown(res)  # the benchmark's own markdown carries the table
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    assert ts.main([str(path)]) == 0 and "## targets" in capsys.readouterr().out
