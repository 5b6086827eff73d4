"""The readers of small JSON files: `interop.json_io.read_json_object` (each caller's own error class
and wording), `interop.bnb_common.read_config` (a nested text_config unwrapped), the PEFT adapter
config check shared by reading and writing, and `atomic_io`'s writes without fsync."""
from __future__ import annotations

import json

import pytest

from interop import atomic_io
from interop.bnb_common import read_config
from interop.errors import CheckpointError
from interop.json_io import read_json_object
from interop.peft_adapter import AdapterFormatError, check_adapter_config


class Named(ValueError):
    pass


def test_read_json_object_messages(tmp_path):
    f = tmp_path / "x.json"
    with pytest.raises(Named, match=r"x\.json: cannot read: .*No such file"):
        read_json_object(f, Named)
    with pytest.raises(Named, match=r"^gone: .*x\.json$"):
        read_json_object(f, Named, missing="gone: {path}")
    f.write_bytes(b"\xff{}")
    with pytest.raises(Named, match=r"x\.json: cannot read: 'utf-8' codec"):
        read_json_object(f, Named)
    f.write_text('{"a": 1,\n oops}')
    with pytest.raises(Named, match=r"x\.json: cannot read: Expecting property name"):
        read_json_object(f, Named)
    with pytest.raises(Named, match=r"x\.json: bad at 2:2"):
        read_json_object(f, Named, invalid="{path}: bad at {error.lineno}:{error.colno}")
    f.write_text("[1, 2]")
    with pytest.raises(Named, match=r"x\.json: expected a JSON object, got list"):
        read_json_object(f, Named)
    f.write_text('{"n": ' + "9" * 5000 + "}")  # beyond int()'s digit limit: a ValueError, not a syntax error
    with pytest.raises(Named, match="cannot read: Exceeds the limit"):
        read_json_object(f, Named)
    f.write_text('{"a": [1]}')
    assert read_json_object(f, Named) == {"a": [1]}


GEMMA3 = {  # the shape of transformers' Gemma3ForConditionalGeneration config, trimmed
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "vocab_size": 262208, "torch_dtype": "float32"},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
}


def test_read_config_unwraps_a_nested_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    cfg = read_config(tmp_path)
    assert cfg == {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3_text",
                   "hidden_size": 64, "vocab_size": 262208, "torch_dtype": "float32",
                   "quantization_config": GEMMA3["quantization_config"], "vision_config": GEMMA3["vision_config"]}
    assert read_config(tmp_path, unwrap=False) == GEMMA3
    plain = {"model_type": "llama", "vocab_size": 128, "text_config": "not an object"}
    (tmp_path / "config.json").write_text(json.dumps(plain))
    assert read_config(tmp_path) == plain


def test_training_data_check_takes_vocab_size_from_the_one_reader(tmp_path):
    from jqlora.train.data import checkpoint_config, config_vocab_size

    assert checkpoint_config(tmp_path) == {}  # no config.json: nothing to check against
    assert config_vocab_size(checkpoint_config(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    assert config_vocab_size(checkpoint_config(tmp_path)) == 262208  # the nested text_config's
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        checkpoint_config(tmp_path)


def test_adapter_config_check_is_shared_by_write_and_read(tmp_path):
    good = {"r": 4, "lora_alpha": 8, "lora_dropout": None, "use_rslora": False, "target_modules": ["q_proj"]}
    check_adapter_config(good, "a.json")
    for bad, words in [({"r": 0}, "'r' must be a positive integer, got 0"),
                       ({"lora_alpha": float("nan")}, "'lora_alpha' must be a finite number"),
                       ({"lora_dropout": 1.0}, "'lora_dropout' must be a number in [0, 1) or null"),
                       ({"use_rslora": "yes"}, "'use_rslora' must be true, false or null"),
                       ({"target_modules": []}, "'target_modules' must be a non-empty list"),
                       ({"target_modules": "q_proj("}, "'target_modules' regex 'q_proj(' is invalid")]:
        with pytest.raises(AdapterFormatError) as e:
            check_adapter_config({**good, **bad}, "a.json")
        assert str(e.value).startswith("a.json: ") and words in str(e.value)
    from jqlora.adapters import AdapterMismatchError, lora_config_from_peft

    with pytest.raises(AdapterMismatchError, match="a.json: 'r' must be a positive integer"):
        lora_config_from_peft({**good, "r": 0}, "a.json")
    with pytest.raises(AdapterMismatchError, match="a.json: target_modules is missing"):
        lora_config_from_peft({**good, "target_modules": None}, "a.json")
    no_alpha = {k: v for k, v in good.items() if k != "lora_alpha"}
    assert lora_config_from_peft(no_alpha).alpha == 4.0  # alpha defaults to r here


def test_write_without_fsync(tmp_path, monkeypatch):
    def no(*_):
        raise AssertionError("fsync called")

    monkeypatch.setattr(atomic_io, "fsync_file", no)
    monkeypatch.setattr(atomic_io, "fsync_dir", no)
    atomic_io.write_bytes_atomic(tmp_path / "f", b"abc", fsync=False)
    assert (tmp_path / "f").read_bytes() == b"abc" and [p.name for p in tmp_path.iterdir()] == ["f"]
    with pytest.raises(AssertionError, match="fsync called"):
        atomic_io.write_bytes_atomic(tmp_path / "g", b"abc")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # the failed write left nothing
