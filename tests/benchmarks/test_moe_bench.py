"""benchmarks/moe_bench: its shapes, and one tiny CPU step of each side (jqlora NF4 experts through
qgmm; transformers + PEFT target_parameters + bitsandbytes), as `--tiny` runs them."""
import math

import pytest

from benchmarks import moe_bench


def test_the_shape_is_qwen3_30b_a3b():
    c = moe_bench.config(tiny=False, layers=None)
    assert (c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]) == (48, 128, 8)
    assert (c["hidden_size"], c["moe_intermediate_size"]) == (2048, 768)
    assert 2.5e9 < moe_bench.active_params(c) < 3.5e9  # "A3B": about 3B active parameters
    assert moe_bench.config(tiny=False, layers=4)["num_hidden_layers"] == 4


def test_tiny_jqlora_step():
    row = moe_bench.run_jax(moe_bench.config(tiny=True, layers=1), seq=16, steps=1, tiny=True)
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(16 / row["step_s"])
    assert math.isfinite(row["loss"]) and 4.0 < row["loss"] < 7.0  # about ln(256) at random weights
    assert row["experts"] == "nf4"


@pytest.mark.slow  # the torch side's wiring; the jqlora side above is the fast smoke test
@pytest.mark.torch
def test_tiny_transformers_peft_step():
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    row = moe_bench.run_torch(moe_bench.config(tiny=True, layers=1), seq=16, steps=1, tiny=True)
    assert row["step_s"] > 0 and not row["oom"] and row["experts"] == "bf16"
    assert math.isfinite(row["loss"]) and 4.0 < row["loss"] < 7.0
