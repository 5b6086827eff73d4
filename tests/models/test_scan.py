"""Decoder layers under a scan over stacked weights; bounded compilation of generate; remat
policies (what each keeps for the backward pass) and `remat="auto"`'s memory model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import lora, models, quant
from jqlora.lora.stacked import stacked_view
from jqlora.models.generate import _generate, generate
from jqlora.models.attention import rope_cos_sin

try:  # public in newer jax; jax.ad_checkpoint.print_saved_residuals prints the same list
    from jax.ad_checkpoint import saved_residuals
except ImportError:
    from jax._src.ad_checkpoint import saved_residuals

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
WEIGHT_SHAPES = {(64, 64), (32, 64), (64, 32), (96, 64), (64, 96)}  # every linear's (out, in) and (in, out)


def _model(layers=3, remat=False, quantize="nf4", targets=None, params=None, **kw):
    cfg = {**CFG, "num_hidden_layers": layers}
    params = params if params is not None else models.init_params(cfg, seed=0, std=0.1)
    lc = lora.LoraConfig(rank=4, **({} if targets is None else {"target_modules": targets}))
    m = models.from_params(params, cfg, quantize=quantize, compute_dtype=jnp.float32, remat=remat, lora=lc,
                           rngs=nnx.Rngs(0), **kw)
    values = {n: {"lora_A": v["lora_A"], "lora_B": jnp.full(v["lora_B"].shape, 0.03, jnp.float32)}
              for n, v in lora.lora_params_by_module(m).items()}
    return lora.set_lora_params(m, values)


def _ids(b=2, t=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG["vocab_size"], (b, t)), jnp.int32)


def _loss_fn(ids):
    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids)).max(-1))
    return loss


def _grads(m, loss):
    return nnx.jit(lambda m: nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m))(m)


def _loop_logits(m, ids):
    """The forward as an explicit Python loop over the same stacked arrays (one layer at a time,
    sliced out of the stacks), for comparison with the scan."""
    b, t = ids.shape
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = jnp.ones((b, t), jnp.int32)
    cos, sin = rope_cos_sin(m.config, slots, m.compute_dtype)
    x = m.model.embed_tokens(ids, m.compute_dtype)
    for stack in m.model.layers.stacks:
        graphdef, state = nnx.split(stack.layer)
        for j in range(stack.size):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))
            x, _ = layer(x, cos, sin, slots, slots, seg, seg, plain_causal=True)
    return m.lm_logits(m.model.norm(x))


def _count(jaxpr, prim="dot_general") -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == prim
        for v in eqn.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(j, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    n += _count(inner, prim)
                elif hasattr(j, "eqns"):
                    n += _count(j, prim)
    return n


# ------------------------------------------------------------------------------ scan over layers
def test_train_step_jaxpr_does_not_grow_with_depth():
    from jqlora.train.step import _train_step_impl
    from jqlora.train.optim import make_optimizer

    counts = {}
    for layers in (2, 8):
        m = _model(layers, remat="nothing_saveable")
        opt = nnx.Optimizer(m, make_optimizer(1e-3, 1, 10), wrt=nnx.LoRAParam)
        ids = np.asarray(_ids(1, 12))[None]
        batches = {"input_ids": ids, "targets": ids, "loss_mask": np.ones(ids.shape, np.float32),
                   "positions": np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape)}
        graphdef, state = nnx.split((m, opt))
        step = lambda st, b: _train_step_impl(*nnx.merge(graphdef, st), b)  # noqa: E731
        counts[layers] = _count(jax.make_jaxpr(step)(state, batches).jaxpr)
    assert counts[2] == counts[8] > 0, counts
    # the layers are one stack: every weight kind one array with a leading layer axis
    m = _model(8)
    assert len(m.model.layers.stacks) == 1
    assert m.model.layers.stacks[0].layer.mlp.up_proj.lora_A.shape == (8, 4, 64)


def test_scan_equals_python_loop_logits_and_lora_grads():
    m = _model(3)
    ids = _ids()
    np.testing.assert_allclose(np.asarray(m(ids)), np.asarray(_loop_logits(m, ids)), rtol=1e-5, atol=1e-5)
    l_scan, g_scan = _grads(m, _loss_fn(ids))
    l_loop, g_loop = _grads(m, lambda mm: jnp.mean(jax.nn.log_softmax(_loop_logits(mm, ids)).max(-1)))
    np.testing.assert_allclose(float(l_scan), float(l_loop), rtol=1e-6)
    g_scan, g_loop = lora.lora_state_by_module(m, g_scan), lora.lora_state_by_module(m, g_loop)
    assert len(g_scan) == 21 and set(g_scan) == set(g_loop)
    for name in g_scan:
        for k in ("lora_A", "lora_B"):
            ref = np.asarray(g_loop[name][k])
            assert np.abs(ref).max() > 0, (name, k)
            np.testing.assert_allclose(np.asarray(g_scan[name][k]), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_layers_that_differ_get_their_own_stacks_and_names_stay():
    cfg = {**CFG, "num_hidden_layers": 4}
    params = models.init_params(cfg, seed=1, std=0.1)
    for n in ("self_attn.q_proj", "mlp.down_proj"):  # layer 2 quantized (like skip-modules the other way)
        params[f"model.layers.2.{n}"] = quant.quantize_4bit(params.pop(f"model.layers.2.{n}.weight"), "nf4")
    m = _model(4, quantize=None, params=params)
    assert [(s.start, s.size) for s in m.model.layers.stacks] == [(0, 2), (2, 1), (3, 1)]
    ids = _ids()
    np.testing.assert_allclose(np.asarray(m(ids)), np.asarray(_loop_logits(m, ids)), rtol=1e-5, atol=1e-5)
    assert isinstance(m.model.layers[2].self_attn.q_proj.base.get_value(), quant.Weight4bit)
    assert not isinstance(m.model.layers[3].self_attn.q_proj.base.get_value(), quant.Weight4bit)
    # LoRA on one layer only splits the stack it falls in; names and init order are those of a loop
    one = _model(3, targets=("model.layers.1.self_attn.q_proj",))
    assert [(s.start, s.size) for s in one.model.layers.stacks] == [(0, 1), (1, 1), (2, 1)]
    assert list(lora.lora_params_by_module(one)) == ["model.layers.1.self_attn.q_proj"]
    np.testing.assert_allclose(np.asarray(one(ids)), np.asarray(_loop_logits(one, ids)), rtol=1e-5, atol=1e-5)


def test_layer_views_write_through_and_return_states():
    m = _model(3)
    ids = _ids()
    logits, states = m(ids, return_states=True)
    assert len(states["layers"]) == 3 and states["layers"][0].shape == (2, 12, 64)
    view = m.model.layers[1].mlp.up_proj
    w = view.base.get_value()
    view.base.set_value(quant.quantize_4bit(quant.dequantize(w, jnp.float32) * 2.0, "nf4"))
    _, after = m(ids, return_states=True)
    np.testing.assert_array_equal(np.asarray(after["layers"][0]), np.asarray(states["layers"][0]))
    assert not np.allclose(np.asarray(after["layers"][1]), np.asarray(states["layers"][1]))
    with pytest.raises(ValueError, match="whole values"):
        stacked_view(m.model.layers.stacks[0].layer.mlp.up_proj, 0).lora_B.set_value(jnp.zeros((3, 3)))


# ------------------------------------------------------------------------------ generation
def test_generate_compiles_once_whatever_the_number_of_tokens():
    m = _model(2)
    m.eval()
    ids = _ids(1, 5)
    compiles = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        counts = {}
        for n in (4, 32):
            jax.clear_caches()
            compiles.clear()
            out = generate(m, ids, n)
            assert out.shape == (1, 5 + n)
            counts[n] = len(compiles)
        compiles.clear()
        generate(m, ids, 17)  # same bucket as 4 and 32: nothing compiles that holds the model
        again = len(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counts[4] == counts[32], counts
    assert _generate._cache_size() == 1 and again <= 3, again  # only tiny host-side slices
    # the prefix of a longer generation is the shorter one (greedy), with the same program
    np.testing.assert_array_equal(np.asarray(generate(m, ids, 4)), np.asarray(generate(m, ids, 32))[:, :9])


# ------------------------------------------------------------------------------ remat policies
POLICIES = (False, "dots_with_no_batch_dims_saveable", "nothing_saveable", "dots_saveable", "everything_saveable")


def _residuals(policy):
    m = _model(2, remat=policy)
    graphdef, lora_state, rest = nnx.split(m, nnx.LoRAParam, ...)
    ids = _ids(1, 12)
    f = lambda ls: _loss_fn(ids)(nnx.merge(graphdef, ls, rest))  # noqa: E731
    return saved_residuals(f, lora_state)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_policy_keeps_a_dense_weight_for_backward(policy):
    res = _residuals(policy)
    assert res
    for aval, why in res:
        dense = jnp.issubdtype(aval.dtype, jnp.floating) and tuple(aval.shape[-2:]) in WEIGHT_SHAPES
        assert not dense, f"{policy}: a dense weight-shaped residual {aval.str_short()} ({why})"


def test_full_remat_keeps_less_than_no_remat():
    nbytes = lambda res: sum(a.size * a.dtype.itemsize for a, _ in res)  # noqa: E731
    none, dots, full = (nbytes(_residuals(p)) for p in (False, "dots_with_no_batch_dims_saveable", "nothing_saveable"))
    assert full < dots < none, (full, dots, none)


# ------------------------------------------------------------------------------ remat="auto"
def test_remat_plan_orders_policies_and_fits_the_device():
    cfg = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    gib = 2 ** 30
    roomy = models.remat_plan(cfg, 1, 2048, device_bytes=141 * gib)
    assert roomy.policy is None and "remat: none (predicted" in roomy.reason
    p = roomy.predicted
    # the scanned 8B step measured on an H200 (2026-11-26): 21.9 GiB without remat, 7.19 with
    # full remat (benchmarks/results/JOURNAL.md)
    assert abs(p["none"] / gib - 21.9) < 0.1 * 21.9 and abs(p["nothing_saveable"] / gib - 7.19) < 0.1 * 7.19
    # and 16,384 tokens without remat did not fit 141 GB: auto must not pick it there
    assert models.remat_plan(cfg, 1, 16384, device_bytes=141 * gib).policy == "nothing_saveable"
    assert p["nothing_saveable"] < p["none"] < p["dots_with_no_batch_dims_saveable"]
    assert models.remat_plan(cfg, 1, 2048, device_bytes=int(p["none"] / 0.9) - 1).policy == "nothing_saveable"
    # the einsum attention keeps (T, heads) scores without remat: the matmul outputs fit first
    long = models.remat_plan(cfg, 1, 8192, device_bytes=None, attention="einsum").predicted
    assert long["nothing_saveable"] < long["dots_with_no_batch_dims_saveable"] < long["none"]
    mid = models.remat_plan(cfg, 1, 8192, device_bytes=int(long["dots_with_no_batch_dims_saveable"] / 0.9) + 1,
                            attention="einsum")
    assert mid.policy == "dots_with_no_batch_dims_saveable"
    # CPU: the host memory this process may use (tests/models/test_remat_auto.py)
    assert models.remat_plan(cfg, 1, 2048, device_bytes=None).memory_source != "device memory"


def test_remat_auto_model_runs_and_matches_no_remat():
    ids = _ids()
    (l0, g0), (l1, g1) = _grads(_model(2, remat=False), _loss_fn(ids)), _grads(_model(2, remat="auto"), _loss_fn(ids))
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="unknown remat policy"):
        _model(2, remat="fastest")


@pytest.mark.parametrize("spec", ["data=2", "fsdp=2"])
def test_remat_auto_under_a_mesh_plans_for_one_device(monkeypatch, spec):
    """Traced under a mesh, the shapes are global: the plan must take one device's rows (batch /
    (data * fsdp)) and one device's weight shards (/ fsdp). The device is sized so that one
    device's share fits without remat and more than that (every row, or every weight) does not."""
    from jqlora import parallel
    from jqlora.ops import sharding
    from jqlora.models import remat
    from jqlora.models.remat import state_bytes

    m = _model(2, remat="auto")
    ids = _ids(2, 12)
    fsdp = 2 if spec == "fsdp=2" else 1
    one_device = remat.remat_plan(m.config, 1, 12, device_bytes=None, param_bytes=state_bytes(m) // fsdp,
                                  compute_dtype=jnp.float32, attention="einsum", lora_rank=4).predicted["none"]
    monkeypatch.setattr(remat, "device_memory", lambda: int(one_device / remat.HEADROOM) + 1)
    plans = []
    monkeypatch.setattr(remat.RematPlan, "log", lambda self: plans.append(self))
    graphdef, state = nnx.split(m)
    forward = lambda st: nnx.merge(graphdef, st)(ids)  # noqa: E731

    def chosen(mesh_spec):
        plans.clear()
        with sharding.activate(None if mesh_spec is None else parallel.make_mesh(mesh_spec)):
            jax.eval_shape(forward, state)
        assert len(plans) == 1, plans
        return plans[0]

    assert chosen(None).policy is not None  # both rows on one device: remat
    if fsdp == 2:  # one device's rows with every weight: remat
        assert chosen("data=2").policy is not None
    plan = chosen(spec)
    assert plan.policy is None, plan.reason
    assert plan.predicted["none"] == one_device
