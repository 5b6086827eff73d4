"""PEFT adapter directories: round trip, real PEFT 0.21 interop both ways, one test per error."""
from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from interop.peft_adapter import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterFormatError,
    load_peft_adapter,
    save_peft_adapter,
)

HIDDEN, INTER, KV = 64, 128, 32  # tiny Llama: 4 heads of 16, 2 kv heads -> k/v_proj out = 32
TARGETS = ["q_proj", "v_proj", "down_proj"]
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "v_proj": (KV, HIDDEN), "down_proj": (HIDDEN, INTER)}  # (out, in)


def _module_name(layer: int, proj: str) -> str:
    part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{part}.{proj}"


def _random_lora(rank=4, seed=0, layers=2, dtype=np.float32, targets=TARGETS):
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(layers):
        for proj in targets:
            o, i = SHAPES[proj]
            out[_module_name(layer, proj)] = {
                "lora_A": (rng.standard_normal((rank, i)) * 0.1).astype(dtype),
                "lora_B": (rng.standard_normal((o, rank)) * 0.1).astype(dtype),
            }
    return out


# ------------------------------------------------------------------------------------ round trips
def test_round_trip_numpy_and_jax(tmp_path):
    params = _random_lora()
    params["model.layers.1.self_attn.q_proj"] = {k: jnp.asarray(v) for k, v in params["model.layers.1.self_attn.q_proj"].items()}
    out = tmp_path / "adapter"
    save_peft_adapter(out, params, rank=4, alpha=8, target_modules=TARGETS, base_model_name_or_path="tiny-llama")
    assert sorted(os.listdir(out)) == [CONFIG_NAME, WEIGHTS_NAME]
    loaded, config = load_peft_adapter(out)
    assert set(loaded) == set(params)
    for m, pair in params.items():
        for k in ("lora_A", "lora_B"):
            assert loaded[m][k].dtype == np.float32
            np.testing.assert_array_equal(loaded[m][k], np.asarray(pair[k]))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted(TARGETS) and config["base_model_name_or_path"] == "tiny-llama"
    assert config["use_rslora"] is False and config["task_type"] == "CAUSAL_LM" and config["fan_in_fan_out"] is False
    # Key names and dtypes on disk are PEFT's.
    from safetensors.numpy import load_file

    on_disk = load_file(out / WEIGHTS_NAME)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in on_disk
    assert on_disk["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (HIDDEN, 4)
    assert all(v.dtype == np.float32 for v in on_disk.values())


def test_bf16_arrays_saved_as_exact_float32(tmp_path):
    params = _random_lora(layers=1, targets=["q_proj"])
    bf = {m: {k: jnp.asarray(v, jnp.bfloat16) for k, v in p.items()} for m, p in params.items()}
    save_peft_adapter(tmp_path / "a", bf, rank=4, alpha=16, target_modules=["q_proj"], use_rslora=True)
    loaded, config = load_peft_adapter(tmp_path / "a")
    m = "model.layers.0.self_attn.q_proj"
    assert loaded[m]["lora_A"].dtype == np.float32
    np.testing.assert_array_equal(loaded[m]["lora_A"], np.asarray(bf[m]["lora_A"]).astype(np.float32))
    assert config["use_rslora"] is True


def test_overwrite_existing_directory_keeps_other_files(tmp_path):
    out = tmp_path / "adapter"
    save_peft_adapter(out, _random_lora(seed=1), rank=4, alpha=8, target_modules=TARGETS)
    (out / "README.md").write_text("mine")
    new = _random_lora(seed=2)
    save_peft_adapter(out, new, rank=4, alpha=8, target_modules=TARGETS)
    loaded, _ = load_peft_adapter(out)
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.q_proj"]["lora_A"], new["model.layers.0.self_attn.q_proj"]["lora_A"])
    assert (out / "README.md").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no temp dir left


def test_adapter_file_is_what_safetensors_writes(tmp_path):
    """The weights file is standard: the safetensors package reads it, and writing the same
    tensors with safetensors.numpy.save_file gives the same bytes."""
    from safetensors.numpy import load_file, save_file

    params = _random_lora(seed=4)
    save_peft_adapter(tmp_path / "ours", params, rank=4, alpha=8, target_modules=TARGETS)
    ours = tmp_path / "ours" / WEIGHTS_NAME
    on_disk = load_file(ours)
    assert len(on_disk) == 2 * len(params)
    for m, pair in params.items():
        for k, v in pair.items():
            np.testing.assert_array_equal(on_disk[f"base_model.model.{m}.{k}.weight"], v)
    save_file(on_disk, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import interop.peft_adapter as pa

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pa, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(tmp_path / "adapter", _random_lora(), rank=4, alpha=8, target_modules=TARGETS)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, params_fn, match",
    [
        (dict(rank=8), None, r"model\.layers\.0\.self_attn\.q_proj: lora_A has shape \(4, 64\)"),
        (dict(target_modules=["k_proj"]), None, "not matched by target_modules"),
        (dict(rank=0), None, r"adapter_config\.json: 'r' must be a positive integer, got 0"),
        (dict(bias="all"), None, "bias"),
        ({}, lambda p: {"model.layers.0.self_attn.q_proj": {"lora_A": p["model.layers.0.self_attn.q_proj"]["lora_A"]}}, "exactly the keys"),
        ({}, lambda p: {"model.layers.0.self_attn.q_proj": {"lora_A": np.zeros((4, 64), np.int32), "lora_B": np.zeros((64, 4))}}, "floating-point"),
        ({}, lambda p: {"base_model.model.model.layers.0.self_attn.q_proj": p["model.layers.0.self_attn.q_proj"]}, "invalid module name"),
    ],
)
def test_save_rejects_bad_input_and_writes_nothing(tmp_path, kwargs, params_fn, match):
    params = _random_lora()
    if params_fn is not None:
        params = params_fn(params)
    args = dict(rank=4, alpha=8, target_modules=TARGETS)
    args.update(kwargs)
    with pytest.raises(AdapterFormatError, match=match):
        save_peft_adapter(tmp_path / "adapter", params, **args)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------- load: one test per error
@pytest.fixture
def saved(tmp_path):
    out = tmp_path / "adapter"
    save_peft_adapter(out, _random_lora(), rank=4, alpha=8, target_modules=TARGETS)
    return out


def _rewrite_tensors(path, fn):
    from safetensors.numpy import load_file, save_file

    tensors = dict(load_file(path / WEIGHTS_NAME))
    tensors = fn(tensors)
    save_file(tensors, path / WEIGHTS_NAME, metadata={"format": "pt"})


def _rewrite_config(path, **changes):
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg.update(changes)
    (path / CONFIG_NAME).write_text(json.dumps(cfg))


def test_error_is_a_value_error():
    assert issubclass(AdapterFormatError, ValueError)


def test_load_missing_config(saved):
    (saved / CONFIG_NAME).unlink()
    with pytest.raises(AdapterFormatError, match=r"adapter_config\.json: missing"):
        load_peft_adapter(saved)


def test_load_malformed_json(saved):
    (saved / CONFIG_NAME).write_text('{\n  "peft_type": "LORA",\n  "r": 4,,\n}')
    with pytest.raises(AdapterFormatError, match=r"adapter_config\.json: malformed JSON at line 3"):
        load_peft_adapter(saved)


def test_load_not_lora(saved):
    _rewrite_config(saved, peft_type="IA3")
    with pytest.raises(AdapterFormatError, match=r"adapter_config\.json: peft_type is 'IA3'"):
        load_peft_adapter(saved)


def test_load_missing_weights_file(saved):
    (saved / WEIGHTS_NAME).unlink()
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.safetensors: missing"):
        load_peft_adapter(saved)


def test_load_lora_a_without_lora_b(saved):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _rewrite_tensors(saved, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(AdapterFormatError, match=r"model\.layers\.1\.self_attn\.v_proj\.lora_A\.weight has no matching lora_B"):
        load_peft_adapter(saved)


def test_load_lora_b_without_lora_a(saved):
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    _rewrite_tensors(saved, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(AdapterFormatError, match=r"down_proj\.lora_B\.weight has no matching lora_A"):
        load_peft_adapter(saved)


def test_load_rank_mismatch_with_config(saved):
    _rewrite_config(saved, r=8)
    with pytest.raises(AdapterFormatError, match=r"model\.layers\.0\.mlp\.down_proj: lora_A has shape \(4, 128\).*r=8"):
        load_peft_adapter(saved)


def test_load_rank_mismatch_between_a_and_b(saved):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def fn(t):
        t[key] = np.zeros((HIDDEN, 3), np.float32)
        return t

    _rewrite_tensors(saved, fn)
    with pytest.raises(AdapterFormatError, match=r"q_proj: lora_A has shape \(4, 64\) and lora_B has shape \(64, 3\)"):
        load_peft_adapter(saved)


@pytest.mark.parametrize(
    "bad_key",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",  # DoRA
        "base_model.model.model.layers.0.self_attn.q_proj.bias",  # bias="all"
        "base_model.model.lm_head.modules_to_save.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",  # missing the PEFT prefix
    ],
)
def test_load_unknown_key(saved, bad_key):
    def fn(t):
        t[bad_key] = np.zeros((4,), np.float32)
        return t

    _rewrite_tensors(saved, fn)
    with pytest.raises(AdapterFormatError, match="unknown tensor key '" + bad_key.replace(".", r"\.") + "'"):
        load_peft_adapter(saved)


def test_load_accepts_default_adapter_name_and_bf16(saved):
    """Keys as in a live PeftModel.state_dict() (`.default.`) and BF16 tensors are read too."""

    def fn(t):
        return {k.replace(".weight", ".default.weight"): v for k, v in t.items()}

    ref, _ = load_peft_adapter(saved)
    _rewrite_tensors(saved, fn)
    loaded, _ = load_peft_adapter(saved)
    for m in ref:
        np.testing.assert_array_equal(loaded[m]["lora_A"], ref[m]["lora_A"])
    # BF16 on disk (what PEFT writes for a bf16 model); safetensors.numpy cannot write it, so
    # write the file by hand from the format spec (u64 header length, JSON header, raw data).
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for m, pair in ref.items():
        for k, v in pair.items():
            data = v.astype(ml_dtypes.bfloat16).tobytes()
            header[f"base_model.model.{m}.{k}.weight"] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
    hdr = json.dumps(header).encode()
    hdr += b" " * (-len(hdr) % 8)
    (saved / WEIGHTS_NAME).write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"".join(blobs))
    loaded, _ = load_peft_adapter(saved)
    m = "model.layers.0.self_attn.q_proj"
    assert loaded[m]["lora_A"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(loaded[m]["lora_A"], ref[m]["lora_A"].astype(ml_dtypes.bfloat16))


def test_load_truncated_weights_file(saved):
    data = (saved / WEIGHTS_NAME).read_bytes()
    (saved / WEIGHTS_NAME).write_bytes(data[:-4])
    with pytest.raises(AdapterFormatError, match=r"not a valid safetensors file: .*adapter_model\.safetensors.*truncated"):
        load_peft_adapter(saved)


def test_load_integer_tensor(saved):
    _rewrite_tensors(saved, lambda t: {k: (v * 100).astype(np.int32) if "q_proj.lora_A" in k else v for k, v in t.items()})
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.safetensors: tensor '.*q_proj\.lora_A\.weight' has dtype I32"):
        load_peft_adapter(saved)


def test_load_rank_pattern(saved):
    """Per-module ranks from rank_pattern (PEFT's suffix-regex rule) are honoured."""
    _rewrite_config(saved, r=8, rank_pattern={"q_proj": 4, "v_proj": 4, r"mlp\.down_proj": 4})
    loaded, _ = load_peft_adapter(saved)
    assert len(loaded) == 6


# ------------------------------------------------------------------------------- real PEFT interop
def _tiny_llama(seed=0):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _get(model, dotted):
    mod = model
    for part in dotted.split("."):
        mod = getattr(mod, part)
    return mod


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_peft_save_pretrained_is_read_by_us(tmp_path):
    base = _tiny_llama()
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    torch.manual_seed(1)
    expected = {}
    with torch.no_grad():
        for layer in range(2):
            for proj in TARGETS:
                name = _module_name(layer, proj)
                mod = _get(model.base_model.model, name)
                mod.lora_A["default"].weight.normal_()
                mod.lora_B["default"].weight.normal_()  # PEFT initialises B to zero
                expected[name] = {
                    "lora_A": mod.lora_A["default"].weight.numpy().copy(),
                    "lora_B": mod.lora_B["default"].weight.numpy().copy(),
                }
    model.save_pretrained(tmp_path / "peft")
    loaded, config = load_peft_adapter(tmp_path / "peft")
    assert set(loaded) == set(expected)
    for name, pair in expected.items():
        for k in ("lora_A", "lora_B"):
            assert loaded[name][k].shape == pair[k].shape
            np.testing.assert_array_equal(loaded[name][k], pair[k])
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == sorted(TARGETS)


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("use_rslora", [False, True])
def test_our_adapter_loads_in_peft(tmp_path, use_rslora):
    base = _tiny_llama()
    import torch
    from peft import PeftModel

    rank, alpha = 4, 8
    params = _random_lora(rank=rank, seed=3)
    save_peft_adapter(tmp_path / "ours", params, rank=rank, alpha=alpha, target_modules=TARGETS, use_rslora=use_rslora)

    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits.clone()
    q_proj_base = _get(base, "model.layers.0.self_attn.q_proj").weight.detach().numpy().copy()

    model = PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    for name, pair in params.items():
        mod = _get(model.base_model.model, name)
        np.testing.assert_array_equal(mod.lora_A["default"].weight.detach().numpy(), pair["lora_A"])
        np.testing.assert_array_equal(mod.lora_B["default"].weight.detach().numpy(), pair["lora_B"])
        assert mod.scaling["default"] == pytest.approx(scale)
    # Orientation and scaling as PEFT applies them: y = x W^T + s x A^T B^T.
    mod = _get(model.base_model.model, "model.layers.0.self_attn.q_proj")
    x = np.random.default_rng(0).standard_normal((3, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        y = mod(torch.from_numpy(x)).numpy()
    p = params["model.layers.0.self_attn.q_proj"]
    want = x @ q_proj_base.T + scale * (x @ p["lora_A"].T) @ p["lora_B"].T
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        lora_logits = model(ids).logits
    assert not torch.allclose(lora_logits, base_logits, atol=1e-3)
