"""interop: safetensors I/O, bitsandbytes checkpoint load/save, against real transformers +
bitsandbytes checkpoints built on CPU (tests/support/checkpoint_factory.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

import checkpoint_factory as cf  # noqa: E402
import interop  # noqa: E402
from interop import CheckpointError, load_bnb_checkpoint, save_bnb_checkpoint  # noqa: E402
from interop import safetensors_io as sio  # noqa: E402
from jqlora import quant  # noqa: E402

pytestmark = pytest.mark.torch

BIG = dict(hidden_size=128, intermediate_size=256)  # in_features divisible by blocksize 128
CHECKPOINTS = {
    "nf4": dict(quant="nf4", double_quant=True),
    "fp4": dict(quant="fp4", double_quant=False, blocksize=128, dtype=torch.bfloat16, config_overrides=BIG),
    "int8": dict(quant="int8"),
    "sharded": dict(quant="nf4", double_quant=True, shard_size=20_000),
    "storage": dict(quant="nf4", double_quant=False, dtype=torch.float16, quant_storage=torch.bfloat16),
}
GATE = "model.layers.0.mlp.gate_proj"  # (128, 64): not square


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return lambda name: cf.cached_llama_checkpoint(tmp_path_factory, **CHECKPOINTS[name])


@pytest.fixture(scope="session")
def loaded(ckpt):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_bnb_checkpoint(ckpt(name))
        return cache[name]

    return get






def _dequant_like_bnb(q):
    """jqlora dequantization in the dtype bitsandbytes returns (4-bit: stored dtype; int8: fp32).

    The nested absmax is de-nested eagerly: under jax.jit XLA fuses `dyn[q] * nested_absmax +
    offset` into an FMA on CPU, which changes the last bit of some scales. The rest (one multiply
    and one rounding) is jitted, because eager JAX compiles every op for every new shape (slow).
    """
    if isinstance(q, quant.Weight4bit):
        flat = dataclasses.replace(q, absmax=quant.absmax_f32(q), nested_absmax=None, nested_code=None, offset=None)
        return np.asarray(_dq(flat, jnp.dtype(q.stored_dtype)))
    return np.asarray(_dq(q, jnp.float32))


_dq = jax.jit(quant.dequantize, static_argnums=(1,))
_q4 = jax.jit(quant.quantize_4bit, static_argnums=(1, 2, 3))  # only compared with itself


# ------------------------------------------------------------------------------------------
# safetensors I/O

ALL_DTYPES = {name: dt for name, dt in sio.DTYPES.items()}


def _sample_tensors():
    rng = np.random.default_rng(0)
    t = {f"t.{name}": rng.integers(0, 100, size=(3, i + 1)).astype(dt) for i, (name, dt) in enumerate(ALL_DTYPES.items())}
    t["scalar"] = np.array(7, np.uint8)
    t["empty"] = np.zeros((0, 4), np.float32)
    return t


def test_writer_is_byte_identical_to_safetensors(tmp_path):
    from safetensors.numpy import save_file

    t = _sample_tensors()
    save_file(t, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    sio.write_safetensors(tmp_path / "mine.safetensors", t, {"format": "pt"})
    assert (tmp_path / "ref.safetensors").read_bytes() == (tmp_path / "mine.safetensors").read_bytes()
    with sio.open_checkpoint(tmp_path / "ref.safetensors") as c:
        assert set(c.keys()) == set(t)
        for k, v in t.items():
            assert cf.same_bits(c.get(k), v), k
    assert sorted(os.listdir(tmp_path)) == ["mine.safetensors", "ref.safetensors"]  # no temp litter


def _raw_file(path, header: dict | bytes, data: bytes, n_override=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if n_override is None else n_override
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.mark.parametrize(
    "header, data, n_override, pattern",
    [
        (b"{not json", b"", None, r"not valid UTF-8 JSON"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10_000, r"header length 10000 runs past"),
        ({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"tensor 'w'.*unknown or unsupported dtype 'F33'"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, r"tensor 'w'.*needs 12"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, r"tensor 'w'.*truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, r"tensor 'b'.*overlap tensor 'a'"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, None, r"tensor 'b'.*hole"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, None, r"trailing bytes"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, r"tensor 'a'.*shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, None, r"tensor 'a'.*data_offsets"),
        (b"[1, 2]", b"", None, r"JSON list"),
    ],
)
def test_reader_rejects_corrupt_files(tmp_path, header, data, n_override, pattern):
    p = _raw_file(tmp_path / "bad.safetensors", header, data, n_override)
    with pytest.raises(CheckpointError, match=pattern) as e:
        sio.open_checkpoint(p)
    assert str(p) in str(e.value)


def test_reader_rejects_tiny_file(tmp_path):
    p = tmp_path / "tiny.safetensors"
    p.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match="too short"):
        sio.open_checkpoint(p)


def test_sharded_writer_and_index(tmp_path):
    t = {f"k{i}": np.full((100,), i, np.float32) for i in range(6)}
    files = sio.write_sharded_safetensors(tmp_path, t, {"format": "pt"}, max_shard_bytes=900,
                                          groups=[["k1", "k2", "k3"]])
    index = json.loads((tmp_path / sio.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 2400
    wm = index["weight_map"]
    assert wm["k1"] == wm["k2"] == wm["k3"]
    assert len(files) == len(set(wm.values())) + 1
    with sio.open_checkpoint(tmp_path) as c:
        for k, v in t.items():
            assert cf.same_bits(c.get(k), v)


# ------------------------------------------------------------------------------------------
# load: real checkpoints vs bitsandbytes

@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_load_matches_bitsandbytes(ckpt, loaded, name):
    path = ckpt(name)
    params, config = loaded(name)
    assert config == json.loads((path / "config.json").read_text())
    ref = cf.bnb_reference_weights(path)
    tensors = cf.torch_tensors(path)
    assert len(ref) == 14  # 7 linears x 2 layers; lm_head stays dense
    kind = quant.Int8Weight if name == "int8" else quant.Weight4bit
    assert {k for k, v in params.items() if isinstance(v, (quant.Weight4bit, quant.Int8Weight))} == set(ref)
    for m, w in ref.items():
        q = params[m]
        assert isinstance(q, kind)
        assert q.shape == tuple(w.shape)
        assert cf.same_bits(_dequant_like_bnb(q), cf.tensor_to_numpy(w)), m
    if name == "int8":
        for m in ref:
            assert params[m].threshold == 6.0
            assert cf.same_bits(params[m].cb, cf.tensor_to_numpy(tensors[m + ".weight"]))
    else:
        for m in ref:
            assert np.asarray(params[m].packed).tobytes() == cf.tensor_to_numpy(tensors[m + ".weight"]).tobytes()
    # every other tensor is a jax array under its full key, equal bit for bit
    plain = {k for k in params if k not in ref}
    quantized_keys = {k for k in tensors for m in ref if k.startswith(m + ".weight") or k == m + ".SCB"}
    assert plain == set(tensors) - quantized_keys
    for k in plain:
        assert cf.same_bits(params[k], cf.tensor_to_numpy(tensors[k])), k


def test_load_plain_checkpoint(tmp_path_factory):
    path = cf.cached_llama_checkpoint(tmp_path_factory, quant=None, dtype=torch.bfloat16)
    params, config = load_bnb_checkpoint(path)
    tensors = cf.torch_tensors(path)
    assert "quantization_config" not in config
    assert set(params) == set(tensors)
    for k, t in tensors.items():
        assert params[k].dtype == jnp.bfloat16
        assert cf.same_bits(params[k], cf.tensor_to_numpy(t)), k


@pytest.mark.parametrize("name", ["nf4", "int8", "storage"])
def test_staged_load_keeps_quantized_parts_on_the_host_with_the_same_values(ckpt, loaded, name):
    """device="stage": the quantized weights' parts and small tensors are numpy arrays (checked on
    the host) holding exactly what the default load puts on the device."""
    staged, config = load_bnb_checkpoint(ckpt(name), device="stage")
    placed, _ = loaded(name)
    assert staged.keys() == placed.keys()
    for key, value in staged.items():
        got, want = jax.tree.leaves(value), jax.tree.leaves(placed[key])
        assert len(got) == len(want), key
        for g, w in zip(got, want):
            assert isinstance(g, np.ndarray), (key, type(g))  # the tiny model's tensors are all small
            assert g.dtype == w.dtype and np.array_equal(g, np.asarray(w)), key


def _count_device_puts(monkeypatch) -> list:
    calls = []
    real = jax.device_put

    def counting(x, *args, **kw):
        calls.append(len(jax.tree.leaves(x)))
        return real(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", counting)
    return calls


def test_load_causal_lm_transfers_in_bulk_whatever_the_depth(tmp_path_factory, monkeypatch):
    """One device: loading moves the staged tensors in one transfer of stacked arrays, so the number
    of transfer calls does not grow with the layers (a 4-bit weight was six calls per layer, each
    milliseconds on a GPU). The model is the one built from the default (unstaged) load: the same
    logits, every array on the device."""
    from jqlora import models

    counts = {}
    for layers in (2, 5):
        path = cf.cached_llama_checkpoint(tmp_path_factory, quant="nf4", double_quant=True,
                                          config_overrides=dict(num_hidden_layers=layers))
        with monkeypatch.context() as m:
            calls = _count_device_puts(m)
            model = models.load_causal_lm(path, compute_dtype=jnp.float32)
        counts[layers] = len(calls)
        leaves = jax.tree.leaves(nnx_state(model))
        assert leaves and all(isinstance(a, jax.Array) for a in leaves)
        reference = models.from_params(*load_bnb_checkpoint(path), compute_dtype=jnp.float32)
        ids = jnp.asarray([[1, 5, 9, 2]])
        np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference(ids)))
    assert counts[2] == counts[5] <= 2, counts


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


@pytest.mark.parametrize("name", ["nf4", "fp4", "int8"])
def test_bnb_jax_bnb_round_trip_is_byte_identical(ckpt, loaded, tmp_path, name):
    params, config = loaded(name)
    out = save_bnb_checkpoint(tmp_path / "out", params, config)
    assert (out / "model.safetensors").read_bytes() == (ckpt(name) / "model.safetensors").read_bytes()
    saved_cfg = json.loads((out / "config.json").read_text())
    orig_qc = config["quantization_config"]
    for k in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
              "bnb_4bit_quant_storage", "bnb_4bit_compute_dtype", "llm_int8_threshold", "quant_method",
              "llm_int8_skip_modules"):
        assert saved_cfg["quantization_config"][k] == orig_qc[k], k
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_round_trip_sharded_and_quant_storage(ckpt, loaded, tmp_path):
    # sharded in, sharded out: same tensors, every module's tensors in one shard
    params, config = loaded("sharded")
    out = save_bnb_checkpoint(tmp_path / "sh", params, config, max_shard_bytes=20_000)
    index = json.loads((out / sio.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    for m in (k for k, v in params.items() if isinstance(v, quant.Weight4bit)):
        assert len({f for k, f in index["weight_map"].items() if k.startswith(m + ".")}) == 1
    a, b = cf.torch_tensors(ckpt("sharded")), cf.torch_tensors(out)
    assert a.keys() == b.keys()
    for k in a:
        assert cf.same_bits(cf.tensor_to_numpy(a[k]), cf.tensor_to_numpy(b[k])), k
    # bf16 quant_storage in, uint8 out: the same bytes
    params, config = loaded("storage")
    out = save_bnb_checkpoint(tmp_path / "st", params, config)
    a, b = cf.torch_tensors(ckpt("storage")), cf.torch_tensors(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_storage"] == "uint8"
    for k in a:
        assert cf.tensor_to_numpy(a[k]).tobytes() == cf.tensor_to_numpy(b[k]).tobytes(), k


@pytest.mark.parametrize("name", ["nf4", "fp4", "int8"])
def test_transformers_loads_saved_checkpoint(ckpt, loaded, tmp_path, name):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    params, config = loaded(name)
    out = save_bnb_checkpoint(tmp_path / "out", params, config, max_shard_bytes=30_000 if name == "nf4" else None)
    model = cf.load_with_transformers(out)
    n_quant = 0
    for mname, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            q = params[mname]
            qs = mod.weight.quant_state
            assert np.asarray(q.packed).tobytes() == cf.tensor_to_numpy(mod.weight.data).tobytes()
            assert cf.same_bits(q.absmax, cf.tensor_to_numpy(qs.absmax))
            if q.nested:
                assert cf.same_bits(q.nested_absmax, cf.tensor_to_numpy(qs.state2.absmax))
                assert float(q.offset) == qs.offset.item()
            assert cf.same_bits(_dequant_like_bnb(q), cf.tensor_to_numpy(F.dequantize_4bit(mod.weight.data, qs))), mname
            n_quant += 1
        elif isinstance(mod, bnb.nn.Linear8bitLt):
            q = params[mname]
            assert cf.same_bits(q.cb, cf.tensor_to_numpy(mod.weight.CB)) and cf.same_bits(q.scb, cf.tensor_to_numpy(mod.weight.SCB))
            assert cf.same_bits(_dequant_like_bnb(q), cf.tensor_to_numpy(F.int8_vectorwise_dequant(mod.weight.CB, mod.weight.SCB)))
            n_quant += 1
    assert n_quant == 14
    for k, v in model.state_dict().items():
        if k in params:
            assert cf.same_bits(params[k], cf.tensor_to_numpy(v)), k
    # and it computes exactly what the original checkpoint computes
    original = cf.load_with_transformers(ckpt(name))
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(original(ids).logits, model(ids).logits)


@pytest.mark.parametrize("blocksize", quant.BLOCKSIZES_4BIT)
def test_every_blocksize_saved_exactly_as_bitsandbytes_writes(tmp_path, blocksize):
    """Weights quantized by bitsandbytes itself (odd n, blocks spanning rows, nested or not, fp32 /
    bf16 / fp16) -> Weight4bit -> save: every tensor and the quant_state JSON bytes equal
    bitsandbytes' own state_dict entries; load gives the same Weight4bit back."""
    import bitsandbytes.functional as F
    from interop.torch_bridge import quant_state_to_weight

    torch.manual_seed(blocksize)
    cases = {  # module: (shape, dtype, quant_type, nested)
        "a.odd": ((33, 65), torch.float32, "nf4", False),
        "b.span": ((24, 100), torch.bfloat16, "fp4", True),
        "c.half": ((16, 48), torch.float16, "nf4", True),
    }
    params, expected = {}, {}
    for m, (shape, dtype, qt, nested) in cases.items():
        with torch.compiler.set_stance("force_eager"):  # skip torch.compile of the default op
            packed, qs = F.quantize_4bit(torch.randn(shape).to(dtype), blocksize=blocksize, quant_type=qt,
                                         compress_statistics=nested)
        params[m] = quant_state_to_weight(packed, qs, copy=True)
        expected[m + ".weight"] = packed
        expected.update({f"{m}.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
    params["a.odd.bias"] = jnp.arange(33, dtype=jnp.float16)
    out = save_bnb_checkpoint(tmp_path / "c", params, {"model_type": "custom"})
    written = cf.torch_tensors(out)
    assert set(written) == set(expected) | {"a.odd.bias"}
    for k, v in expected.items():
        assert written[k].dtype == v.dtype and written[k].shape == v.shape, k
        assert cf.tensor_to_numpy(written[k]).tobytes() == cf.tensor_to_numpy(v).tobytes(), k
    back, cfg = load_bnb_checkpoint(out)
    assert cfg["quantization_config"]["quant_method"] == "bitsandbytes"
    assert cf.same_bits(back["a.odd.bias"], params["a.odd.bias"])
    for m in cases:
        q, r = params[m], back[m]
        assert (r.shape, r.quant_type, r.blocksize, r.stored_dtype, r.nested) == \
               (q.shape, q.quant_type, q.blocksize, q.stored_dtype, q.nested)
        for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(r)):
            assert cf.same_bits(a, b)
    if blocksize not in (32, 4096):  # values once per extreme (eager JAX compiles per shape: slow)
        return
    # values: bitsandbytes' pure-torch dequantization (its CPU kernel mis-handles spanning blocks)
    m = "b.span"
    prefix = m + ".weight."
    qs = F.QuantState.from_dict({k[len(prefix):]: v for k, v in written.items() if k.startswith(prefix)},
                                device=torch.device("cpu"))
    ref = cf.bnb_dequantize_4bit_reference(written[m + ".weight"], qs)
    assert cf.same_bits(_dequant_like_bnb(back[m]), cf.tensor_to_numpy(ref))


# ------------------------------------------------------------------------------------------
# transposed weights (docs/design.md, invariant 4)

def _with_gate_replaced(loaded, tmp_path, w_fn, name="nf4"):
    params, config = loaded(name)
    params = dict(params)
    dense = np.asarray(quant.dequantize(params[GATE], jnp.float32))  # (128, 64)
    params[GATE] = _q4(jnp.asarray(w_fn(dense)), "nf4", 64, True)
    return save_bnb_checkpoint(tmp_path / "t", params, config), dense


def test_transposed_weight_is_rejected_with_a_clear_error(loaded, tmp_path):
    path, _ = _with_gate_replaced(loaded, tmp_path, lambda w: w.T)
    with pytest.raises(CheckpointError) as e:
        load_bnb_checkpoint(path)
    msg = str(e.value)
    assert f"{GATE}.weight.quant_state.bitsandbytes__nf4" in msg
    assert "[64, 128]" in msg and "[128, 64]" in msg and "quantized transposed" in msg


def test_transposed_weight_can_be_loaded_dequantized(loaded, tmp_path):
    path, dense = _with_gate_replaced(loaded, tmp_path, lambda w: w.T)
    with pytest.warns(UserWarning, match="quantized transposed"):
        params, _ = load_bnb_checkpoint(path, transposed="dequantize")
    assert GATE not in params
    w = params[GATE + ".weight"]
    assert w.shape == (128, 64) and w.dtype == jnp.float32
    expected = quant.dequantize(_q4(jnp.asarray(dense.T), "nf4", 64, True), jnp.float32).T
    assert cf.same_bits(w, expected)
    assert isinstance(params["model.layers.0.mlp.up_proj"], quant.Weight4bit)  # others untouched


def test_shape_matching_neither_is_an_error(loaded, tmp_path):
    path, _ = _with_gate_replaced(loaded, tmp_path, lambda w: w.reshape(32, 256))
    for mode in ("error", "dequantize"):
        with pytest.raises(CheckpointError, match=re.escape(GATE) + r".*\[32, 256\].*does not match.*\[128, 64\]"):
            load_bnb_checkpoint(path, transposed=mode)


def test_int8_transposed_is_rejected(ckpt, tmp_path):
    path = cf.copy_checkpoint(ckpt("int8"), tmp_path / "c")

    def edit(t):
        cb = t[GATE + ".weight"]
        t[GATE + ".weight"] = np.ascontiguousarray(cb.T)
        t[GATE + ".SCB"] = np.ones(cb.shape[1], np.float32)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=re.escape(GATE + ".weight") + r".*quantized transposed"):
        load_bnb_checkpoint(path)
    with pytest.warns(UserWarning, match="quantized transposed"):
        params, _ = load_bnb_checkpoint(path, transposed="dequantize")
    cb = sio.open_checkpoint(path).get(GATE + ".weight")
    assert cf.same_bits(params[GATE + ".weight"], (cb.astype(np.float32) * np.float32(quant.int8.INV_127)).T)


