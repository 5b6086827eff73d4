"""benchmarks/gemma_bench: its Gemma 3 12B shape, and one tiny CPU step of each side (jqlora NF4
QLoRA; transformers + PEFT + bitsandbytes) and of the window sweep (slow), as `--tiny` runs them."""
import math

import pytest

from benchmarks import gemma_bench


def test_the_shape_is_gemma3_12b():
    c = gemma_bench.config(tiny=False)
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["head_dim"]) == (48, 3840, 15360, 256)
    assert c["layer_types"].count("full_attention") == 8 and c["layer_types"][5] == "full_attention"  # 5 : 1
    assert set(gemma_bench.config(tiny=False, layers=2, layer_kind="sliding")["layer_types"]) == {"sliding_attention"}
    from jqlora.models import ModelConfig

    mc = ModelConfig.from_hf(c)
    assert mc.sliding_windows.count(1024) == 40 and mc.local_rope_theta == 10_000.0 and mc.rope_type == "linear"


@pytest.mark.torch
def test_tiny_steps_of_both_sides():
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    c = gemma_bench.config(tiny=True, layers=1)
    jax_row = gemma_bench.run_jax(c, seq=32, steps=1, tiny=True)
    torch_row = gemma_bench.run_torch(c, seq=32, steps=1, tiny=True)
    for row in (jax_row, torch_row):
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(32 / row["step_s"])
        assert math.isfinite(row["loss"]) and 4.5 < row["loss"] < 6.5  # about ln(256) at random weights
    assert jax_row["attention"] == "einsum" and not torch_row["oom"]


@pytest.mark.slow  # two more compilations of the jqlora step the test above runs
def test_tiny_window_sweep():
    rows = gemma_bench.run_windows(tiny=True, seqs=[32], steps=1)
    assert [(r["layers"], r["seq"]) for r in rows] == [("sliding", 32), ("full", 32)]
    assert all(r["us_per_token"] > 0 for r in rows)
