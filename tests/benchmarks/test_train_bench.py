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


def test_qwen3_shape_with_two_packed_rows(capsys):
    """The Surogate configuration's pieces on a tiny Qwen3: q/k norms in the model, two rows a step,
    packed documents; tokens/s counts both rows."""
    c = train_bench.hf_config("qwen3-tiny")
    assert c["model_type"] == "qwen3" and c["architectures"] == ["Qwen3ForCausalLM"]
    model, _, batch = train_bench.build_jax("qwen3-tiny", 32, "auto", rows=2)
    assert batch["input_ids"].shape == (1, 2, 32)
    assert model.config.qk_norm and hasattr(model.model.layers[0].self_attn, "q_norm")
    train_bench.main(["--side", "jax", "--shape", "qwen3-tiny", "--steps", "1", "--seq", "32", "--rows", "2",
                      "--packed", "--docs", "2"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["rows"] == 2 and rec["shape"] == "qwen3-tiny"
    assert math.isclose(rec["tokens_per_s"], 2 * 32 / rec["step_s"], rel_tol=1e-9)


def test_torch_side_builds_the_shapes_family_and_counts_its_rows(capsys):
    train_bench.main(["--side", "torch-bf16", "--shape", "qwen3-tiny", "--steps", "1", "--seq", "32", "--rows", "2"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["model_class"] == "Qwen3ForCausalLM"
    assert rec["rows"] == 2 and math.isclose(rec["tokens_per_s"], 2 * 32 / rec["step_s"], rel_tol=1e-9)
    assert all(math.isfinite(x) for x in rec["losses"])