def test_unknown_architecture_skips_the_shape_check(loaded, tmp_path):
    params, config = loaded("nf4")
    path, _ = _with_gate_replaced(loaded, tmp_path, lambda w: w.T)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "something_else"
    (path / "config.json").write_text(json.dumps(cfg))
    params, _ = load_bnb_checkpoint(path)
    assert params[GATE].shape == (64, 128)


# ------------------------------------------------------------------------------------------
# errors on corrupted copies of real checkpoints

def _rewrite(path, edit):
    """Apply edit(tensors: dict[str, np.ndarray]) to a single-file checkpoint in place."""
    f = path / "model.safetensors"
    with sio.open_checkpoint(f) as c:
        tensors = {k: c.get(k, copy=True) for k in c.keys()}
    edit(tensors)
    sio.write_safetensors(f, tensors, {"format": "pt"})


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _json_bytes(d) -> np.ndarray:
    return np.frombuffer(json.dumps(d).encode() if not isinstance(d, bytes) else d, np.uint8).copy()


QS = GATE + ".weight.quant_state.bitsandbytes__nf4"
_DROP = object()


def _set_state(**changes):
    """Change fields of the real quant_state JSON (value _DROP removes the field)."""
    def edit(t):
        d = json.loads(t[QS].tobytes().decode())
        d.update(changes)
        for k in [k for k, v in changes.items() if v is _DROP]:
            del d[k]
        t[QS] = _json_bytes(d)
    return edit


