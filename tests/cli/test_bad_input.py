"""Bad input at load time: every case is refused with one line naming the file and the tensor or
key (exit status 2 from the CLI), never a traceback and never a silently wrong result.

Covers NaN/Inf (and negative scales) in checkpoint tensors and PEFT adapters, malformed
config.json values, PEFT options jqlora cannot apply, and a reader that closes the pipe early
(`jqlora inspect ... --json | head -1`). Checkpoints are real transformers + bitsandbytes ones
(tests/support/checkpoint_factory.py), corrupted in a copy.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from interop import CheckpointError, load_bnb_checkpoint
from interop import safetensors_io as sio
from interop.peft_adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterFormatError, save_peft_adapter
from jqlora import adapters, models
from cli_runner import run_cli

cf = pytest.importorskip("checkpoint_factory")
pytestmark = pytest.mark.torch

GATE = "model.layers.0.mlp.gate_proj"
CHECKPOINTS = {
    "nf4": dict(quant="nf4"),  # double quant: absmax is uint8 codes, nested_absmax float32
    "nf4_flat": dict(quant="nf4", double_quant=False),  # absmax float32
    "int8": dict(quant="int8"),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return lambda name: cf.cached_llama_checkpoint(tmp_path_factory, **CHECKPOINTS[name])


def _rewrite(path: Path, key: str, fn) -> None:
    """Replace tensor `key` of a single-file checkpoint or adapter by fn(old array)."""
    f = path / "model.safetensors" if (path / "model.safetensors").exists() else path / WEIGHTS_NAME
    with sio.open_checkpoint(f) as c:
        tensors = {k: c.get(k, copy=True) for k in c.keys()}
    tensors[key] = fn(tensors[key])
    sio.write_safetensors(f, tensors, {"format": "pt"})


def _set(value, index=3):
    def fn(a):
        a = a.copy()
        a.reshape(-1)[index] = value
        return a
    return fn



def _one_line_error(err: str, *names: str) -> str:
    """The CLI's stderr is exactly one error line that names every one of `names`."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------- NaN / Inf at load
# (checkpoint, tensor key, value put at element 3): every float scale and unquantized tensor.
NONFINITE = {
    "nested_absmax_inf": ("nf4", GATE + ".weight.nested_absmax", np.inf, "NaN or Inf"),
    "absmax_nan": ("nf4_flat", GATE + ".weight.absmax", np.nan, "NaN or Inf"),
    "absmax_negative": ("nf4_flat", GATE + ".weight.absmax", -0.5, "negative"),
    "scb_nan": ("int8", GATE + ".SCB", np.nan, "NaN or Inf"),
    "scb_negative": ("int8", GATE + ".SCB", -1.0, "negative"),
    "plain_norm_nan": ("nf4", "model.norm.weight", np.nan, "NaN or Inf"),
    "plain_embedding_inf": ("int8", "model.embed_tokens.weight", -np.inf, "NaN or Inf"),
    "plain_lm_head_nan": ("nf4_flat", "lm_head.weight", np.nan, "NaN or Inf"),
}


@pytest.mark.parametrize("case", list(NONFINITE))
def test_nonfinite_tensor_is_refused_at_load(ckpt, tmp_path, case):
    name, key, value, what = NONFINITE[case]
    if key.endswith("nested_absmax"):  # the tiny model has one nested group per weight
        value_fn = _set(value, 0)
    else:
        value_fn = _set(value)
    path = cf.copy_checkpoint(ckpt(name), tmp_path / "c")
    _rewrite(path, key, value_fn)
    with pytest.raises(CheckpointError, match=what) as e:
        load_bnb_checkpoint(path)
    msg = str(e.value)
    assert str(path / "model.safetensors") in msg and repr(key) in msg
    assert re.search(r"element \d+", msg)
    with pytest.raises(CheckpointError, match=re.escape(key)):
        models.load_causal_lm(path)


