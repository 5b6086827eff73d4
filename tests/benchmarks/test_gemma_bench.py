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


def test_transformers_reads_the_shape_as_the_12b_conversion_writes_it():
    """transformers' reading of the bench's config equals the text config of transformers' own
    Gemma 3 12B conversion (convert_gemma3_weights.py, `_VARIANT_GEMMA_3_12B`, with the 64 image-token
    rows its multimodal checkpoints add to the vocabulary): every field the architecture reads."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.Gemma3TextConfig(
        vocab_size=262_144 + 64, hidden_size=30 * 128, intermediate_size=30 * 128 * 8 // 2, num_attention_heads=16,
        head_dim=256, num_hidden_layers=48, num_key_value_heads=8, sliding_window=1024,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0},
                         "sliding_attention": {"rope_type": "default"}},
        rope_theta=1_000_000, rope_local_base_freq=10_000, attn_logit_softcapping=None, query_pre_attn_scalar=256)
    got = transformers.AutoConfig.for_model(**gemma_bench.config(tiny=False))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "query_pre_attn_scalar", "sliding_window", "layer_types",
            "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention", "bos_token_id",
            "eos_token_id", "pad_token_id")
    assert {k: getattr(got, k) for k in keys} == {k: getattr(ref, k) for k in keys}


def test_the_1b_shape_is_gemma3_1b():
    """The decode benchmark's Gemma 3 1B (width 1152, not a power of two), as transformers reads it
    and as jqlora does: the published text config's fields, 5 sliding (512) : 1 global layers."""
    transformers = pytest.importorskip("transformers")
    c = gemma_bench.config(tiny=False, shape="1b")
    ref = transformers.Gemma3TextConfig(
        vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4, head_dim=256,
        num_hidden_layers=26, num_key_value_heads=1, sliding_window=512, max_position_embeddings=32_768,
        rope_theta=1_000_000, rope_local_base_freq=10_000, attn_logit_softcapping=None, query_pre_attn_scalar=256)
    got = transformers.AutoConfig.for_model(**c)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters", "sliding_window",
            "layer_types", "query_pre_attn_scalar", "final_logit_softcapping", "tie_word_embeddings")
    assert {k: getattr(got, k) for k in keys} == {k: getattr(ref, k) for k in keys}
    from jqlora.models import ModelConfig

    mc = ModelConfig.from_hf(c)
    assert mc.sliding_windows.count(512) == 22 and mc.sliding_windows.count(None) == 4
    assert (mc.hidden_size, mc.head_dim, mc.rope_type) == (1152, 256, "default")


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
