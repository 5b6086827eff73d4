"""QLoRALinear, LoraConfig/apply_lora and the LoRA weight mapping (jqlora.lora)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jqlora import lora, ops, quant
from jqlora.lora import LoraConfig, QLoRALinear, QuantizedBase
from jqlora.lora.linear import lora_scale


def _w(out=48, inp=128, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 0.05, (out, inp)).astype(np.float32))


def _x(shape=(2, 5, 128), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32))


BASES = {
    "nf4": lambda w: quant.quantize_4bit(w, "nf4", 64, True),
    "fp4": lambda w: quant.quantize_4bit(w, "fp4", 64, False),
    "int8": quant.quantize_int8,
    "dense": lambda w: w,
}


def _set_random_b(layer, seed=2):
    layer.lora_B.set_value(jnp.asarray(np.random.default_rng(seed).normal(0, 0.1, layer.lora_B.shape), jnp.float32))


@pytest.mark.parametrize("kind", ["nf4", "int8", "dense"])
def test_init_like_peft_output_equals_base(kind):
    w = _w()
    q = BASES[kind](w)
    layer = QLoRALinear(q, rank=8, alpha=16, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    assert layer.lora_A.shape == (8, 128) and layer.lora_B.shape == (48, 8)
    assert isinstance(layer.lora_A, nnx.LoRAParam) and isinstance(layer.base, QuantizedBase)
    assert not isinstance(layer.base, nnx.Param)
    np.testing.assert_array_equal(np.asarray(layer.lora_B[...]), 0.0)
    a = np.asarray(layer.lora_A[...])
    bound = 1.0 / math.sqrt(128)  # kaiming_uniform(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
    assert abs(a.std() - bound / math.sqrt(3)) < 0.1 * bound
    x = _x()
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(ops.qmatmul(x, q, compute_dtype=jnp.float32)))
    assert layer.scale == 2.0


def test_rank0_is_plain_frozen_linear_with_bias():
    w, b = _w(), jnp.arange(48, dtype=jnp.float32) / 48
    layer = QLoRALinear(w, bias=b)
    assert not layer.has_lora and nnx.state(layer, nnx.Param) == nnx.State({})
    x = _x()
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(x @ w.T + b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias"):
        QLoRALinear(w, bias=jnp.zeros(3))


class _Two(nnx.Module):
    def __init__(self, rngs):
        self.a = QLoRALinear(quant.quantize_4bit(_w(64, 128, 3)), rank=4, alpha=8, bias=jnp.ones(64), rngs=rngs,
                             compute_dtype=jnp.float32)
        self.b = QLoRALinear(quant.quantize_int8(_w(32, 64, 4)), rank=4, alpha=8, rngs=rngs, compute_dtype=jnp.float32)

    def __call__(self, x):
        return self.b(jax.nn.silu(self.a(x)))


def test_optimizer_trains_only_lora_params():
    model = _Two(nnx.Rngs(0))
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    # The optimizer state holds moments for the four LoRA matrices only.
    moment_shapes = sorted(tuple(x.shape) for x in jax.tree_util.tree_leaves(nnx.state(opt, nnx.OptState))
                           if getattr(x, "ndim", 0) == 2)
    assert moment_shapes == sorted([(4, 128), (64, 4), (4, 64), (32, 4)] * 2)
    x = _x((3, 128))

    @nnx.jit
    def step(model, opt):
        loss_fn = lambda m: jnp.mean((m(x) - 1.0) ** 2)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(3)]
    assert losses[-1] < losses[0]
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    for path, old in jax.tree_util.tree_leaves_with_path(before):
        new = dict(jax.tree_util.tree_leaves_with_path(after))[path]
        name = jax.tree_util.keystr(path)
        if "lora_" in name:
            assert not np.array_equal(old, new), f"{name} did not change"
        else:
            np.testing.assert_array_equal(old, new, err_msg=f"{name} changed")
    assert isinstance(model.a.base.get_value(), quant.Weight4bit)


def test_frozen_base_gets_no_gradient_even_with_param_filter():
    model = _Two(nnx.Rngs(0))
    grads = nnx.grad(lambda m: jnp.sum(m(_x((2, 128)))))(model)  # default wrt=nnx.Param
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
    assert names and all("lora_" in n for n in names), names


def test_rslora_scale():
    w = _w()
    plain = QLoRALinear(w, rank=16, alpha=32, rngs=nnx.Rngs(0))
    rs = QLoRALinear(w, rank=16, alpha=32, use_rslora=True, rngs=nnx.Rngs(0))
    assert plain.scale == 2.0 and rs.scale == 8.0
    _set_random_b(plain)
    _set_random_b(rs)
    x = _x()
    base = x @ w.T
    d_plain = plain(x) - base
    d_rs = rs(x) - base
    np.testing.assert_allclose(np.asarray(d_rs), 4.0 * np.asarray(d_plain), rtol=1e-3, atol=1e-5)
    assert LoraConfig(rank=16, alpha=32, use_rslora=True) and lora_scale(16, 32, True) == 8.0


def test_dropout_only_on_lora_branch():
    w = _w()
    q = quant.quantize_4bit(w)
    layer = QLoRALinear(q, rank=8, alpha=16, dropout=0.5, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    ref = QLoRALinear(q, rank=8, alpha=16, dropout=0.0, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    x = _x()
    base = ops.qmatmul(x, q, compute_dtype=jnp.float32)
    # B = 0: whatever dropout does to the LoRA input, the base path is untouched.
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(base), rtol=1e-6, atol=1e-6)
    _set_random_b(layer)
    ref.set_lora(layer.lora_A[...], layer.lora_B[...])
    y_train = layer(x)
    # Training mode: y - base = s * ((x * mask / (1 - p)) @ A.T) @ B.T with a Bernoulli mask.
    delta = np.asarray(y_train - base)
    assert not np.allclose(delta, np.asarray(ref(x) - base), atol=1e-4)
    layer.eval()
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    layer.train()
    assert not np.allclose(np.asarray(layer(x)), np.asarray(y_train))  # a fresh mask per call


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8", "dense"])
def test_merge_equals_forward_and_requantize(kind):
    w = _w()
    q = BASES[kind](w)
    layer = QLoRALinear(q, rank=8, alpha=16, bias=jnp.full((48,), 0.5), rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
    _set_random_b(layer)
    x = _x()
    merged = layer.merge()
    assert merged.dtype == jnp.float32 and merged.shape == (48, 128)
    np.testing.assert_allclose(np.asarray(x @ merged.T + 0.5), np.asarray(layer(x)), rtol=1e-5, atol=2e-5)
    rq = layer.merge(requantize=True)
    assert type(rq) is type(q) if kind != "dense" else rq.dtype == w.dtype
    if isinstance(q, quant.Weight4bit):
        assert (rq.quant_type, rq.blocksize, rq.nested, rq.stored_dtype) == (q.quant_type, q.blocksize, q.nested,
                                                                              q.stored_dtype)
    dq = quant.dequantize(rq, jnp.float32)
    rel = float(jnp.linalg.norm(dq - merged) / jnp.linalg.norm(merged))
    base_rel = float(jnp.linalg.norm(quant.dequantize(q, jnp.float32) - w) / jnp.linalg.norm(w))
    assert rel <= 1.5 * base_rel + 1e-6, (rel, base_rel)  # lossy like the base's own quantization
    # The module still holds the original base: nothing to unmerge.
    held = layer.base.get_value()
    assert type(held) is type(q)
    for a, b in zip(jax.tree_util.tree_leaves(held), jax.tree_util.tree_leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ml = layer.merged_layer(requantize=False)
    assert not ml.has_lora
    np.testing.assert_allclose(np.asarray(ml(x)), np.asarray(layer(x)), rtol=1e-5, atol=2e-5)


class _Block(nnx.Module):
    def __init__(self):
        self.q_proj = QLoRALinear(_w(32, 64, 5))
        self.v_proj = QLoRALinear(_w(32, 64, 6))
        self.o_proj = QLoRALinear(_w(64, 32, 7))
        self.qq_proj = QLoRALinear(_w(32, 64, 8))


class _Net(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([_Block(), _Block()])


def _lora_names(m):
    return sorted(lora.lora_params_by_module(m))


def test_apply_lora_targets():
    m = lora.apply_lora(_Net(), LoraConfig(rank=2, target_modules=("q_proj",)), nnx.Rngs(0))
    assert _lora_names(m) == ["layers.0.q_proj", "layers.1.q_proj"]  # "q_proj" does not match "qq_proj"
    m = lora.apply_lora(_Net(), LoraConfig(rank=2, target_modules=r"layers\.1\.(q|v)_proj"), nnx.Rngs(0))
    assert _lora_names(m) == ["layers.1.q_proj", "layers.1.v_proj"]
    with pytest.raises(ValueError, match="matched no linear layer.*layers.0.q_proj"):
        lora.apply_lora(_Net(), LoraConfig(rank=2, target_modules=("gate_proj",)), nnx.Rngs(0))
    with pytest.raises(ValueError, match="matched no linear layer"):
        lora.apply_lora(_Net(), LoraConfig(rank=2, target_modules="proj"), nnx.Rngs(0))  # full match only
    m = lora.apply_lora(_Net(), LoraConfig(rank=2, target_modules=["o_proj"]), nnx.Rngs(0))
    with pytest.raises(ValueError, match="already has a LoRA"):
        lora.apply_lora(m, LoraConfig(rank=2, target_modules=["o_proj"]), nnx.Rngs(0))
    with pytest.raises(ValueError):
        LoraConfig(rank=0)


def test_lora_params_roundtrip():
    m = lora.apply_lora(_Net(), LoraConfig(rank=3, alpha=6), nnx.Rngs(0))
    got = lora.lora_params_by_module(m)
    assert set(got) == {f"layers.{i}.{n}" for i in (0, 1) for n in ("q_proj", "v_proj", "o_proj")}
    assert got["layers.0.o_proj"]["lora_A"].shape == (3, 32) and got["layers.0.o_proj"]["lora_B"].shape == (64, 3)
    rng = np.random.default_rng(0)
    new = {k: {n: rng.normal(size=a.shape).astype(np.float32) for n, a in v.items()} for k, v in got.items()}
    lora.set_lora_params(m, new)
    back = lora.lora_params_by_module(m)
    for k in new:
        for n in ("lora_A", "lora_B"):
            np.testing.assert_array_equal(np.asarray(back[k][n]), new[k][n])
    with pytest.raises(KeyError, match="no linear layer named 'layers.0.k_proj'"):
        lora.set_lora_params(m, {"layers.0.k_proj": new["layers.0.q_proj"]})
    with pytest.raises(ValueError, match="layers.0.q_proj.*lora_A has shape"):
        lora.set_lora_params(m, {**new, "layers.0.q_proj": {"lora_A": np.zeros((4, 64)), "lora_B": np.zeros((32, 4))}})
    with pytest.raises(KeyError, match="no weights given"):
        lora.set_lora_params(m, {"layers.0.q_proj": new["layers.0.q_proj"]})
    lora.set_lora_params(m, {"layers.0.q_proj": new["layers.0.q_proj"]}, strict=False)


def test_qlora_linear_nd_and_bf16():
    q = quant.quantize_4bit(_w())
    layer = QLoRALinear(q, rank=4, rngs=nnx.Rngs(0))
    _set_random_b(layer)
    x = _x((2, 3, 4, 128)).astype(jnp.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, 4, 48) and y.dtype == jnp.bfloat16
    ref = x.astype(jnp.float32) @ layer.merge().T
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), atol=0.05, rtol=0.05)


def _run_docstring_examples(obj, name):
    """(failed, attempted) for the doctest examples in obj's own docstring."""
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder(recurse=False).find(obj, name, globs={}):
        runner.run(test)
    return runner.summarize(verbose=False)


def test_qlora_linear_docstring_example_runs():
    from jqlora.lora.linear import QLoRALinear as cls

    failed, attempted = _run_docstring_examples(cls, "QLoRALinear")
    assert attempted >= 8 and failed == 0
