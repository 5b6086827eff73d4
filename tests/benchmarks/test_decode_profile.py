"""benchmarks/profile/decode_profile: one variant's child on CPU with the tiny Gemma 3 shape
(`--shape gemma3-tiny`), the path the GPU's `--shape gemma3-1b` takes; on a CPU the trace holds
no GPU kernels."""
from benchmarks.profile import decode_profile


def test_a_gemma_child_times_its_tokens():
    r = decode_profile.child("gemma3-tiny", 4, "default", None)
    assert r["shape"] == "gemma3-tiny" and r["variant"] == "default" and r["tokens"] == 4
    assert r["decode_tokens_per_s"] > 0 and r["tokens_4_s"] > r["one_token_s"] > 0
    assert r["gpu_us_per_token"] == 0 and r["kernels_per_token"] == 0  # a CPU trace
    assert set(r["compile_s"]) == {"1", "4"}