def _drop(*keys):
    def edit(t):
        for k in keys:
            del t[k]
    return edit


def _replace(key, value_fn):
    def edit(t):
        t[key] = value_fn(t[key])
    return edit


NF4_CORRUPTIONS = {
    "drop_absmax": (_drop(GATE + ".weight.absmax"), GATE + ".weight.absmax", "missing"),
    "drop_quant_map": (_drop(GATE + ".weight.quant_map"), GATE + ".weight.quant_map", "missing"),
    "drop_packed": (_drop(GATE + ".weight"), GATE + ".weight", "missing"),
    "drop_quant_state": (_drop(QS), GATE + ".weight.quant_state", "missing"),
    "bad_json": (lambda t: t.__setitem__(QS, _json_bytes(b"{\"quant_type\": nf4")), QS, "not valid UTF-8 JSON"),
    "json_not_object": (lambda t: t.__setitem__(QS, _json_bytes([1, 2])), QS, "expected an object"),
    "json_missing_field": (_set_state(dtype=_DROP), QS, r"missing fields \['dtype'\]"),
    "json_unknown_field": (_set_state(foo=1), QS, r"unknown fields \['foo'\]"),
    "json_blocksize_48": (_set_state(blocksize=48), QS, "blocksize 48 not allowed"),
    "json_blocksize_str": (_set_state(blocksize="64"), QS, "not an integer"),
    "json_shape_type": (_set_state(shape="128x64"), QS, "shape"),
    "json_dtype": (_set_state(dtype="int4"), QS, "dtype 'int4'"),
    "json_quant_type": (_set_state(quant_type="nf5"), QS, "unknown quant_type 'nf5'"),
    "json_type_vs_key": (_set_state(quant_type="fp4"), QS, "contradicts the key"),
    "json_nested_partial": (_set_state(nested_offset=_DROP), QS, "partially present"),
    "json_nested_blocksize": (_set_state(nested_blocksize=128), QS, "nested_blocksize 128"),
    "json_offset_type": (_set_state(nested_offset="x"), QS, "nested_offset"),
    "nested_tensor_missing": (_drop(GATE + ".weight.nested_absmax"), QS, "partially present"),
    "unknown_quant_type_key": (
        lambda t: t.__setitem__(GATE + ".weight.quant_state.bitsandbytes__int4", t.pop(QS)),
        GATE + ".weight.quant_state.bitsandbytes__int4", "unknown quant_type 'int4'"),
    "absmax_length": (_replace(GATE + ".weight.absmax", lambda a: a[:-1].copy()), GATE + ".weight.absmax",
                      r"absmax length \[127\] != ceil\(n / blocksize\) = ceil\(8192 / 64\) = 128"),
    "absmax_dtype": (_replace(GATE + ".weight.absmax", lambda a: a.astype(np.float32)), GATE + ".weight.absmax",
                     "dtype F32, expected U8"),
    "packed_length": (_replace(GATE + ".weight", lambda a: a[:-1].copy()), GATE + ".weight",
                      r"packed length 4095 bytes != \(n \+ 1\) // 2 = 4096"),
    "packed_legacy_row": (_replace(GATE + ".weight", lambda a: a.reshape(1, -1).copy()), GATE + ".weight",
                          "column"),
    "quant_map_values": (_replace(GATE + ".weight.quant_map", lambda a: a[::-1].copy()), GATE + ".weight.quant_map",
                         "differs from the standard nf4 table"),
    "nested_map_values": (_replace(GATE + ".weight.nested_quant_map", lambda a: a * 2),
                          GATE + ".weight.nested_quant_map", "dynamic map"),
    "nested_absmax_len": (_replace(GATE + ".weight.nested_absmax", lambda a: np.zeros(2, np.float32)),
                          GATE + ".weight.nested_absmax", "nested_absmax length"),
}


