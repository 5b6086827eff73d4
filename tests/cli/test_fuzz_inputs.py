"""Property-based fuzzing of what jqlora reads: truncated and byte-flipped safetensors files of
real bitsandbytes checkpoints (tests/support/checkpoint_factory.py), mutated quant_state JSON inside
them, and random adapter_config.json files.

The invariant, for every generated input: the load either

1. raises a named error: `interop.CheckpointError` (the PEFT errors are subclasses) or
   `jqlora.adapters.AdapterMismatchError`, whose message names the file; or
2. succeeds, and then what it returns is exactly what the bytes say:
   - every tensor equals the reference reader's (the `safetensors` package) decoding of the same
     corrupted file, bit for bit, and no tensor of the file is dropped;
   - every 4-bit quant_state field (shape, quant_type, blocksize, dtype, nested_offset) equals
     the JSON in the file;
   - every float scale (absmax, nested_absmax, SCB) is finite with its sign bit clear (a
     negative subnormal counts as negative) and every unquantized float tensor finite: a flip
     that makes a NaN/Inf must be caught by the load check, and any other flipped value is a
     legal value the file really holds;
   - a file whose header was touched either keeps every tensor name, dtype and shape (so the
     flip landed in padding or metadata), or `load_causal_lm` refuses it with a named error (a
     renamed tensor is missing for the model);
   - an adapter's LoraConfig equals its adapter_config.json and no option jqlora cannot apply
     is in use.

Never another exception type, never a hang (each example runs under an alarm), never a tensor
that differs from what the file holds. Examples are bounded (`max_examples`, `deadline`) so the
file runs in well under a minute on two cores.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from interop import CheckpointError, load_bnb_checkpoint
from interop import safetensors_io as sio
from interop.peft_adapter import (
    CONFIG_NAME,
    PER_MODULE_OPTIONS,
    UNSUPPORTED_OPTIONS,
    WEIGHTS_NAME,
    save_peft_adapter,
)
from jqlora import adapters, models, quant

cf = pytest.importorskip("checkpoint_factory")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.torch

GATE = "model.layers.0.mlp.gate_proj"
BASES = {"nf4": dict(quant="nf4"), "fp4_flat": dict(quant="fp4", double_quant=False), "int8": dict(quant="int8")}
FUZZ = settings(max_examples=80, deadline=timedelta(seconds=20),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NAMED_ERRORS = (CheckpointError, adapters.AdapterMismatchError)


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """Fail an example that runs longer than `seconds` (a hang), instead of blocking the suite."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"load did not finish in {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class _Bases(dict):
    """name -> (original dir, original bytes of model.safetensors, header end, work dir); short
    repr, so that a failing example's report does not print the bytes."""

    def __repr__(self):
        return f"<checkpoints {sorted(self)}>"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = _Bases()
    for name, kw in BASES.items():
        src = cf.cached_llama_checkpoint(tmp_path_factory, **kw)
        data = (src / "model.safetensors").read_bytes()
        work = cf.copy_checkpoint(src, tmp_path_factory.mktemp("fuzz") / name)
        out[name] = (src, data, 8 + int.from_bytes(data[:8], "little"), work)
    return out


def _flat(params) -> dict[str, np.ndarray]:
    """Loaded params as {tensor key on disk: numpy array} (4-bit packed codes as uint8)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, quant.Weight4bit):
            w = k + ".weight"
            out[w], out[w + ".absmax"], out[w + ".quant_map"] = (np.asarray(v.packed), np.asarray(v.absmax),
                                                                 np.asarray(v.code))
            if v.nested:
                out[w + ".nested_absmax"], out[w + ".nested_quant_map"] = (np.asarray(v.nested_absmax),
                                                                           np.asarray(v.nested_code))
        elif isinstance(v, quant.Int8Weight):
            out[k + ".weight"], out[k + ".SCB"] = np.asarray(v.cb), np.asarray(v.scb)
        else:
            out[k] = np.asarray(v)
    return out


def _is_scale(key: str) -> bool:
    return key.endswith((".absmax", ".nested_absmax", ".SCB"))


def _assert_faithful(params, file: Path):
    """Case 2 of the module docstring: params are the reference reader's decoding of `file`."""
    ref = safetensors_numpy.load_file(str(file))  # we accepted it: the reference must too
    flat = _flat(params)
    metadata_keys = {k for k in ref if ".quant_state." in k or k.endswith(".weight_format")}
    assert set(flat) | metadata_keys == set(ref), "a tensor was dropped or invented"
    for k, got in flat.items():
        want = ref[k]
        if got.dtype == np.uint8 and want.dtype != np.uint8:  # 4-bit codes stored as another dtype
            want = want.reshape(-1).view(np.uint8)
        assert got.shape == want.reshape(got.shape).shape and got.dtype == want.dtype, k
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{k} differs from the file"
        if got.dtype.kind == "f":
            assert np.isfinite(got).all(), f"{k}: non-finite value loaded"
            if _is_scale(k):
                assert not np.signbit(got).any(), f"{k}: negative scale loaded"
    for k in (k for k in ref if ".quant_state.bitsandbytes__" in k):
        state = json.loads(ref[k].tobytes().decode("utf-8"))
        q = params[k.split(".weight.quant_state.")[0]]
        assert (list(q.shape), q.quant_type, q.blocksize, q.stored_dtype) == (
            state["shape"], state["quant_type"], state["blocksize"], state["dtype"]), k
        if "nested_offset" in state:
            offset = np.asarray(q.offset)
            assert np.isfinite(offset) and float(offset) == np.float32(state["nested_offset"]), k
    return ref


def _assert_named(err: BaseException, *names):
    msg = str(err)
    assert "\n" not in msg.strip(), msg
    assert any(str(n) in msg for n in names), (names, msg)


def _load(path, original_file: Path | None = None):
    """Load `path` under the invariant; returns params or None (a named error)."""
    try:
        with no_hang():
            params, _ = load_bnb_checkpoint(path)
    except NAMED_ERRORS as e:
        _assert_named(e, path)
        event(f"refused: {type(e).__name__}")
        return None
    event("loaded")
    ref = _assert_faithful(params, path / "model.safetensors")
    if original_file is not None:
        orig = sio.read_header(original_file)[0]
        now = sio.read_header(path / "model.safetensors")[0]
        same = {k: (i.dtype, i.shape) for k, i in orig.items()} == {k: (i.dtype, i.shape) for k, i in now.items()}
        event("header changed, same tensors" if same else "header changed, tensors renamed")
        if not same:  # a renamed / retyped tensor: the model must refuse it by name
            with no_hang(), pytest.raises((KeyError, ValueError)) as e:
                models.load_causal_lm(path)
            msg = str(e.value.args[0] if isinstance(e.value, KeyError) else e.value)
            assert any(k in msg for k in set(orig) ^ set(now)) or str(path) in msg, msg
    return params, ref


# ------------------------------------------------------------------------------ safetensors files
@pytest.mark.parametrize("name", list(BASES))
@FUZZ
@given(data=st.data())
def test_truncated_or_extended_checkpoint_files(base, name, data):
    """A file cut short, or with bytes appended (a concatenated or partly overwritten download)."""
    src, blob, _, work = base[name]
    which = data.draw(st.sampled_from(["model.safetensors", "config.json"]), label="file")
    full = blob if which == "model.safetensors" else (src / "config.json").read_bytes()
    if data.draw(st.booleans(), label="extend"):
        new = full + data.draw(st.binary(min_size=1, max_size=64), label="appended")
    else:
        new = full[:data.draw(st.integers(0, len(full) - 1), label="length")]
    (work / "model.safetensors").write_bytes(blob)
    (work / "config.json").write_bytes((src / "config.json").read_bytes())
    (work / which).write_bytes(new)
    out = _load(work)
    if out is not None:  # only a config.json that gained or lost whitespace still parses
        assert which == "config.json" and new.strip() == full.strip()


# The two high bytes (little-endian) of a float32 element: Inf, -Inf, two NaNs, -1.0, -0.0.
_SPECIAL_HIGH_BYTES = [(0x80, 0x7f), (0x80, 0xff), (0xc0, 0x7f), (0xff, 0xff), (0x80, 0xbf), (0x00, 0x80)]


@pytest.mark.parametrize("name", list(BASES))
@FUZZ
@given(data=st.data())
def test_byte_flips_in_checkpoint_files(base, name, data):
    """Random xor flips anywhere (length prefix, header, data), plus overwrites of the high bytes
    of a float32 element (the flips that make a NaN, an Inf or a negative scale)."""
    src, blob, header_end, work = base[name]
    flips = data.draw(st.lists(st.tuples(st.sampled_from(["length", "header", "data", "float"]),
                                         st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                               min_size=1, max_size=3), label="flips")
    buf = bytearray(blob)
    spans = {"length": (0, 8), "header": (8, header_end), "data": (header_end, len(blob))}
    floats = [i for i in sio.read_header(src / "model.safetensors")[0].values() if i.dtype == "F32"]
    for region, frac, xor in flips:
        if region == "float":  # element int(frac * n) of one float32 tensor, chosen by xor
            info = floats[xor % len(floats)]
            at = info.start + 4 * int(frac * (info.nbytes // 4))
            buf[at + 2: at + 4] = bytes(data.draw(st.sampled_from(_SPECIAL_HIGH_BYTES)
                                                  | st.tuples(st.integers(0, 255), st.integers(0, 255)),
                                                  label="high bytes"))
        else:
            lo, hi = spans[region]
            buf[lo + int(frac * (hi - lo))] ^= xor
    (work / "model.safetensors").write_bytes(bytes(buf))
    (work / "config.json").write_bytes((src / "config.json").read_bytes())
    out = _load(work, src / "model.safetensors")
    if out is not None and buf[:header_end] == blob[:header_end]:
        params, ref = out
        orig = safetensors_numpy.load_file(str(src / "model.safetensors"))
        for k, info in sio.read_header(src / "model.safetensors")[0].items():
            # a tensor whose bytes were not touched is unchanged
            if buf[info.start: info.end] == blob[info.start: info.end]:
                assert ref[k].tobytes() == orig[k].tobytes(), k


# ------------------------------------------------------------------------------ quant_state JSON
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=4)
# Values a quant_state field could plausibly hold: some legal (a load that must be faithful),
# most wrong in one way (a float32 overflow, a transposed or flattened shape, a bad blocksize).
_QS_VALUES = st.sampled_from([64, 128, 256, 4096, 0, -64, "nf4", "fp4", "float16", "bfloat16", "float32", "int8",
                              [128, 64], [64, 128], [8192], [2, 64, 64], [0, 64], 0.5, 0.0125, 1e39, -1e-3]) | _JSON
_QS_FIELDS = ["quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset", "x"]


@pytest.mark.parametrize("name", ["nf4", "fp4_flat"])
@FUZZ
@given(data=st.data())
def test_mutated_quant_state_json(base, name, data):
    src, _, _, work = base[name]
    with sio.open_checkpoint(src / "model.safetensors") as c:
        tensors = {k: c.get(k, copy=True) for k in c.keys()}
    qs = next(k for k in tensors if k.startswith(GATE + ".weight.quant_state."))
    raw = tensors[qs].tobytes()
    kind = data.draw(st.sampled_from(["truncate", "flip", "field", "legal", "offset", "replace"]), label="kind")
    if kind == "truncate":
        new = raw[:data.draw(st.integers(0, len(raw) - 1), label="length")]
    elif kind == "flip":
        buf = bytearray(raw)
        for pos, xor in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)),
                                           min_size=1, max_size=3), label="flips"):
            buf[pos] ^= xor
        new = bytes(buf)
    elif kind == "field":
        state = json.loads(raw)
        for field, value in data.draw(st.lists(st.tuples(st.sampled_from(_QS_FIELDS), st.none() | _QS_VALUES),
                                               min_size=1, max_size=3), label="edits"):
            if value is None and data.draw(st.booleans(), label="delete"):
                state.pop(field, None)
            else:
                state[field] = value
        new = json.dumps(state).encode()
    elif kind == "legal":  # a value bitsandbytes could have written: the load must return it
        state = json.loads(raw)
        state["dtype"] = data.draw(st.sampled_from(["float16", "bfloat16", "float32"]), label="dtype")
        if "nested_offset" in state:
            state["nested_offset"] = data.draw(st.floats(-2.0 ** 100, 2.0 ** 100, width=32, allow_subnormal=False),
                                               label="offset")
        new = json.dumps(state).encode()
    elif kind == "offset":  # any float, around float32's largest (3.4028235e38) in particular
        state = json.loads(raw)
        state["nested_offset"] = data.draw(st.floats() | st.sampled_from([3.4028235e38, 3.4028236e38, 1e39, -1e39]),
                                           label="offset")
        new = json.dumps(state).encode()
    else:
        new = json.dumps(data.draw(_JSON, label="json")).encode()
    tensors[qs] = np.frombuffer(new, np.uint8).copy()
    sio.write_safetensors(work / "model.safetensors", tensors, {"format": "pt"})
    (work / "config.json").write_bytes((src / "config.json").read_bytes())
    try:
        with no_hang():
            params, _ = load_bnb_checkpoint(work)
    except NAMED_ERRORS as e:
        _assert_named(e, work)
        assert GATE in str(e), str(e)
        event(f"{kind}: refused")
        return
    event(f"{kind}: loaded")
    _assert_faithful(params, work / "model.safetensors")


