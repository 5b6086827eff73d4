"""benchmarks/train_bench --weights bf16: the jqlora step over a dense bf16 base (the ceiling the
NF4 step is compared with), one tiny CPU step; the line says which base the model really holds."""
import json
import math

from benchmarks import train_bench


def test_bf16_weights_keep_the_base_dense(capsys):
    train_bench.main(["--side", "jax", "--shape", "tiny", "--steps", "1", "--seq", "32", "--weights", "bf16"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["weights"] == "bf16" and rec["side"] == "jqlora"
    # read off the built model: 7 decoder projections (stacked over layers) and the LM head, all dense
    assert rec["frozen_formats"] == {"bfloat16": 8}
    assert rec["step_s"] > 0 and all(4.0 < x < 7.0 for x in rec["losses"])  # about ln(256) at random weights
    assert all(math.isfinite(x) for x in rec["pipelined_losses"])
