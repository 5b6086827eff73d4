"""Conformance suite of the grouped (mixture-of-experts) kernels: every variant of
`registry.grouped_variants()` against its reference, with no list to edit.

- The tile schedule every grouped kernel shares (`reference.grouped.grouped_tiles`) covers each row
  below sum(group_sizes) exactly once, one group and one row block per tile, on ragged sizes
  (empty experts, one expert taking every row, sizes not multiples of the tile, M past the sum).
- Each variant runs against its reference on those shapes where it can run here: interpretable
  variants in Pallas interpret mode on CPU, all compiled on a GPU of their platform (Mosaic GPU
  variants: a Hopper GPU). On CPU the sm90 variants lower for CUDA (a Mosaic GPU module comes
  out) and their module's numpy twin of the schedule and the stores (`emulate`) is compared with
  the reference.
- Bad operands get an error naming the operand; sm90 variants refuse interpret mode and 32-bit x;
  M = 0 gives an empty product; the metadata is valid.
- On a Hopper GPU, qgmm's own plan (dequant pass + kernel) against its xla backend, forward and dx.
"""
from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ir_fingerprint import lowered_modules
from pallas_kernels import registry
from pallas_kernels.reference.grouped import grouped_tiles, zero_rows_past_groups

GROUPED = registry.grouped_variants()
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
FORWARD_OPS = ("grouped_matmul", "grouped_matmul_4bit")
# (E, N, K, group sizes, M): ragged cases at the Mosaic kernels' granularity (N, K multiples of 128)
CASES = (  # ragged: an empty expert between others, sizes off the tiles, M past the sum
    ("ragged", 4, 256, 128, (70, 0, 130, 3), 210),
    ("one-takes-all", 3, 128, 256, (0, 300, 0), 300),
    ("empty", 2, 128, 128, (0, 0), 9),
)


def _module(v):
    return importlib.import_module(registry.module_of(v.name))


def _runs_here(v) -> str | None:
    if v.platform == "sm90" and not (ON_GPU and registry.platform_available("sm90")):
        return "Mosaic GPU kernel: needs a Hopper GPU (CPU: lowering and emulation tests)"
    if not v.interpret and not ON_GPU:
        return "no interpret mode"
    return None