@pytest.fixture
def nf4_copy(ckpt, tmp_path):
    return cf.copy_checkpoint(ckpt("nf4"), tmp_path / "c")


@pytest.mark.parametrize("case", list(NF4_CORRUPTIONS))
def test_nf4_corruption_errors_name_the_tensor(nf4_copy, case):
    edit, key, pattern = NF4_CORRUPTIONS[case]
    _rewrite(nf4_copy, edit)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_bnb_checkpoint(nf4_copy)
    assert key in str(e.value)


INT8_CORRUPTIONS = {
    "weight_format_1": (_replace(GATE + ".weight_format", lambda a: np.array(1, np.uint8)), GATE + ".weight_format",
                        r"weight_format 1 \(col32\) is not supported"),
    "scb_length": (_replace(GATE + ".SCB", lambda a: a[:-3].copy()), GATE + ".SCB", r"SCB shape \[125\] != \(128,\)"),
    "drop_scb": (_drop(GATE + ".SCB"), GATE + ".SCB", "missing"),
    "drop_scb_and_format": (_drop(GATE + ".SCB", GATE + ".weight_format"), GATE + ".weight", "without its sibling"),
    "weight_not_int8": (_replace(GATE + ".weight", lambda a: a.astype(np.float16)), GATE + ".weight",
                        "expected int8"),
}


