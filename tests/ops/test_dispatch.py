"""The dispatch table (jqlora/ops/dispatch.py RULES): parity with what `auto` chose before the
table existed, every row valid and reachable, `explain` and `choose_plan` on one code path, and
docs/kernels.md showing the table as it is."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

from jqlora.ops import dispatch
from jqlora.quant import Int8Weight, Weight4bit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SNAPSHOT = os.path.join(ROOT, "tests", "data", "auto_dispatch_before.json")
GPU, HOPPER = dispatch.Device("gpu", sm90=False), dispatch.Device("gpu", sm90=True)


def _weight4(n, k, blocksize, quant_type="nf4"):
    return Weight4bit(packed=np.zeros((n * k + 1) // 2, np.uint8),
                      absmax=np.zeros(-(-n * k // blocksize), np.float32),
                      code=np.zeros(16, np.float32), shape=(n, k), quant_type=quant_type,
                      blocksize=blocksize)


def _weight8(n, k):
    return Int8Weight(cb=np.zeros((n, k), np.int8), scb=np.zeros((n,), np.float32))


def _snapshot_weight(kind, n, k):
    """(weight, numerics) for a snapshot kind: nf4_bs<B>, int8 or llm_int8."""
    if kind.startswith("nf4_bs"):
        return _weight4(n, k, int(kind[len("nf4_bs"):])), "weight_only"
    if kind in ("int8", "llm_int8"):
        return _weight8(n, k), ("llm_int8" if kind == "llm_int8" else "weight_only")
    raise ValueError(f"{SNAPSHOT}: unknown weight kind {kind!r}")


def _outcome(q, m, backend="auto", **kw):
    try:
        p = dispatch.choose_plan(q, m, backend, **kw)
        return (p.backend, p.fwd, p.bwd)
    except dispatch.BackendError as e:
        return ("error", str(e))


def _checked_ms(runs, top):
    """Every M up to 256 (all thresholds but one and the kernels' own M limits live there), each
    run's ends and their neighbours (a change of the old choice is a run end), and a stride over
    the rest."""
    ms = set(range(1, 257)) | set(range(257, top + 1, 29))
    for lo, hi, *_ in runs:
        ms |= {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1}
    return sorted(m for m in ms if 1 <= m <= top)


def _parity_mismatches(grid, monkeypatch):
    bad = []
    for entry in grid:
        monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
        monkeypatch.setattr(dispatch, "mgpu_available", lambda h=entry["hopper"]: h)
        q, numerics = _snapshot_weight(entry["kind"], entry["n"], entry["k"])
        runs = entry["runs"]
        top = runs[-1][1]
        it = iter(runs)
        run = next(it)
        for m in _checked_ms(runs, top):
            while m > run[1]:
                run = next(it)
            want = tuple(run[2:])
            got = _outcome(q, m, dtype=entry["dtype"], numerics=numerics)
            if got != want:
                bad.append((entry["kind"], entry["n"], entry["k"], entry["dtype"], entry["hopper"], m, want, got))
    return bad


@pytest.fixture(scope="module")
def snapshot():
    with open(SNAPSHOT) as f:
        data = json.load(f)
    assert data["grid"], f"{SNAPSHOT}: empty grid"
    return data["grid"]


def test_auto_matches_the_snapshot(snapshot, monkeypatch):
    """Same (backend, fwd, bwd) as `auto` chose at commit 9f97009, over 7 shapes, 3 dtypes, 5
    weight kinds, Hopper and not."""
    bad = _parity_mismatches(snapshot, monkeypatch)
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


def test_parity_check_catches_a_moved_bound(snapshot, monkeypatch):
    """The parity check fails when one M bound moves by one row."""
    rules = list(dispatch.RULES)
    i = next(i for i, r in enumerate(rules) if r.variant == "mgpu_mma_pair_table")
    rules[i] = dataclasses.replace(rules[i], m=(1, rules[i].m[1] + 1))
    monkeypatch.setattr(dispatch, "RULES", tuple(rules))
    bad = _parity_mismatches([e for e in snapshot if e["kind"] == "nf4_bs64" and e["hopper"]], monkeypatch)
    assert bad and {b[5] for b in bad} == {49}


def test_rows_name_registered_variants_of_the_right_op():
    from pallas_kernels import registry

    assert dispatch.RULES
    for r in dispatch.RULES:
        if r.variant is None:
            assert r.requires == "auto backend", f"{r}: an xla row must be a preference of auto"
            continue
        assert registry.get(r.variant).op == r.op, r
    assert {r.op for r in dispatch.RULES} == {op for *_, op in dispatch.OPS}


def test_rows_cover_every_m_with_an_any_row():
    """For each (weight, product), the "any" rows cover M = 0.. without gaps or overlaps, so a
    declined Mosaic row always has a Triton row (or the shape's own error) behind it."""
    for weight, product, _ in dispatch.OPS:
        spans = sorted(r.m for r in dispatch.RULES
                       if (r.weight, r.product, r.requires) == (weight, product, "any"))
        assert spans[0][0] == 0 and spans[-1][1] is None, (weight, product, spans)
        for (_, hi), (lo, _) in zip(spans, spans[1:]):
            assert lo == hi + 1, (weight, product, spans)


def _chosen_rows(expl, weight):
    kind = {"nf4": "4bit", "fp4": "4bit"}.get(weight, weight)
    return {(kind, prod, None if var == "xla" else var) for prod, var, verdict in expl.rows if verdict == "chosen"}


def test_every_row_is_reachable():
    seen = set()
    for weight, device, dtype, backend, (n, k), bs, m in itertools.product(
            ("nf4", "int8", "llm_int8"), (GPU, HOPPER), ("bfloat16", "float32"), ("auto", "pallas"),
            ((4096, 4096), (4096, 11008)), (64, 32), (0, 1, 2, 3, 16, 48, 49, 64, 65, 128, 129, 2048)):
        try:
            expl = dispatch.explain(weight, m, n, k, blocksize=bs, dtype=dtype, device=device, backend=backend)
        except dispatch.BackendError:
            continue
        seen |= _chosen_rows(expl, weight)
    unreached = [r for r in dispatch.RULES if (r.weight, r.product, r.variant) not in seen]
    assert not unreached, f"rows no shape picks (shadowed by an earlier row?): {unreached}"


def test_explain_names_the_choice_and_why_rows_declined():
    text = str(dispatch.explain("nf4", 16, 4096, 4096, device=GPU))
    assert text.startswith("backend pallas: fwd block_scaled_dot_prmt, bwd dequant_dot_t")
    lines = [" ".join(ln.split()) for ln in text.splitlines()]
    assert "fwd block_scaled_dot_prmt pallas_kernels/triton/block_scaled_dot.py chosen" in lines
    assert ("fwd mgpu_mma_pair_table pallas_kernels/mosaic/mgpu_mma_pair_table.py needs sm90 and "
            "16-bit x") in lines
    assert "fwd gemv_block_scaled pallas_kernels/triton/gemv_block_scaled.py M=16 outside 0..2" in lines
    assert "fwd dequant_dot pallas_kernels/triton/matmul_4bit.py an earlier row matched" in lines

    hopper = dispatch.explain("nf4", 200, 4096, 4096, device=HOPPER)
    assert hopper.plan == dispatch.Plan("pallas", "mgpu_decoded_wgmma", "dequant_dot_t")
    assert ("fwd", "mgpu_mma_pair_table", "M=200 outside 1..48") in hopper.rows
    assert ("bwd", "mgpu_decoded_wgmma_t", "M=200 outside 1..128") in hopper.rows

    veto = dispatch.explain("nf4", 1, 4096, 11008, blocksize=32, device=HOPPER)
    assert veto.plan.fwd == "gemv_block_scaled"
    assert ("fwd", "mgpu_mma_pair_table",
            "supports() declines M=1, N=4096, K=11008, blocksize=32") in veto.rows


def test_explain_names_files_that_hold_the_variants():
    """Every row's variant is printed with its file (`variant_file`, from the registry), and the
    file is there."""
    for rule in dispatch.RULES:
        if rule.variant is not None:
            path = dispatch.variant_file(rule.variant)
            assert os.path.isfile(os.path.join(ROOT, path)), (rule.variant, path)
    assert dispatch.variant_file("xla") == "jnp reference"


def test_explain_says_why_xla():
    llm = dispatch.explain("llm_int8", 1, 4096, 4096, device=HOPPER)
    assert llm.plan == dispatch.Plan("xla") and "faster" in str(llm)
    assert dispatch.explain("llm_int8", 1, 4096, 4096, device=HOPPER, backend="pallas").plan == \
        dispatch.Plan("pallas", "llm_int8_tiled", "int8_dequant_dot_t")
    cpu = dispatch.explain("nf4", 1, 4096, 4096, device=dispatch.Device("cpu"))
    assert cpu.plan == dispatch.Plan("xla") and "non-GPU" in str(cpu) and cpu.rows == ()
    odd = dispatch.explain("nf4", 1, 96, 96, device=GPU)
    assert odd.plan == dispatch.Plan("xla") and "multiple of the blocksize" in str(odd)


@pytest.mark.parametrize("backend", dispatch.BACKENDS)
def test_explain_and_choose_plan_agree(backend):
    for (weight, q, numerics), device, dtype, m in itertools.product(
            (("nf4", _weight4(4096, 4096, 64), "weight_only"), ("fp4", _weight4(256, 1024, 32, "fp4"), "weight_only"),
             ("nf4", _weight4(96, 96, 64), "weight_only"), ("int8", _weight8(4096, 4096), "weight_only"),
             ("llm_int8", _weight8(4096, 4096), "llm_int8")),
            (GPU, HOPPER, dispatch.Device("cpu")), ("bfloat16", "float32"), (0, 1, 2, 3, 48, 49, 128, 129, 1025)):
        n, k = q.shape
        bs = q.blocksize if isinstance(q, Weight4bit) else 64
        try:
            a = dispatch.explain(weight, m, n, k, blocksize=bs, dtype=dtype, device=device, backend=backend).plan
        except dispatch.BackendError as e:
            a = ("error", str(e))
        b = _outcome(q, m, backend, numerics=numerics, dtype=dtype, device=device)
        assert (a if isinstance(a, tuple) else (a.backend, a.fwd, a.bwd)) == b, (weight, device, dtype, m)


def test_device_current_reads_the_probes_at_call_time(monkeypatch):
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "mgpu_available", lambda: True)
    assert dispatch.Device.current() == HOPPER
    assert dispatch.choose_plan(_weight4(4096, 4096, 64), 16, "auto", dtype="bfloat16").fwd == "mgpu_mma_pair_table"
    monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
    monkeypatch.setattr(dispatch, "mgpu_available", lambda: False)
    assert dispatch.Device.current() == dispatch.Device("cpu")
    assert dispatch.choose_plan(_weight4(4096, 4096, 64), 16, "auto", dtype="bfloat16") == dispatch.Plan("xla")


def test_explicit_backends_keep_their_errors():
    q = _weight4(4096, 4096, 64)
    with pytest.raises(dispatch.BackendError, match="needs a GPU"):
        dispatch.choose_plan(q, 1, "pallas", device=dispatch.Device("cpu"))
    with pytest.raises(dispatch.BackendError, match="Hopper GPU only"):
        dispatch.choose_plan(q, 16, "pallas", variant="mgpu_decoded_wgmma", dtype="bfloat16", device=GPU)
    with pytest.raises(dispatch.BackendError, match="Hopper GPU only"):
        dispatch.choose_plan(q, 16, "interpret", variant="mgpu_mma_pair_table", device=HOPPER)
    with pytest.raises(dispatch.BackendError, match="multiple of the blocksize"):
        dispatch.choose_plan(_weight4(96, 96, 64), 1, "interpret", device=GPU)
    with pytest.raises(dispatch.BackendError, match="does not support M=0"):
        dispatch.choose_plan(_weight8(64, 64), 0, "auto", device=GPU)  # split-K takes M >= 1
    with pytest.raises(dispatch.BackendError, match="unknown backend"):
        dispatch.explain("nf4", 1, 64, 64, backend="cuda", device=GPU)
    with pytest.raises(ValueError, match="unknown weight"):
        dispatch.explain("nf3", 1, 64, 64, device=GPU)


def test_a_bad_rule_is_rejected():
    with pytest.raises(ValueError, match="unknown requirement"):
        dispatch.Rule("4bit", "fwd", "h100", (1, 2), "gemv_block_scaled", "")
    with pytest.raises(ValueError, match="empty"):
        dispatch.Rule("4bit", "fwd", "any", (3, 2), "gemv_block_scaled", "")


def test_docs_show_the_table_as_it_is():
    with open(os.path.join(ROOT, "docs", "kernels.md")) as f:
        doc = f.read()
    assert dispatch.markdown_table() in doc, (
        "docs/kernels.md: the dispatch table differs from RULES; paste jqlora.ops.dispatch.markdown_table()")