# ------------------------------------------------------------------------------------------
# the shared tile schedule
# ------------------------------------------------------------------------------------------
def schedule_problems(tiles, gs, m, block_m) -> list[str]:
    """What is wrong with a (3, T) schedule for group sizes `gs` over M rows."""
    gs = np.asarray(gs)
    ends = np.minimum(np.cumsum(gs), m)
    starts = ends - np.minimum(gs, ends)
    covered = np.zeros(m, int)
    problems = []
    for t, (g, lo, hi) in enumerate(np.asarray(tiles).T):
        if hi == lo:
            continue
        if not (starts[g] <= lo < hi <= ends[g]):
            problems.append(f"tile {t}: rows [{lo}, {hi}) outside group {g}'s [{starts[g]}, {ends[g]})")
        if lo // block_m != (hi - 1) // block_m:
            problems.append(f"tile {t}: rows [{lo}, {hi}) span two row blocks")
        covered[lo:hi] += 1
    total = int(min(gs.sum(), m))
    if (covered[:total] != 1).any() or covered[total:].any():
        problems.append(f"rows covered {covered.tolist()} times, expected once below {total}")
    if np.asarray(tiles).shape[1] != -(-m // block_m) + len(gs) - 1:
        problems.append("tile count is not the static bound cdiv(M, block_m) + E - 1")
    return problems


@settings(max_examples=30, deadline=None)
@given(e=st.sampled_from([1, 9]), m=st.sampled_from([37, 300]), block_m=st.sampled_from([8, 64, 128]),
       data=st.data())
def test_schedule_covers_each_row_once(e, m, block_m, data):
    """Few static shapes (one compilation each), any group sizes summing to at most M."""
    gs = data.draw(st.lists(st.integers(0, m), min_size=e, max_size=e))
    if sum(gs) > m:
        gs = [g * m // sum(gs) for g in gs]
    if data.draw(st.booleans()):  # one expert takes every row
        gs = [0] * e
        gs[data.draw(st.integers(0, e - 1))] = m
    tiles = grouped_tiles(jnp.asarray(gs, jnp.int32), m, block_m)
    assert schedule_problems(tiles, gs, m, block_m) == []


def loop_invariant_full_size_values(fn, y, *args) -> list[str]:
    """The primitives in fn's jaxpr (nested calls too) that make a y-shaped value depending on none
    of fn's inputs: an iota, a broadcast constant. Inside a scan over layers XLA hoists such a
    value out of the loop and keeps it live for the whole loop (a y-sized buffer per product)."""

    def walk(jaxpr, depends_in) -> list[str]:
        depends = dict(zip(jaxpr.invars, depends_in))
        found = []
        for eqn in jaxpr.eqns:
            ins = [not isinstance(v, jax.extend.core.Literal) and depends.get(v, False) for v in eqn.invars]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += walk(sub, ins)
            for out in eqn.outvars:
                depends[out] = any(ins)
                if not any(ins) and tuple(out.aval.shape) == tuple(y.shape):
                    found.append(str(eqn.primitive))
        return found

    closed = jax.make_jaxpr(fn)(y, *args)
    return walk(closed.jaxpr, [True] * len(closed.jaxpr.invars))


def test_zeroing_rows_past_the_groups_makes_no_loop_invariant_full_size_value():
    y = jnp.ones((96, 40), jnp.bfloat16)
    gs = jnp.asarray([30, 0, 50], jnp.int32)
    assert loop_invariant_full_size_values(zero_rows_past_groups, y, gs) == []
    got = np.asarray(zero_rows_past_groups(y * jnp.nan, gs), np.float32)
    assert np.isnan(got[:80]).all() and (got[80:] == 0).all()  # unwritten rows (NaN) past the groups -> 0

    def hoistable(y, group_sizes):  # the row index and the zero as constants: both y-sized
        rows = jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
        return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))

    assert len(loop_invariant_full_size_values(hoistable, y, gs)) == 2


def test_the_tile_schedules_run_no_loop():
    """The schedules are computed in every MoE layer, forward and backward: a binary search there
    (jnp.searchsorted's default) is a while loop of small kernels and copies on a GPU."""
    from jqlora.lora.experts import _tile_rows

    gs = jnp.asarray([5, 0, 130, 1], jnp.int32)
    for name, fn in (("grouped_tiles", lambda g: grouped_tiles(g, 140, 64)),
                     ("_tile_rows", lambda g: _tile_rows(g, 140)[:3])):
        text = str(jax.make_jaxpr(fn)(gs))
        assert "while[" not in text and "scan[" not in text, f"{name} runs a loop"


def test_planted_bug_in_the_schedule_is_caught():
    gs, m, bm = [5, 0, 130, 1], 140, 64
    tiles = np.array(grouped_tiles(jnp.asarray(gs, jnp.int32), m, bm))
    off = tiles.copy()
    off[2, 1] += 1  # one tile's end a row too far
    assert schedule_problems(off, gs, m, bm)
    swapped = tiles.copy()
    swapped[0] = np.where(tiles[2] > tiles[1], len(gs) - 1 - tiles[0], 0)  # experts in reverse order
    assert schedule_problems(swapped, gs, m, bm)


