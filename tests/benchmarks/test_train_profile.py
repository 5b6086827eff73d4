"""benchmarks/profile/train_profile: the trace parsing and kernel attribution behind the
training-step profiles (the GPU run itself is not possible in CI; its parts are)."""
import json

from benchmarks.profile import train_profile as tp

HLO = """
ENTRY %main {
  %custom-call.1 = (bf16[2048,1024]{1,0}, s8[33554432]{0}) custom-call(bf16[2048,4096]{1,0} %x, bf16[1024,4096]{1,0} %w), custom_call_target="__cublas$lt$matmul", metadata={op_name="dot"}
  %wrapped_convert.5 = bf16[14336,16]{1,0} fusion(%b), kind=kLoop, calls=%c5
  %loop_slice_fusion.193 = bf16[2048,16]{1,0} fusion(%xa), kind=kLoop, calls=%c6
  %gemm_fusion_dot_general.1295 = bf16[2048,14336]{1,0} fusion(%loop_slice_fusion.193, %wrapped_convert.5), kind=kCustom, calls=%gemm_fusion_dot_general.1295_computation, metadata={op_name="dot"}
  ROOT %loop_multiply_fusion.32 = bf16[1,2048,14336]{2,1,0} fusion(%g, %gemm_fusion_dot_general.1295), kind=kLoop, calls=%fused_multiply.32, metadata={op_name="mul"}
}
"""


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    ev = lambda name, op, dur, pid=7: {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur,  # noqa: E731
                                       "name": name, "args": {"hlo_op": op}}
    return {"traceEvents": meta + [
        ev("nvjet_sm90_tst_128x256", "custom-call.1", 100.0),
        ev("nvjet_sm90_tst_128x256", "custom-call.1", 100.0),
        ev("gemm_fusion_dot_general_1295", "gemm_fusion_dot_general.1295", 30.0),
        ev("loop_multiply_fusion_32", "loop_multiply_fusion.32", 8.0),
        ev("dequantize_4bit__2", "pallas_call.3", 12.0),
        ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "dot_product_attention_fwd.0", 50.0),
        ev("host_only_thing", "x", 999.0, pid=1),  # a host event: not device time
        {"ph": "X", "pid": 7, "name": "no_duration"},  # malformed: skipped
    ]}


def test_kernel_events_keep_only_gpu_complete_events():
    events = tp.kernel_events(_trace())
    assert len(events) == 6 and all(e["pid"] == 7 for e in events)


def test_gemms_are_split_into_frozen_and_lora_by_operand_shapes():
    lines = tp.hlo_lines(HLO)
    assert tp.result_shape(lines["custom-call.1"]) == "bf16[2048,1024]"
    cat, label = tp.categorize("nvjet_sm90_tst_128x256", "custom-call.1", lines, lora_rank=16)
    assert cat == "gemm frozen/head" and "bf16[2048,1024]" in label
    # a GEMM fusion's operands are names in optimized HLO; their shapes are looked up
    cat, label = tp.categorize("gemm_fusion_dot_general_1295", "gemm_fusion_dot_general.1295", lines, 16)
    assert (cat, label) == ("gemm lora", "gemm lora bf16[2048,14336] bf16[2048,16] bf16[14336,16]")
    # a fusion that only consumes a GEMM's output is a fusion, not a GEMM
    assert tp.categorize("loop_multiply_fusion_32", "loop_multiply_fusion.32", lines, 16)[0] == "xla fusion"


def test_kernels_inside_a_command_buffer_are_named_as_such():
    """The trace names a command buffer as the HLO op of every kernel inside it: no instruction to
    attribute, so the label says why (the profile turns command buffers off by default)."""
    lines = tp.hlo_lines(HLO)
    cat, label = tp.categorize("nvjet_sm90_tst_128x256", "command_buffer_16", lines, 16)
    assert (cat, label) == ("gemm frozen/head", "gemm (inside a command buffer)")
    assert tp.categorize("nvjet_sm90_tst_128x256", "custom-call.404", lines, 16)[1] == "gemm (no HLO line)"


def test_command_buffers_are_turned_off_keeping_the_other_flags():
    flags = tp.without_command_buffers("--xla_gpu_enable_command_buffer=+WHILE --xla_dump_to=/tmp/d")
    assert flags.split() == ["--xla_dump_to=/tmp/d", "--xla_gpu_enable_command_buffer="]
    assert tp.without_command_buffers("") == "--xla_gpu_enable_command_buffer="


def test_summary_is_per_step_and_sums_to_the_device_total():
    res = tp.summarize(tp.kernel_events(_trace()), tp.hlo_lines(HLO), steps=2, lora_rank=16)
    assert res["total_us"] == 150.0  # (200 + 30 + 8 + 12 + 50) / 2 steps
    assert res["by_category_us"] == {"gemm frozen/head": 100.0, "attention": 25.0, "gemm lora": 15.0,
                                     "dequant": 6.0, "xla fusion": 4.0}
    top = res["top_kernels"][0]
    assert top["category"] == "gemm frozen/head" and top["launches_per_step"] == 1.0
    assert top["hlo"].startswith("%custom-call.1 =")
    json.dumps(res)  # what main() writes


def test_main_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The whole script on the CPU test machine: build, bind, trace, parse, write (no GPU
    kernels here, so zero device time)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "")  # main() sets it for its own process; restored after the test
    tp.main(["--shape", "tiny", "--seq", "32", "--attention", "einsum", "--steps", "1"])
    res = json.loads((tmp_path / "train_profile_tiny.json").read_text())
    assert res["xla_flags"] == tp.NO_COMMAND_BUFFERS
    assert res["shape"] == "tiny" and res["steps"] == 1 and len(res["wall_step_s"]) == 1
    assert (tmp_path / "train_profile_tiny.hlo.txt.gz").stat().st_size > 0
