"""Long sequences under full remat: the MLP in checkpointed chunks (`remat.mlp_chunk_for`), each
layer's input offloaded to host memory (`offload_layer_inputs`), and what `remat_plan` picks for
them at the 8B shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jqlora import models
from jqlora.models import remat
from test_scan import CFG, _grads, _ids, _loss_fn, _model

CHUNK = 8  # MLP_CHUNK_TOKENS in these tests: T = 32 runs the MLP in 4 chunks
LAYERS = 2
GIB = 2 ** 30


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(remat, "MLP_CHUNK_TOKENS", CHUNK)


def _grad_jaxpr(policy, t):
    m = _model(LAYERS, remat=policy)
    graphdef, lora_state, rest = nnx.split(m, nnx.LoRAParam, ...)
    loss = _loss_fn(_ids(1, t))
    return jax.make_jaxpr(jax.grad(lambda ls: loss(nnx.merge(graphdef, ls, rest))))(lora_state).jaxpr


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(j, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(j, "eqns"):
                yield j


def _nested_scan_lengths(jaxpr, depth=0) -> list:
    """Lengths of the scans inside another scan (the loop over MLP chunks inside the loop over
    layers), in the order met."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and depth > 0:
            out.append(eqn.params["length"])
        for inner in _sub_jaxprs(eqn):
            out += _nested_scan_lengths(inner, depth + (eqn.primitive.name == "scan"))
    return out


def _layer_scans(jaxpr) -> list:
    return [e for e in jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == LAYERS]


# ------------------------------------------------------------------------------ numerics
@pytest.fixture(scope="module")
def no_remat_grads():
    """Loss and LoRA gradients without remat (whole rows, no chunks), computed once for every
    policy compared with it."""
    return _grads(_model(LAYERS, remat=False), _loss_fn(_ids(2, 4 * CHUNK)))


@pytest.mark.parametrize("policy", ["nothing_saveable", "offload_layer_inputs"])
def test_chunked_full_remat_equals_no_remat(small_chunks, no_remat_grads, policy):
    ids = _ids(2, 4 * CHUNK)
    assert remat.mlp_chunk_for(remat.REMAT_POLICIES[policy], ids.shape[1]) == CHUNK
    l0, g0 = no_remat_grads
    l1, g1 = _grads(_model(LAYERS, remat=policy), _loss_fn(ids))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1) == 2 * 7  # A and B of 7 projections, stacked over layers
    for a, b in zip(leaves0, leaves1):
        ref = np.asarray(a)
        assert ref.shape[0] == LAYERS and np.abs(ref).max() > 0
        np.testing.assert_allclose(np.asarray(b), ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


# ------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("policy, t, chunks", [
    ("nothing_saveable", 4 * CHUNK, 4),
    ("offload_layer_inputs", 3 * CHUNK, 3),
    ("nothing_saveable", 2 * CHUNK, 2),
    ("nothing_saveable", CHUNK, None),  # shorter than two chunks: whole rows
    ("nothing_saveable", 2 * CHUNK + 4, None),  # not a multiple of the chunk
    (False, 4 * CHUNK, None),  # no remat keeps the MLP's activations: nothing to gain
    ("dots_with_no_batch_dims_saveable", 4 * CHUNK, None),
])
def test_mlp_runs_in_chunks_only_under_full_remat_of_long_rows(small_chunks, policy, t, chunks):
    jaxpr = _grad_jaxpr(policy, t)
    layer_scans = _layer_scans(jaxpr)
    assert len(layer_scans) == 2  # the forward and the backward loop over layers
    for eqn in layer_scans:  # both the forward and the recomputing backward run the chunk loop
        inner = _nested_scan_lengths(eqn.params["jaxpr"].jaxpr, depth=1)
        assert inner == ([] if chunks is None else [chunks]), (policy, t, inner)


def _residual_outputs(jaxpr) -> list:
    """What the forward loop over layers hands to the backward one: its stacked outputs."""
    fwd = _layer_scans(jaxpr)[0]
    return [v.aval for v in fwd.outvars]


@pytest.mark.parametrize("policy", ["nothing_saveable", "offload_layer_inputs"])
def test_offload_keeps_layer_inputs_in_host_memory(policy):
    b, t, h = 1, 12, CFG["hidden_size"]
    avals = _residual_outputs(_grad_jaxpr(policy, t))
    stacked = [a for a in avals if tuple(a.shape) == (LAYERS, b, t, h)]
    assert len(stacked) == 1, avals  # the layer inputs, one (B, T, H) per layer
    host = [a for a in avals if a.memory_space == jax.memory.Space.Host]
    if policy == "offload_layer_inputs":
        assert host == stacked and "<host>" in str(stacked[0]), avals
    else:
        assert host == [] and stacked[0].memory_space == jax.memory.Space.Device, avals