# ------------------------------------------------------------------------------------------
# every variant against its reference
# ------------------------------------------------------------------------------------------
def _operands(v, e, n, k, gs, m, dtype=jnp.bfloat16, seed=0):
    """(args, kwargs, weight (E, N, K) in x's dtype as the reference takes it)."""
    from jqlora.quant import quantize_experts

    key = jax.random.key(seed)
    fwd = v.op in FORWARD_OPS
    a = jax.random.normal(key, (m, k if fwd else n), jnp.float32).astype(dtype)
    w32 = jax.random.normal(jax.random.fold_in(key, 1), (e, n, k), jnp.float32)
    g = jnp.asarray(gs, jnp.int32)
    if v.op.startswith("grouped_matmul_4bit"):
        from jqlora.ops.qgmm import kernel_operands

        packed, absmax, code = kernel_operands(quantize_experts(w32, "nf4", 64, double_quant=False))
        return (a, g, packed, absmax, code), dict(blocksize=64), None
    return (a, g, w32.astype(dtype)), {}, w32.astype(dtype)


def _reference(v, args, kw):
    return v.reference(*args, **kw, out_dtype=jnp.float32)


def _assert_close(got, want, a, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(np.asarray(a, np.float64)).sum(1, keepdims=True) * 4.0 + 1.0
    bad = np.abs(got - want) > 2e-3 * np.abs(want) + 1e-5 * scale
    assert not bad.any(), f"{what}: {bad.sum()} entries off, max diff {np.abs(got - want).max()}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("name", [v.name for v in GROUPED])
def test_variant_matches_its_reference(name, case):
    v = registry.get(name)
    why = _runs_here(v)
    if why:
        pytest.skip(f"{name}: {why}")
    _, e, n, k, gs, m = next(c for c in CASES if c[0] == case)
    args, kw, _ = _operands(v, e, n, k, gs, m)
    got = v.fn(*args, **kw, out_dtype=jnp.float32, interpret=INTERPRET)
    want = _reference(v, args, kw)
    assert got.shape == want.shape and got.dtype == jnp.float32
    _assert_close(got, want, args[0], f"{name} {case}")
    assert not np.asarray(got[sum(gs):]).any(), f"{name} {case}: rows past the groups not zero"


TRITON_4BIT_CONFIGS = (  # the tuning keywords grouped_bench sweeps: tiles, warps, stages, decode method
    dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    dict(block_m=32, block_n=32, block_k=32, method="select"),
)


@pytest.mark.parametrize("cfg", TRITON_4BIT_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("name", ["grouped_dot_4bit", "grouped_dot_4bit_t"])
def test_triton_4bit_kernels_match_the_reference_at_other_tiles(name, cfg):
    """Column / contraction tiles wider than the 64-scale block and narrower than it, row blocks
    larger than a whole group, and the select-tree decode give the reference's product too."""
    v = registry.get(name)
    _, e, n, k, gs, m = CASES[0]
    args, kw, _ = _operands(v, e, n, k, gs, m)
    assert set(cfg) <= set(v.default_config(m, n, k, 64))
    got = v.fn(*args, **kw, **cfg, out_dtype=jnp.float32, interpret=INTERPRET)
    _assert_close(got, _reference(v, args, kw), args[0], f"{name} {cfg}")


SM90 = [v.name for v in GROUPED if v.platform == "sm90"]


@pytest.mark.parametrize("name", SM90)
def test_sm90_lowers_for_cuda(name):
    v = registry.get(name)
    s = jax.ShapeDtypeStruct
    e, n, k, m = 8, 256, 512, 1000
    a = s((m, k if v.op in FORWARD_OPS else n), jnp.bfloat16)
    if v.op.startswith("grouped_matmul_4bit"):
        f, w = (lambda a, g, p, sc, c: v.fn(a, g, p, sc, c, blocksize=64),
                (s((e, n, k // 2), jnp.uint8), s((e, n, k // 64), jnp.float32), s((16,), jnp.float32)))
    else:
        f, w = (lambda a, g, w: v.fn(a, g, w)), (s((e, n, k), jnp.bfloat16),)
    try:
        triton, mosaic = lowered_modules(f, (a, s((e,), jnp.int32), *w))
    except Exception as err:  # noqa: BLE001
        if "Unable to" in str(err) or "no CUDA" in str(err):  # pragma: no cover
            pytest.skip(f"this jax cannot lower Mosaic GPU kernels without a GPU: {err}")
        raise
    assert mosaic and not triton, (name, len(mosaic), len(triton))


@pytest.mark.parametrize("name", [v.name for v in GROUPED if v.platform == "gpu"])
def test_triton_variants_lower_for_cuda(name, lower_for_triton):
    """The Triton grouped kernels lower for CUDA (Pallas -> Triton IR) at Qwen3-30B-A3B shapes,
    non-power-of-two N and K included, on a machine without a GPU."""
    v = registry.get(name)
    s = jax.ShapeDtypeStruct
    e, n, k, m = 128, 768, 2048, 16384
    a = s((m, k if v.op in FORWARD_OPS else n), jnp.bfloat16)
    if v.op.startswith("grouped_matmul_4bit"):
        args = (a, s((e,), jnp.int32), s((e, n, k // 2), jnp.uint8), s((e, n, k // 64), jnp.float32),
                s((16,), jnp.float32))
        lower_for_triton(name, lambda *x: v.fn(*x, blocksize=64, interpret=False), *args)
    else:
        lower_for_triton(name, lambda *x: v.fn(*x, interpret=False), a, s((e,), jnp.int32), s((e, n, k), jnp.bfloat16))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("name", [n for n in SM90 if hasattr(_module(registry.get(n)), "emulate")])
def test_sm90_emulation_matches_the_reference(name, case):
    v = registry.get(name)
    _, e, n, k, gs, m = next(c for c in CASES if c[0] == case)
    args, kw, w = _operands(v, e, n, k, gs, m, dtype=jnp.float32)
    got = _module(v).emulate(args[0], args[1], w, transpose_w=v.op in FORWARD_OPS)
    _assert_close(got, _reference(v, args, kw), args[0], f"{name} emulation {case}")


# ------------------------------------------------------------------------------------------
# errors, empty batches, metadata
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [v.name for v in GROUPED])
def test_bad_operands_get_clear_errors(name):
    v = registry.get(name)
    args, kw, _ = _operands(v, 2, 128, 128, (3, 4), 8)
    bad = [("x of rank 1", 0, lambda a: a[0], "must be 2-D"),
           ("x a column short", 0, lambda a: a[:, :-1], "columns but the expert stack"),
           ("group sizes of floats", 1, lambda g: g.astype(jnp.float32), "`group_sizes` must be integer"),
           ("one group size too many", 1, lambda g: jnp.concatenate([g, g[:1]]), "`group_sizes` must be integer")]
    for what, i, change, match in bad:
        broken = [change(a) if j == i else a for j, a in enumerate(args)]
        with pytest.raises(ValueError, match=match):
            v.fn(*broken, **kw, interpret=v.interpret and INTERPRET)
    if v.platform == "sm90":
        with pytest.raises(NotImplementedError, match="interpret"):
            v.fn(*args, **kw, interpret=True)
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            v.fn(args[0].astype(jnp.float32), *args[1:], **kw)


@pytest.mark.parametrize("name", [v.name for v in GROUPED])
def test_empty_batch_gives_an_empty_product(name):
    v = registry.get(name)
    args, kw, _ = _operands(v, 2, 128, 128, (0, 0), 0)
    y = v.fn(*args, **kw, interpret=v.interpret and INTERPRET)
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


def test_metadata_is_valid():
    assert GROUPED, "no grouped variants registered"
    for v in GROUPED:
        assert v.op in registry.GROUPED_OPS and v.description and v.status in registry.STATUSES, v.name
        assert v.numerics == "rounded_weight", v.name
        assert v.interpret == (v.platform == "gpu"), v.name
        assert registry.get(v.name) is v and v not in registry.all_variants()
        assert v.supports(16384, 768, 2048, 64) and v.supports(16384, 2048, 768, 64), v.name  # Qwen3-30B-A3B
        if v.default_config is not None:
            cfg = v.default_config(16384, 768, 2048, 64)
            if v.config_type is None:  # keyword configuration: keywords the kernel takes, its defaults
                params = inspect.signature(v.fn).parameters
                assert isinstance(cfg, dict) and cfg, v.name
                assert all(k in params and params[k].default == value for k, value in cfg.items()), (v.name, cfg)
                continue
            assert isinstance(cfg, v.config_type), v.name
            n_out, kc = (768, 2048) if v.op in FORWARD_OPS else (2048, 768)
            assert _module(v).shape_problem(16384, n_out, kc, 64, cfg) is None, v.name


def test_grouped_rules_name_registered_variants_of_the_right_op():
    from jqlora.ops import dispatch, grouped_dispatch

    for r in grouped_dispatch.GROUPED_RULES:
        if r.variant is not None:
            op = registry.get(r.variant).op
            assert op.startswith("grouped_matmul") and op.endswith("_t") == (r.product == "bwd"), r
            assert ("4bit" in op) <= (r.weight == "4bit"), r  # only a 4-bit stack has packed operands
            assert os_path_exists(dispatch.variant_file(r.variant)), r


def os_path_exists(rel):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.isfile(os.path.join(root, rel))


def test_decoding_kernels_fit_their_pipeline_into_shared_memory():
    """`smem_bytes` against what Mosaic GPU counted on an H200 for two configs it refused
    (233,536 B: backward, two warpgroups, 4 stages, bf16 out; 240,688 B: forward, two warpgroups,
    3 stages, float32 out), less only its barriers; `fitted` brings both under the limit."""
    from pallas_kernels.mosaic.grouped_mgpu_4bit import Grouped4bitConfig, fitted, smem_bytes
    from pallas_kernels.mosaic.mgpu_pipeline import SMEM_LIMIT

    for forward, depth, itemsize, mosaic in ((False, 4, 2, 233536), (True, 3, 4, 240688)):
        cfg = Grouped4bitConfig(compute_wgs=2, max_concurrent_steps=depth)
        ours = smem_bytes(cfg, forward=forward, out_itemsize=itemsize)
        assert 0 <= mosaic - ours <= 1088, (forward, ours, mosaic)
        fit = fitted(cfg, forward=forward, out_itemsize=itemsize)
        assert 2 <= fit.max_concurrent_steps < depth
        assert smem_bytes(fit, forward=forward, out_itemsize=itemsize) <= SMEM_LIMIT
    default = Grouped4bitConfig(compute_wgs=2)  # the step's configs: bf16 out, 3 stages, unchanged
    assert fitted(default, forward=True, out_itemsize=2) == default == fitted(default, forward=False, out_itemsize=2)


SM90_4BIT = [v.name for v in GROUPED if v.platform == "sm90" and "4bit" in v.op]
# Grouped4bitConfig settings the compiled suite runs besides the default: two compute warpgroups
SM90_4BIT_CONFIGS = ({}, {"compute_wgs": 2})


@pytest.mark.skipif(not (ON_GPU and registry.platform_available("sm90")), reason="needs a Hopper GPU")
@pytest.mark.parametrize("settings", SM90_4BIT_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", SM90_4BIT)
def test_sm90_4bit_kernels_decode_bitsandbytes_weights_bit_for_bit(name, dtype, settings):
    """Unit rows of x pick single weights: the forward of x = I gives W_e^T, the backward of
    dy = I gives W_e, each expert's block equal bit for bit to bitsandbytes' dequantization
    (fp32 code * absmax, one rounding to x's dtype), for blocksizes 64 and 128 (64 only with two
    compute warpgroups)."""
    from jqlora.ops.qgmm import kernel_operands
    from jqlora.quant import quantize_experts
    from pallas_kernels.mosaic.grouped_mgpu_4bit import Grouped4bitConfig
    from pallas_kernels.reference.fourbit import dequantize_4bit_reference

    v = registry.get(name)
    e, n, k = 2, 256, 256
    config = Grouped4bitConfig(**settings)
    for bs in (64, 128) if config.compute_wgs == 1 else (64,):
        ex = quantize_experts(jax.random.normal(jax.random.key(bs), (e, n, k), jnp.float32), "nf4", bs,
                              double_quant=bs == 64)
        packed, absmax, code = kernel_operands(ex)
        w = jnp.stack([dequantize_4bit_reference(packed[i], absmax[i], code, blocksize=bs, out_dtype=dtype)
                       for i in range(e)]).reshape(e, n, k)
        rows = k if v.op in FORWARD_OPS else n
        eye = jnp.tile(jnp.eye(rows, dtype=dtype), (e, 1))
        got = v.fn(eye, jnp.full((e,), rows, jnp.int32), packed, absmax, code, blocksize=bs, out_dtype=dtype,
                   config=config)
        want = jnp.concatenate([w[i].T if v.op in FORWARD_OPS else w[i] for i in range(e)])
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), (name, bs)


@pytest.mark.skipif(not (ON_GPU and registry.platform_available("sm90")), reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", [c[0] for c in CASES[:2]])
@pytest.mark.parametrize("name", SM90_4BIT)
def test_sm90_4bit_kernels_with_two_warpgroups_match_the_reference(name, case):
    from pallas_kernels.mosaic.grouped_mgpu_4bit import Grouped4bitConfig

    v = registry.get(name)
    _, e, n, k, gs, m = next(c for c in CASES if c[0] == case)
    n, k = 2 * n, 2 * k  # multiples of 256: two 128-row tiles a work item
    args, kw, _ = _operands(v, e, n, k, gs, m)
    got = v.fn(*args, **kw, out_dtype=jnp.float32, config=Grouped4bitConfig(compute_wgs=2))
    _assert_close(got, _reference(v, args, kw), args[0], f"{name} two warpgroups {case}")
    assert not np.asarray(got[sum(gs):]).any()


# ------------------------------------------------------------------------------------------
# qgmm's plan on the device against its xla backend (compiled GPU suite)
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not (ON_GPU and registry.platform_available("sm90")), reason="needs a Hopper GPU")
@pytest.mark.parametrize("fmt", ["nf4", "int8", "bf16"])
def test_qgmm_auto_plan_on_hopper_matches_xla(fmt):
    from jqlora import ops
    from jqlora.quant import ExpertWeights, quantize_experts

    e, n, k = 8, 256, 512
    gs = jnp.asarray([100, 0, 37, 400, 1, 0, 250, 3], jnp.int32)
    m = 800
    w = jax.random.normal(jax.random.key(0), (e, n, k), jnp.float32) * 0.05
    ex = ExpertWeights.from_dense(w.astype(jnp.bfloat16)) if fmt == "bf16" else quantize_experts(w, fmt)
    plan = ops.choose_grouped_plan(ex, m, "auto", dtype="bfloat16")
    want = "mgpu_grouped_dot_4bit" if fmt == "nf4" else "mgpu_grouped_dot"  # the NF4 stack decoded in the kernel
    assert plan.backend == "pallas" and plan.fwd == want and plan.bwd == want + "_t"
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)

    def run(backend):
        y, vjp = jax.vjp(lambda x: ops.qgmm(x, gs, ex, backend=backend, out_dtype=jnp.float32), x)
        return y, vjp(dy.astype(jnp.float32))[0]

    (y, dx), (y0, dx0) = jax.jit(lambda: run("auto"))(), jax.jit(lambda: run("xla"))()
    _assert_close(y, y0, x, f"qgmm {fmt} forward")
    _assert_close(dx, dx0, dy, f"qgmm {fmt} dx")
    assert not np.asarray(y[int(gs.sum()):]).any() and not np.asarray(dx[int(gs.sum()):]).any()
