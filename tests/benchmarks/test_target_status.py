"""benchmarks/targets: the issue's targets read off one benchmark run."""
import json

from benchmarks import run, targets as ts


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


def _write_log(tmp_path, lines):
    path = tmp_path / "bench.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_results_rebuilt_from_the_log_of_a_stopped_run(tmp_path):
    """A run killed after its measurements (a device call's time limit): its log holds every
    contender line, dequant and memory; --from-log writes the same result files from it."""
    log = _write_log(tmp_path, [
        "  M=1 K=4096 N=4096 jnp.dot bf16: {'fwd_ms': 0.02, 'fwd_bwd_ms': 0.04}",
        "  M=1 K=4096 N=4096 qmatmul pallas (auto plan): {'fwd_ms': 0.01, 'fwd_bwd_ms': 0.05}",
        "  M=1 K=4096 N=4096 variant mgpu_decoded_wgmma: {'fwd_ms': 0.015}",
        "  M=16 K=14336 N=4096: skipped (time budget 270 s spent)",
        "WARNING: something else the run printed",
        "dequant: {'shape': [14336, 4096], 'copy_tb_s': 2.9, 'variants': {'dequant_tiled': "
        "{'ms': 0.05, 'tb_s': 2.7, 'fraction_of_copy': 0.93}}}",
        "memory qmatmul: {'mode': 'qmatmul', 'growth_minus_activations_in_dense_layers': -3.9}",
    ])
    res = run.results_from_log(log, "NVIDIA H100 80GB HBM3", "2026-11-25", "jax=0.11.2")
    assert res["versions"] == {"jax": "0.11.2"} and res["variants"] == ["mgpu_decoded_wgmma"]
    (cell,) = res["matmul"]
    assert (cell["m"], cell["k"], cell["n"]) == (1, 4096, 4096)
    assert cell["rows"]["qmatmul pallas (auto plan)"]["fwd_ms"] == 0.01
    assert res["skipped_cells"] == [{"m": 16, "k": 14336, "n": 4096}]
    assert res["dequant"]["variants"]["dequant_tiled"]["fraction_of_copy"] == 0.93
    assert run.main(["--from-log", log, "--device-name", "NVIDIA H100 80GB HBM3",
                     "--date", "2026-11-25", "--out", str(tmp_path), "--tag", "_x"]) == 0
    written = json.loads((tmp_path / "nvidia-h100-80gb-hbm3-2026-11-25_x.json").read_text())
    assert written["matmul"][0]["ratios"]["qmatmul pallas (auto plan)"]["fwd_ms"] == 0.5
    assert "| NF4 | 1 | fwd | <= 0.33 |" in (tmp_path / "nvidia-h100-80gb-hbm3-2026-11-25_x.md"
                                             ).read_text()


def test_a_malformed_log_line_is_named(tmp_path):
    import pytest

    log = _write_log(tmp_path, ["  M=1 K=64 N=64 jnp.dot bf16: {'fwd_ms': 0.02,,}"])
    with pytest.raises(ValueError, match=r"bench.log:1: unreadable contender line"):
        run.results_from_log(log, "GPU", "2026-11-25", "")
    empty = _write_log(tmp_path, ["nothing here"])
    with pytest.raises(ValueError, match="no matmul contender lines"):
        run.results_from_log(empty, "GPU", "2026-11-25", "")
