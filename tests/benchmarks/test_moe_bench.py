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


def _attention_lora_params(c: dict) -> int:
    """LoRA parameters of q, k, v, o (r * (in + out) each) over the layers, from the shape."""
    h, qf, kf = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return c["num_hidden_layers"] * moe_bench.RANK * ((h + qf) + 2 * (h + kf) + (qf + h))


def test_tiny_step_on_a_mesh_with_lora_on_attention_only():
    """--mesh fsdp=2 on the suite's 2 forced CPU devices (tests/conftest.py), --target-modules on
    attention: the library's step on one row per device, the LoRA the attention's alone."""
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs the suite's 2 forced host devices")
    c = moe_bench.config(tiny=True, layers=1)
    targets = moe_bench.parse_targets("q_proj,k_proj,v_proj,o_proj")
    row = moe_bench.run_jax(c, seq=16, steps=1, tiny=True, mesh_spec="fsdp=2", targets=targets)
    assert row["mesh"] == "fsdp=2" and row["devices"] == 2 and row["rows"] == 2
    assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["step_s"])
    assert math.isfinite(row["loss"]) and 4.0 < row["loss"] < 7.0
    assert len(row["resident_gib_per_device"]) == 2
    assert row["lora_params"] == _attention_lora_params(c)
    everything = moe_bench.run_jax(c, seq=16, steps=1, tiny=True)
    assert everything["mesh"] is None and everything["lora_params"] > row["lora_params"]


def test_one_side_writes_its_row_with_device_commit_and_versions(tmp_path, capsys):
    import json

    assert moe_bench.main(["--side", "jax", "--tiny", "--layers", "1", "--seq", "16", "--steps", "1",
                           "--out", str(tmp_path), "--tag", "_t"]) == 0
    (path,) = tmp_path.glob("*_t_moe_jax.json")
    res = json.loads(path.read_text())
    assert res["side"] == "jqlora" and res["tokens_per_s"] > 0 and res["versions"]["jax"] and res["commit"]
    assert json.loads(capsys.readouterr().out.splitlines()[0])["side"] == "jqlora"  # the line a both-sides run reads


def test_target_modules_and_mesh_options_are_checked():
    assert moe_bench.parse_targets("all-linear") == "all-linear"
    assert moe_bench.torch_targets(["q_proj", "down_proj"]) == (["q_proj"], ["mlp.experts.down_proj"])
    assert moe_bench.torch_targets("all-linear") == (moe_bench.ATTENTION, moe_bench.EXPERT_PARAMS)
    for argv in (["--target-modules", "q_proj,mlp"], ["--mesh", "fsdp=two"], ["--mesh", "expert=2"]):
        with pytest.raises(SystemExit) as e:
            moe_bench.main(["--side", "jax", "--tiny", *argv])
        assert e.value.code == 2, argv


def test_the_jqlora_side_runs_the_library_step_with_its_state_donated():
    """One device runs `jqlora train`'s step (jqlora.train.step.train_step), not a step of its own: the
    LoRA params going in are donated (updated in place), which is what keeps the peak of the 48-layer
    model at its state and weights."""
    from flax import nnx

    side = moe_bench.build_jax(moe_bench.config(tiny=True, layers=1), seq=16, tiny=True)
    assert side.mesh is None and side.info["devices"] == 1
    before = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(side.model, nnx.LoRAParam))]
    out = side.run(side.batch)
    assert math.isfinite(float(out["loss"])) and bool(out["ok"])
    assert before and all(x.is_deleted() for x in before)