def test_nonfinite_check_can_be_skipped_and_then_nan_flows_through(ckpt, tmp_path):
    """What the check prevents: without it the NaN loads, and every logit is NaN."""
    import jax.numpy as jnp

    path = cf.copy_checkpoint(ckpt("nf4"), tmp_path / "c")
    _rewrite(path, GATE + ".weight.nested_absmax", _set(np.nan, 0))
    params, config = load_bnb_checkpoint(path, check_values=False)
    model = models.from_params(params, config, compute_dtype=jnp.float32)
    logits = np.asarray(model(jnp.asarray([[1, 2, 3]])))
    assert np.isnan(logits).all()


def test_cli_commands_refuse_a_nonfinite_checkpoint(ckpt, tmp_path, capsys):
    path = cf.copy_checkpoint(ckpt("nf4"), tmp_path / "c")
    adapter = _adapter(tmp_path / "adapter", base=path)
    _rewrite(path, GATE + ".weight.nested_absmax", _set(np.nan, 0))
    key = GATE + ".weight.nested_absmax"
    for argv in (["inspect", path], ["inspect", path, "--json"],
                 ["generate", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                 ["import-peft", adapter, "--model", path]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2, (argv, out, err)
        _one_line_error(err, str(path), key, "NaN or Inf")
        assert "OK" not in out + err and "0 0" not in out


# ------------------------------------------------------------------------------ PEFT adapters
TARGETS = ("q_proj", "v_proj")
SHAPES = {"q_proj": (64, 64), "v_proj": (32, 64)}  # (out, in) of the tiny Llama (2 KV heads of 16)


def _adapter(path, *, base=None, rank=2, use_rslora=False, targets=TARGETS, seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            o, i = SHAPES[proj]
            params[f"model.layers.{layer}.self_attn.{proj}"] = {
                "lora_A": (rng.standard_normal((rank, i)) * 0.1).astype(np.float32),
                "lora_B": (rng.standard_normal((o, rank)) * 0.1).astype(np.float32)}
    save_peft_adapter(path, params, rank=rank, alpha=2 * rank, target_modules=targets,
                      base_model_name_or_path=None if base is None else str(base), use_rslora=use_rslora)
    return Path(path)


def _edit_adapter_config(path, **changes):
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg.update(changes)
    (path / CONFIG_NAME).write_text(json.dumps(cfg))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_adapter_tensor_is_refused(ckpt, tmp_path, capsys, value):
    adapter = _adapter(tmp_path / "a")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _rewrite(adapter, key, _set(value))
    with pytest.raises(AdapterFormatError, match="NaN or Inf") as e:
        adapters.load_adapter(adapter)
    assert str(adapter / WEIGHTS_NAME) in str(e.value) and repr(key) in str(e.value)
    rc, out, err = run_cli(capsys, "import-peft", adapter, "--model", ckpt("nf4"))
    assert rc == 2
    _one_line_error(err, str(adapter / WEIGHTS_NAME), key, "NaN or Inf")
    assert "OK" not in out + err and "nan" not in out
    rc, out, err = run_cli(capsys, "generate", ckpt("nf4"), "--adapter", adapter, "--prompt-ids", "1,2",
                           "--max-new-tokens", "2")
    assert rc == 2
    _one_line_error(err, key)


# option set in adapter_config.json -> the option named in the error
UNSUPPORTED = {
    "dora": ({"use_dora": True}, "use_dora"),
    "layers_to_transform": ({"layers_to_transform": [0]}, "layers_to_transform"),
    "layers_to_transform_0": ({"layers_to_transform": 0}, "layers_to_transform"),
    "layers_pattern": ({"layers_pattern": "layers"}, "layers_pattern"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "embedding_lora": ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    "embedding_lora_regex": ({"target_modules": r".*(q_proj|embed_tokens)"}, "embedding LoRA"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    "alpha_pattern": ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
    "bias": ({"bias": "lora_only"}, "bias"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    "trainable_tokens": ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    "exclude_modules": ({"exclude_modules": ["model.layers.0.self_attn.q_proj"]}, "exclude_modules"),
    "layer_replication": ({"layer_replication": [[0, 2]]}, "layer_replication"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_peft_option_is_named(ckpt, tmp_path, capsys, case):
    changes, option = UNSUPPORTED[case]
    adapter = _adapter(tmp_path / "a")
    _edit_adapter_config(adapter, **changes)
    cfg_file = str(adapter / CONFIG_NAME)
    with pytest.raises(ValueError, match="not supported: ") as e:
        adapters.load_adapter(adapter)
    assert option in str(e.value) and cfg_file in str(e.value)
    with pytest.raises(ValueError, match=f"not supported: .*{re.escape(cfg_file)}.*") as e2:
        adapters.lora_config_from_peft(json.loads((adapter / CONFIG_NAME).read_text()), cfg_file)
    assert option in str(e2.value)
    rc, _, err = run_cli(capsys, "import-peft", adapter, "--model", ckpt("nf4"))
    assert rc == 2
    _one_line_error(err, "not supported: ", option, cfg_file)


@pytest.mark.parametrize("key, what", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding LoRA"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "lora_bias"),
])
def test_unsupported_tensor_in_adapter_is_named(tmp_path, key, what):
    """An adapter whose config says nothing, but whose weights file holds a non-LoRA tensor."""
    adapter = _adapter(tmp_path / "a")
    f = adapter / WEIGHTS_NAME
    with sio.open_checkpoint(f) as c:
        tensors = {k: c.get(k, copy=True) for k in c.keys()}
    tensors[key] = np.ones((4,), np.float32)
    sio.write_safetensors(f, tensors, {"format": "pt"})
    with pytest.raises(AdapterFormatError, match=f"not supported: {what}") as e:
        adapters.load_adapter(adapter)
    assert str(f) in str(e.value) and repr(key) in str(e.value)


@pytest.mark.parametrize("changes, key", [
    ({"r": "4"}, "'r'"), ({"r": 0}, "'r'"), ({"lora_alpha": None}, "'lora_alpha'"),
    ({"lora_dropout": "0.1"}, "'lora_dropout'"), ({"lora_dropout": 1.5}, "'lora_dropout'"),
    ({"target_modules": 5}, "'target_modules'"), ({"target_modules": []}, "'target_modules'"),
    ({"target_modules": "q_proj("}, "'target_modules'"), ({"use_rslora": "yes"}, "'use_rslora'"),
    ({"base_model_name_or_path": 7}, "'base_model_name_or_path'"),
])
def test_malformed_adapter_config_value_is_named(tmp_path, changes, key):
    adapter = _adapter(tmp_path / "a")
    _edit_adapter_config(adapter, **changes)
    with pytest.raises(AdapterFormatError) as e:
        adapters.load_adapter(adapter)
    assert str(adapter / CONFIG_NAME) in str(e.value) and key in str(e.value)


def test_supported_options_still_apply(ckpt, tmp_path):
    """rsLoRA, a regex target_modules and dropout load and apply: the logits move, by the
    amount rsLoRA's scale implies (alpha / sqrt(r), against alpha / r without it)."""
    path = ckpt("nf4")
    out = {}
    for rslora in (False, True):
        adapter = _adapter(tmp_path / f"a{rslora}", use_rslora=rslora, rank=4,
                           targets=r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
        _edit_adapter_config(adapter, lora_dropout=0.05)
        cfg, params, _ = adapters.load_adapter(adapter)
        assert (cfg.rank, cfg.alpha, cfg.use_rslora, cfg.dropout) == (4, 8.0, rslora, 0.05)
        out[rslora] = adapters.import_adapter(adapter, path, tokens=4)
        assert len(out[rslora]["matched"]) == 4
        assert out[rslora]["scale"] == pytest.approx(8 / 2 if rslora else 8 / 4)
    assert 0 < out[False]["logits_max_abs_change"] < out[True]["logits_max_abs_change"]


# ------------------------------------------------------------------------------- config.json
def _cfg_edit(fn):
    def apply(path):
        f = path / "config.json"
        cfg = json.loads(f.read_text())
        cfg = fn(cfg)
        f.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return apply


def _pop(*keys):
    def fn(c):
        for k in keys:
            c.pop(k)
        return c
    return fn


def _put(**kv):
    return lambda c: {**c, **kv}


# edit -> words the one-line error must contain (besides the file)
CONFIGS = {
    "top_level_list": (lambda c: [c], ["top level is a JSON list"]),
    "invalid_json": (lambda c: "{oops", ["not valid JSON"]),
    "hidden_null": (_put(hidden_size=None), ["'hidden_size'", "null"]),
    "hidden_string": (_put(hidden_size="64"), ["'hidden_size'", "'64'"]),
    "hidden_float": (_put(hidden_size=64.5), ["'hidden_size'", "64.5"]),
    "heads_zero": (_put(num_attention_heads=0), ["'num_attention_heads'", "0"]),
    "kv_heads_zero": (_put(num_key_value_heads=0), ["'num_key_value_heads'", "0"]),
    "heads_negative": (_put(num_attention_heads=-4), ["'num_attention_heads'", "-4"]),
    "kv_not_dividing": (_put(num_key_value_heads=3), ["'num_key_value_heads'", "(3)"]),
    "heads_not_dividing_hidden": (lambda c: {**_pop("head_dim")(c), "num_attention_heads": 3, "num_key_value_heads": 3},
                                  ["'hidden_size' (64)", "'num_attention_heads' (3)"]),
    "missing_vocab": (_pop("vocab_size"), ["'vocab_size'", "missing"]),
    "missing_layers": (_pop("num_hidden_layers"), ["'num_hidden_layers'", "missing"]),
    "bool_as_string": (_put(tie_word_embeddings="false"), ["'tie_word_embeddings'"]),
    "rope_not_object": (_put(rope_parameters=[1]), ["'rope_parameters'"]),
    "eps_string": (_put(rms_norm_eps="1e-6"), ["'rms_norm_eps'"]),
    "eos_string": (_put(eos_token_id="2"), ["'eos_token_id'"]),
    "model_type_list": (_put(model_type=["llama"]), ["model_type"]),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_json_is_one_line_naming_file_and_key(ckpt, tmp_path, capsys, case):
    edit, words = CONFIGS[case]
    path = cf.copy_checkpoint(ckpt("nf4"), tmp_path / "c")
    _cfg_edit(edit)(path)
    cfg_file = str(path / "config.json")
    with pytest.raises(ValueError) as e:  # CheckpointError or UnsupportedModelError, both ValueErrors
        models.load_causal_lm(path)
    for w in [cfg_file, *words]:
        assert w in str(e.value), (w, str(e.value))
    rc, _, err = run_cli(capsys, "generate", path, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert rc == 2
    _one_line_error(err, cfg_file, *words)


def test_model_config_rejects_values_before_dividing_by_them():
    """ModelConfig.from_hf on its own (no file): the key is named, no ZeroDivisionError/TypeError."""
    base = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=128)
    models.ModelConfig.from_hf(base)
    for bad, key in [({"num_attention_heads": 0}, "num_attention_heads"), ({"hidden_size": None}, "hidden_size"),
                     ({"num_key_value_heads": 0}, "num_key_value_heads"), ({"head_dim": 0}, "head_dim"),
                     ({"intermediate_size": True}, "intermediate_size"), ({"rope_theta": "big"}, "rope_theta")]:
        with pytest.raises(ValueError, match=key):
            models.ModelConfig.from_hf({**base, **bad})
    with pytest.raises(ValueError, match="expected an object"):
        models.ModelConfig.from_hf([base])


# ------------------------------------------------------------------------------- closed stdout
def test_closed_stdout_exits_quietly(ckpt):
    """`jqlora inspect ... --json | head -1`: the reader is gone before the command writes; the
    command exits 141 with nothing on stderr (no BrokenPipeError traceback, no "Exception ignored")."""
    r, w = os.pipe()
    os.close(r)  # the reader went away
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "jqlora.cli", "inspect", str(ckpt("nf4")), "--json"],
                       stdout=w, stderr=subprocess.PIPE, env=env, timeout=120)
    os.close(w)
    assert p.returncode == 141, p.stderr.decode()
    assert p.stderr.decode().strip() == ""