@pytest.mark.parametrize("case", list(INT8_CORRUPTIONS))
def test_int8_corruption_errors_name_the_tensor(ckpt, tmp_path, case):
    path = cf.copy_checkpoint(ckpt("int8"), tmp_path / "c")
    edit, key, pattern = INT8_CORRUPTIONS[case]
    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_bnb_checkpoint(path)
    assert key in str(e.value)


def test_int8_without_weight_format_is_row(ckpt, tmp_path):
    path = cf.copy_checkpoint(ckpt("int8"), tmp_path / "c")
    _rewrite(path, _drop(GATE + ".weight_format"))
    params, _ = load_bnb_checkpoint(path)
    assert isinstance(params[GATE], quant.Int8Weight)


def test_truncated_and_garbled_files(nf4_copy):
    f = nf4_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"truncated") as e:
        load_bnb_checkpoint(nf4_copy)
    assert str(f) in str(e.value) and "tensor '" in str(e.value)  # names the last tensor
    f.write_bytes(data[:8] + b"#" + data[9:])
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON") as e:
        load_bnb_checkpoint(nf4_copy)
    assert str(f) in str(e.value)
    f.write_bytes(data[:3])
    with pytest.raises(CheckpointError, match="too short"):
        load_bnb_checkpoint(nf4_copy)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda p: (p / "config.json").unlink(), r"config.json: missing"),
        (lambda p: (p / "config.json").write_text("{oops"), r"config.json: not valid JSON"),
        (lambda p: (p / "config.json").write_text("[1]"), r"expected an object"),
        (lambda p: _edit_config(p, lambda c: c.pop("quantization_config")), r"no quantization_config.*" + re.escape(GATE[:12])),
        (lambda p: _edit_config(p, lambda c: c["quantization_config"].update(quant_method="gptq")),
         r"quant_method is 'gptq'"),
        (lambda p: _edit_config(p, lambda c: c.__setitem__("quantization_config", "bnb")), r"expected an object"),
        (lambda p: _edit_config(p, lambda c: c["quantization_config"].update(load_in_4bit=False, load_in_8bit=True,
                                                                          _load_in_4bit=False, _load_in_8bit=True)),
         r"says load_in_8bit but the checkpoint holds 4-bit"),
        (lambda p: (p / "model.safetensors").unlink(), r"no model.safetensors"),
    ],
)
def test_config_errors(nf4_copy, edit, pattern):
    edit(nf4_copy)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_bnb_checkpoint(nf4_copy)
    assert str(nf4_copy) in str(e.value)


