"""interop.torch_bridge: live bitsandbytes / torch objects <-> jqlora JAX types."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

import bitsandbytes.functional as F  # noqa: E402

import checkpoint_factory as cf  # noqa: E402
import interop  # noqa: E402
from jqlora import quant  # noqa: E402

pytestmark = pytest.mark.torch






_dq = jax.jit(quant.dequantize, static_argnums=(1,))


def _dequant(q, dtype):
    """jqlora dequantization, the nested absmax de-nested eagerly (see test_interop_checkpoint)."""
    if isinstance(q, quant.Weight4bit):
        q = dataclasses.replace(q, absmax=quant.absmax_f32(q), nested_absmax=None, nested_code=None, offset=None)
    return np.asarray(_dq(q, dtype))


def _linear4bit(quant_type, nested, dtype, out_f=96, in_f=64, seed=0):
    torch.manual_seed(seed)
    dense = torch.nn.Linear(in_f, out_f, bias=True).to(dtype)
    m = bnb.nn.Linear4bit(in_f, out_f, bias=True, quant_type=quant_type, compress_statistics=nested)
    m.load_state_dict(dense.state_dict())
    m = m.to(dtype)  # not quantized yet: the quant_state dtype is the weight's dtype at quantization
    with torch.compiler.set_stance("force_eager"):
        m = m.to("cpu")  # quantizes
    return m.train()  # train mode: no AVX512-BF16 CPU repacking in forward


def _linear8bit(seed=0, threshold=6.0):
    torch.manual_seed(seed)
    dense = torch.nn.Linear(64, 96, bias=True)
    m = bnb.nn.Linear8bitLt(64, 96, bias=True, has_fp16_weights=False, threshold=threshold)
    m.load_state_dict(dense.state_dict())
    return m.to("cpu")


@pytest.mark.parametrize(
    "quant_type, nested, dtype",
    [("nf4", True, torch.float32), ("fp4", False, torch.bfloat16), ("nf4", False, torch.float16)],
)
def test_linear4bit_round_trip(quant_type, nested, dtype):
    m = _linear4bit(quant_type, nested, dtype)
    w, b = interop.from_torch_module(m)
    assert isinstance(w, quant.Weight4bit)
    assert (w.shape, w.quant_type, w.nested, w.blocksize) == ((96, 64), quant_type, nested, 64)
    assert w.stored_dtype == str(dtype).removeprefix("torch.")
    assert cf.same_bits(b, cf.tensor_to_numpy(m.bias))
    # bit for bit what bitsandbytes dequantizes to
    ref = F.dequantize_4bit(m.weight.data, m.weight.quant_state)
    assert cf.same_bits(_dequant(w, jnp.dtype(w.stored_dtype)), cf.tensor_to_numpy(ref))
    # from_torch on the parameter gives the same leaves
    w2 = interop.from_torch(m.weight)
    for x, y in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(w2)):
        assert cf.same_bits(x, y)
    # back to torch: a real Params4bit whose state_dict is byte-identical
    p = interop.to_torch(w)
    assert isinstance(p, bnb.nn.Params4bit) and isinstance(p.quant_state, F.QuantState)
    assert p.quant_state.nested == nested and p.quant_state.dtype == dtype
    m2 = interop.to_torch_module(w, b).train()
    sd1, sd2 = m.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert sd1[k].dtype == sd2[k].dtype and cf.tensor_to_numpy(sd1[k]).tobytes() == cf.tensor_to_numpy(sd2[k]).tobytes(), k
    # and the rebuilt module computes exactly what the original does (3-D input)
    x = torch.randn(2, 5, 64).to(dtype)
    with torch.no_grad():
        assert torch.equal(m(x), m2(x))


def test_linear4bit_after_cpu_eval_repacking_is_refused():
    if not bnb.nn.Linear4bit(64, 64).support_avx512bf16_for_cpu:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack")
    m = _linear4bit("nf4", True, torch.float32).eval()
    with torch.no_grad():
        m(torch.randn(1, 64))
    with pytest.raises(ValueError, match="CPU inference layout"):
        interop.from_torch(m)


def test_linear8bit_round_trip():
    m = _linear8bit()
    q, b = interop.from_torch_module(m)
    assert isinstance(q, quant.Int8Weight) and q.threshold == 6.0 and q.shape == (96, 64)
    assert cf.same_bits(q.cb, cf.tensor_to_numpy(m.weight.CB)) and cf.same_bits(q.scb, cf.tensor_to_numpy(m.weight.SCB))
    assert cf.same_bits(_dequant(q, jnp.float32), cf.tensor_to_numpy(F.int8_vectorwise_dequant(m.weight.CB, m.weight.SCB)))
    p = interop.to_torch(q)
    assert isinstance(p, bnb.nn.Int8Params) and p.dtype == torch.int8
    assert torch.equal(p.CB, m.weight.CB) and torch.equal(p.SCB, m.weight.SCB)
    m2 = interop.to_torch_module(q, b)
    x = torch.randn(2, 5, 64)
    x[0, 0, 3] = 20.0  # an outlier column: exercises the threshold path
    m.eval(), m2.eval()
    with torch.no_grad():
        assert torch.equal(m(x), m2(x))
    sd1, sd2 = m.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    # after a forward bitsandbytes moved CB/SCB into module.state: still converts the same
    q2 = interop.from_torch(m)
    assert cf.same_bits(q2.cb, q.cb) and cf.same_bits(q2.scb, q.scb)
    # a bare Int8Params carries no threshold
    assert interop.from_torch(p).threshold == 0.0


def test_unquantized_objects_are_refused():
    with pytest.raises(ValueError, match="not quantized"):
        interop.from_torch(bnb.nn.Int8Params(torch.randn(4, 4), has_fp16_weights=True))
    with pytest.raises(TypeError):
        interop.from_torch(object())
    with pytest.raises(TypeError):
        interop.to_torch("x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                                   torch.int32, torch.bool, torch.float8_e4m3fn])
def test_tensor_round_trip(dtype):
    t = (torch.randn(3, 7) * 10).to(dtype)
    a = interop.from_torch(t)
    assert isinstance(a, jax.Array) and a.shape == (3, 7)
    assert cf.same_bits(a, cf.tensor_to_numpy(t) if dtype != torch.float8_e4m3fn else t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn))
    back = interop.to_torch(a)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8) if dtype.itemsize == 1 else back, t.view(torch.uint8) if dtype.itemsize == 1 else t)


def test_zero_copy_and_copy_flags():
    t = torch.zeros(16)
    shared = interop.from_torch(t)
    owned = interop.from_torch(t, copy=True)
    t.add_(1.0)
    assert float(owned[0]) == 0.0
    assert float(shared[0]) in (0.0, 1.0)  # zero-copy where the runtime allows: documented aliasing
    a = jnp.arange(8, dtype=jnp.float32)
    c = interop.to_torch(a, copy=True)
    c.add_(1.0)
    assert float(a[0]) == 0.0
    nc = torch.arange(12.0).reshape(3, 4).T  # non-contiguous
    assert cf.same_bits(interop.from_torch(nc), nc.contiguous().numpy())


def test_plain_linear_and_module_errors():
    lin = torch.nn.Linear(4, 3)
    w, b = interop.from_torch_module(lin)
    assert cf.same_bits(w, lin.weight.detach().numpy()) and cf.same_bits(b, lin.bias.detach().numpy())
    m = interop.to_torch_module(w, b)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(m(x), lin(x))
    with pytest.raises(TypeError):
        interop.from_torch_module(torch.nn.ReLU())


def test_bridge_agrees_with_checkpoint_loader(tmp_path_factory):
    """from_torch on the modules transformers loads == load_bnb_checkpoint on the same files."""
    path = cf.cached_llama_checkpoint(tmp_path_factory, quant="nf4", double_quant=True)
    params, _ = interop.load_bnb_checkpoint(path)
    model = cf.load_with_transformers(path)
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            w, bias = interop.from_torch_module(mod)
            assert bias is None
            for x, y in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(params[name])):
                assert cf.same_bits(x, y), name
            assert w.shape == params[name].shape
            n += 1
    assert n == 14