# ------------------------------------------------------------------------------ adapter configs
_ADAPTER_KEYS = ["peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
                 "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern", "modules_to_save",
                 "bias", "lora_bias", "fan_in_fan_out", "base_model_name_or_path", "exclude_modules",
                 "trainable_token_indices", "init_lora_weights", "task_type", "something_new"]
_ADAPTER_VALUES = st.none() | _JSON | st.sampled_from(
    ["LORA", 2, 4, 8, 16.0, 0.05, ["q_proj", "v_proj"], ["q_proj"], "q_proj", r".*\.(q|v)_proj", "embed_tokens",
     ["embed_tokens"], "none", "all", True, False, {"q_proj": 2}, [0, 1], "layers", "[", "(a"])


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    params = {f"model.layers.{i}.self_attn.{p}": {"lora_A": rng.standard_normal((2, 64)).astype(np.float32),
                                                  "lora_B": rng.standard_normal((o, 2)).astype(np.float32)}
              for i in range(2) for p, o in (("q_proj", 64), ("v_proj", 32))}
    path = tmp_path_factory.mktemp("adapter") / "a"
    save_peft_adapter(path, params, rank=2, alpha=4, target_modules=["q_proj", "v_proj"])
    return path, params


@FUZZ
@given(data=st.data())
def test_random_adapter_configs(adapter_dir, data):
    path, saved = adapter_dir
    cfg_file = path / CONFIG_NAME
    original = json.loads(cfg_file.read_text())
    kind = data.draw(st.sampled_from(["edit", "edit", "edit", "json", "bytes"]), label="kind")
    if kind == "edit":
        cfg = dict(original)
        for key, value in data.draw(st.lists(st.tuples(st.sampled_from(_ADAPTER_KEYS), _ADAPTER_VALUES),
                                             min_size=1, max_size=4), label="edits"):
            if value is None and data.draw(st.booleans(), label="delete"):
                cfg.pop(key, None)
            else:
                cfg[key] = value
        text = json.dumps(cfg)
    elif kind == "json":
        cfg = data.draw(_JSON, label="json")
        text = json.dumps(cfg)
    else:
        cfg, text = None, data.draw(st.binary(max_size=64), label="bytes").decode("latin-1")
    try:
        cfg_file.write_text(text, encoding="latin-1" if kind == "bytes" else "utf-8")
        try:
            with no_hang():
                lora_cfg, params, raw = adapters.load_adapter(path)
        except NAMED_ERRORS as e:
            _assert_named(e, cfg_file, path / WEIGHTS_NAME)
            event(f"{kind}: refused, {'not supported' if 'not supported' in str(e) else 'malformed'}")
            return
    finally:
        cfg_file.write_text(json.dumps(original))
    event(f"{kind}: loaded")
    # it loaded: the LoraConfig is what the file says, and nothing jqlora ignores is in use
    assert json.dumps(raw) == json.dumps(cfg) and raw["peft_type"] == "LORA"
    r = raw["r"]
    assert lora_cfg.rank == r and lora_cfg.alpha == float(raw.get("lora_alpha", r))
    assert lora_cfg.dropout == float(raw.get("lora_dropout") or 0.0)
    assert lora_cfg.use_rslora == bool(raw.get("use_rslora"))
    targets = raw["target_modules"]
    assert lora_cfg.target_modules == (targets if isinstance(targets, str) else tuple(targets))
    for key, _ in UNSUPPORTED_OPTIONS + PER_MODULE_OPTIONS:
        assert raw.get(key) in (None, False, "", [], {}, "none"), key
    for m, pair in saved.items():
        for w in ("lora_A", "lora_B"):
            np.testing.assert_array_equal(params[m][w], pair[w])
    assert math.isfinite(lora_cfg.alpha)