def test_packed_4bit_without_siblings_is_an_error(nf4_copy):
    keys = [k for k in sio.open_checkpoint(nf4_copy).keys() if k.startswith(GATE + ".weight.")]
    _rewrite(nf4_copy, _drop(*keys))
    with pytest.raises(CheckpointError, match=re.escape(GATE + ".weight") + ".*no quant_state"):
        load_bnb_checkpoint(nf4_copy)


def test_sharded_errors(ckpt, tmp_path):
    src = ckpt("sharded")
    index = json.loads((src / sio.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    # a shard the index names is missing
    p = cf.copy_checkpoint(src, tmp_path / "a")
    (p / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=re.escape(shards[1]) + r".*is missing"):
        load_bnb_checkpoint(p)
    # a key mapped to a shard that does not hold it: in no shard
    p = cf.copy_checkpoint(src, tmp_path / "b")
    wm = dict(index["weight_map"])
    key = next(k for k, f in wm.items() if f == shards[0])
    wm["model.extra.weight"] = shards[0]
    (p / sio.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"'model.extra.weight' is in no shard"):
        load_bnb_checkpoint(p)
    # a key moved to another shard in the index
    wm = dict(index["weight_map"])
    wm[key] = shards[1]
    (p / sio.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(CheckpointError, match=re.escape(key)):
        load_bnb_checkpoint(p)
    # a stale single file next to the index
    p = cf.copy_checkpoint(src, tmp_path / "c")
    shutil.copy(p / shards[0], p / "model.safetensors")
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        load_bnb_checkpoint(p)
    # malformed index
    (p / "model.safetensors").unlink()
    (p / sio.INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointError, match=r"index.json: cannot parse"):
        load_bnb_checkpoint(p)


# ------------------------------------------------------------------------------------------
# atomic save

def test_save_failure_leaves_nothing(loaded, tmp_path, monkeypatch):
    params, config = loaded("nf4")
    real = sio.write_safetensors
    calls = []

    def failing(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:  # after the first shard
            raise OSError("disk full (simulated)")
        return real(path, *a, **k)

    monkeypatch.setattr(sio, "write_safetensors", failing)
    with pytest.raises(OSError, match="simulated"):
        save_bnb_checkpoint(tmp_path / "out", params, config, max_shard_bytes=20_000)
    assert len(calls) == 2
    assert os.listdir(tmp_path) == []

    calls.clear()
    monkeypatch.setattr(sio, "write_safetensors", lambda *a, **k: (_ for _ in ()).throw(OSError("simulated")))
    with pytest.raises(OSError):
        save_bnb_checkpoint(tmp_path / "out", params, config)
    assert os.listdir(tmp_path) == []


def test_save_refuses_or_replaces_existing_dir(loaded, tmp_path):
    params, config = loaded("int8")
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.txt").write_text("x")
    with pytest.raises(FileExistsError):
        save_bnb_checkpoint(target, params, config)
    assert (target / "stale.txt").exists()
    save_bnb_checkpoint(target, params, config, overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_save_validates_params(loaded, tmp_path):
    params, config = loaded("nf4")
    with pytest.raises(ValueError, match="keyed by module name"):
        save_bnb_checkpoint(tmp_path / "a", {GATE + ".weight": params[GATE]}, config)
    with pytest.raises(ValueError, match="produced by both"):
        save_bnb_checkpoint(tmp_path / "b", {GATE: params[GATE], GATE + ".weight.absmax": jnp.zeros(3)}, config)
    with pytest.raises(TypeError):
        save_bnb_checkpoint(tmp_path / "c", {"x": "not an array"}, config)
    mixed = {GATE: params[GATE], "other": quant.quantize_int8(jnp.ones((8, 8)))}
    with pytest.raises(ValueError, match="mix 4-bit and 8-bit"):
        save_bnb_checkpoint(tmp_path / "d", mixed, config)
    q8 = [quant.quantize_int8(jnp.ones((8, 8)), threshold=t) for t in (6.0, 4.0)]
    with pytest.raises(ValueError, match="llm_int8_threshold"):
        save_bnb_checkpoint(tmp_path / "e", {"a": q8[0], "b": q8[1]}, config)
    assert os.listdir(tmp_path) == []


def test_quantization_config_derived_from_params(loaded, tmp_path):
    params, config = loaded("nf4")
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    out = save_bnb_checkpoint(tmp_path / "a", params, cfg)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["load_in_4bit"] and not qc["load_in_8bit"] and qc["quant_method"] == "bitsandbytes"
    assert qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"] is True
    assert qc["bnb_4bit_compute_dtype"] == "float32" and qc["bnb_4bit_quant_storage"] == "uint8"
    assert qc["llm_int8_skip_modules"] is None
    # a dense linear among quantized ones must be listed, or transformers would quantize it
    params = dict(params)
    params[GATE + ".weight"] = quant.dequantize(params.pop(GATE), jnp.float32)
    out = save_bnb_checkpoint(tmp_path / "b", params, cfg)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["llm_int8_skip_modules"] == sorted([GATE, "lm_head"])
    model = cf.load_with_transformers(out)
    assert isinstance(model.get_submodule(GATE), torch.nn.Linear) and model.get_submodule(GATE).weight.dtype == torch.float32
    # nothing quantized: no quantization_config
    dense = {k: v for k, v in params.items() if not isinstance(v, quant.Weight4bit)}
    out = save_bnb_checkpoint(tmp_path / "c", dense, config)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_public_api():
    for name in ("load_bnb_checkpoint", "save_bnb_checkpoint", "load_peft_adapter", "save_peft_adapter",
                 "from_torch", "from_torch_module", "to_torch", "to_torch_module", "CheckpointError",
                 "open_checkpoint", "write_safetensors"):
        assert hasattr(interop, name) and name in interop.__all__, name
    assert issubclass(CheckpointError, ValueError)


def test_import_interop_loads_no_torch():
    """The torch bridge imports torch and bitsandbytes only when one of its functions runs."""
    import subprocess
    import sys

    code = "import sys, interop; print(sorted(m for m in ('torch', 'bitsandbytes', 'safetensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_non_bitsandbytes_quantized_checkpoint_is_rejected(tmp_path):
    """A checkpoint quantized by another method (GPTQ, AWQ, ...) is refused by name, not misread."""
    import json

    from interop.safetensors_io import write_safetensors

    d = tmp_path / "gptq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama",
                                               "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    write_safetensors(d / "model.safetensors", {"model.norm.weight": np.ones((4,), np.float32)})
    with pytest.raises(CheckpointError, match="'gptq'.*bitsandbytes"):
        load_bnb_checkpoint(d)