# ------------------------------------------------------------------------------ the plan at 8B
def _plan(seq_len, **kw):
    from benchmarks.train_bench import hf_config

    kw.setdefault("host_bytes", 108 * 10**9)  # what the CLI lets XLA pin on a 128 GiB machine
    return models.remat_plan(hf_config("8b"), 1, seq_len, device_bytes=79 * GIB, **kw)


def test_remat_plan_offloads_only_sequences_whose_layer_inputs_fill_the_device():
    at_128k = _plan(131072)
    assert at_128k.policy == "nothing_saveable", at_128k.reason
    assert "host memory" not in at_128k.reason
    long = _plan(360448)
    assert long.policy == "offload_layer_inputs", long.reason
    device = long.predicted["offload_layer_inputs"]
    assert long.predicted["nothing_saveable"] > 0.9 * 79 * GIB > device
    # compiled 8B step on an H200 (XLA memory analysis): 33.5 GiB temporaries + 5.8 GiB arguments
    # on the device, 88 GiB of host temporaries; the plan errs on the safe side, not far
    assert 39.3 * GIB <= device <= 1.3 * 39.3 * GIB, device / GIB
    host = 360448 * 32 * 4096 * 2  # every layer's bf16 input
    assert host == 88 * GIB and "88.0 GiB of layer inputs in host memory" in long.reason, long.reason


def test_remat_plan_offloads_no_more_than_xla_may_pin(monkeypatch):
    """The 88 GiB of layer inputs at 360,448 tokens do not fit XLA's default 64 GB of pinned host
    memory (a run failed allocating them): the plan says so instead of choosing the offload; with
    the limit raised (the env variable XLA reads, or `host_bytes`) it offloads."""
    from jqlora._util import HOST_LIMIT_ENV

    monkeypatch.setenv(HOST_LIMIT_ENV, "")  # XLA's default (restored afterwards)
    capped = _plan(360448, host_bytes=None)
    assert capped.policy == "offload_layer_inputs" and "may not fit" in capped.reason, capped.reason
    assert HOST_LIMIT_ENV in capped.reason and "over XLA's limit of 59.6 GiB" in capped.reason, capped.reason
    monkeypatch.setenv(HOST_LIMIT_ENV, "106")
    raised = _plan(360448, host_bytes=None)
    assert "may not fit" not in raised.reason and "88.0 GiB of layer inputs" in raised.reason, raised.reason
    assert _plan(131072, host_bytes=1).policy == "nothing_saveable"  # no offload: the limit is moot


def test_the_cli_raises_xla_host_limit_from_the_ram():
    from jqlora._util import HOST_LIMIT_ENV, raise_host_offload_limit

    env = {}
    assert raise_host_offload_limit(env, ram_bytes=125 * GIB) == 106 and env == {HOST_LIMIT_ENV: "106"}
    env = {}
    assert raise_host_offload_limit(env, ram_bytes=32 * GIB) == 64 and env == {}  # never lowered
    env = {HOST_LIMIT_ENV: "20"}
    assert raise_host_offload_limit(env, ram_bytes=512 * GIB) == 20 and env == {HOST_LIMIT_ENV: "20"}


def test_the_cli_sets_the_host_limit_before_its_command(monkeypatch):
    from jqlora import _util
    from jqlora.cli import main

    monkeypatch.setenv(_util.HOST_LIMIT_ENV, "")  # unset for the CLI; restored afterwards
    monkeypatch.setattr(_util, "physical_memory", lambda: 200 * GIB)
    assert main(["explain-kernel", "--weight", "nf4", "--m", "1", "--n", "64", "--k", "64", "--device", "cpu"]) == 0
    import os

    assert os.environ[_util.HOST_LIMIT_ENV] == "170"


def test_remat_plan_counts_one_mlp_chunk(monkeypatch):
    t = 65536
    chunked = _plan(t).predicted["nothing_saveable"]
    # the compiled 8B step at 65,536 tokens peaked at 28.8 GiB (H200)
    assert 0.9 * 28.8 * GIB <= chunked <= 1.15 * 28.8 * GIB, chunked / GIB
    monkeypatch.setattr(remat, "MLP_CHUNK_TOKENS", 2 * t)  # no chunking at this length
    whole = _plan(t).predicted["nothing_saveable"]
    # one layer's MLP working set (4 x intermediate x bf16 per token) shrinks to one chunk's
    saved = t * 4 * 14336 * 2 * (1 - 16384 / t)
    assert whole - chunked == pytest.approx(saved, rel=1e-6), ((whole - chunked) / GIB, saved / GIB)
