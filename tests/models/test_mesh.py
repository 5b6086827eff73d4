"""Training on a device mesh (jqlora.parallel) gives the one-device results, with the frozen weights
really cut over ``fsdp``.

JAX reads ``--xla_force_host_platform_device_count`` once at start-up, so the mesh runs happen in
subprocesses (tests/support/mesh_worker.py): one process with 4 CPU devices trains the tiny NF4 checkpoint
on meshes data=1 (the one-device path), data=4, fsdp=4 and data=2,fsdp=2, and this file compares
them. Two processes under ``jax.distributed`` (2 CPU devices each) train on data=4 across them.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import checkpoint_factory
from jqlora import parallel

HERE = Path(__file__).resolve().parent
MESHES = ["data=1", "data=4", "fsdp=4", "data=2,fsdp=2"]
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESUME = "data=2,fsdp=2"
# fp32 on CPU: a mesh changes only the order of the sums (over rows, over devices)
RTOL, ATOL = 2e-4, 2e-6


def _env():
    # the worker sets its own device count and keeps the suite's other XLA flags (tests/conftest.py:
    # less compile time; the distributed test compares its processes with this worker's results)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))


def _run(args, timeout=240):
    return subprocess.run([sys.executable, str(HERE.parent / "support" / "mesh_worker.py"), *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _tag(spec):
    return spec.replace(",", "_").replace("=", "")


@pytest.fixture(scope="module")
def nf4_ckpt(tmp_path_factory):
    return checkpoint_factory.cached_llama_checkpoint(tmp_path_factory, quant="nf4")


@pytest.fixture(scope="module")
def mesh_runs(nf4_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    p = _run([str(nf4_ckpt), str(root), "--meshes", ";".join(MESHES), "--resume-mesh", RESUME])
    assert p.returncode == 0, p.stderr[-4000:]
    results = json.loads((root / "results.json").read_text())
    with np.load(root / "lora.npz") as z:
        lora = {k: z[k] for k in z.files}
    return root, results, lora


def _lora_of(lora, spec):
    pre = _tag(spec) + "/"
    return {k[len(pre):]: v for k, v in lora.items() if k.startswith(pre)}


@pytest.mark.parametrize("spec", MESHES[1:])
def test_mesh_training_matches_one_device(mesh_runs, spec):
    """Same losses, gradient norms and final LoRA weights as the one-device run."""
    _, results, lora = mesh_runs
    one, got = results["data=1"], results[spec]
    assert one["mesh_devices"] == 1 and got["mesh_devices"] == 4
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["grad_norms"], one["grad_norms"], rtol=RTOL, atol=ATOL)
    ref, new = _lora_of(lora, "data=1"), _lora_of(lora, spec)
    assert sorted(ref) == sorted(new)
    for name in LINEARS:  # per-layer or stacked layers: every target module has its A and B
        assert {"lora_A", "lora_B"} <= {k.rsplit(".", 1)[-1] for k in ref if name in k}, name
    moved = 0
    for k in ref:
        np.testing.assert_allclose(new[k], ref[k], rtol=RTOL, atol=ATOL, err_msg=k)
        moved += not np.allclose(ref[k], 0)
    assert moved == len(ref)  # every LoRA matrix trained (B starts at zero)
    assert one["losses"][-1] < one["losses"][0]


@pytest.mark.parametrize("spec,fsdp", [("data=4", 1), ("fsdp=4", 4), ("data=2,fsdp=2", 2)])
def test_frozen_weights_are_cut_over_fsdp(mesh_runs, spec, fsdp):
    """Every device holds 1/fsdp of each packed 4-bit weight, from the loader on."""
    _, results, _ = mesh_runs
    assert results[spec]["placement"] == [4096 // fsdp] * 4
    for when in ("loaded", "trained"):
        weights = results[spec][when]
        assert all(any(name in k for k in weights) for name in LINEARS), sorted(weights)
        for name, w in weights.items():
            assert w["devices"] == 4, (when, name)
            assert sorted(int(d) for d in w["per_device"]) == [0, 1, 2, 3], (when, name)
            assert set(w["per_device"].values()) == {w["bytes"] // fsdp}, (when, name, w)
            for spec_ in (w["spec"], w["absmax_spec"]):  # a stacked layer axis is never cut
                assert spec_ == "P()" if fsdp == 1 else spec_ in ("P('fsdp',)", "P(None, 'fsdp')"), (when, name, w)


def _files(d: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[f"{f.relative_to(d).parent.name or '.'}:{k}"] = v
    return out


def test_checkpoint_resume_and_peft_export_match_one_device(mesh_runs):
    """Checkpoints and PEFT adapters written from sharded state hold the keys, shapes and dtypes
    of the one-device files, with the same values; a run stopped halfway and resumed on the mesh
    ends where the straight run does."""
    root, results, lora = mesh_runs
    for what in ("checkpoints", "adapter"):
        ref = _files(root / _tag("data=1") / what)
        got = _files(root / _tag(RESUME) / what)
        assert ref and sorted(ref) == sorted(got), what
        for k in ref:
            assert ref[k].dtype == got[k].dtype and ref[k].shape == got[k].shape, k
            np.testing.assert_allclose(got[k], ref[k], rtol=RTOL, atol=ATOL, err_msg=k)
    a = json.loads((root / _tag("data=1") / "adapter" / "adapter_config.json").read_text())
    b = json.loads((root / _tag(RESUME) / "adapter" / "adapter_config.json").read_text())
    assert a == b
    resumed = results[RESUME]["resumed"]
    assert resumed["from"] == 2 and len(resumed["losses"]) == 2
    np.testing.assert_allclose(resumed["losses"], results["data=1"]["losses"][2:], rtol=RTOL, atol=ATOL)
    ref, new = _lora_of(lora, "data=1"), _lora_of(lora, _tag(RESUME) + "_resumed")
    for k in ref:
        np.testing.assert_allclose(new[k], ref[k], rtol=RTOL, atol=ATOL, err_msg=k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_under_jax_distributed(nf4_ckpt, mesh_runs, tmp_path):
    """Two processes, 2 CPU devices each, one data=4 mesh across them: the one-device results."""
    _, results, lora = mesh_runs
    addr = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, str(HERE.parent / "support" / "mesh_worker.py"), str(nf4_ckpt), str(tmp_path), "--meshes", "data=4",
         "--devices", "2", "--coordinator", addr, "--num-processes", "2", "--process-id", str(i)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    ref = _lora_of(lora, "data=1")
    for i in range(2):
        got = json.loads((tmp_path / f"p{i}" / "results.json").read_text())["data=4"]
        np.testing.assert_allclose(got["losses"], results["data=1"]["losses"], rtol=RTOL, atol=ATOL)
        with np.load(tmp_path / f"p{i}" / "lora.npz") as z:
            for k in ref:
                np.testing.assert_allclose(z["data4/" + k], ref[k], rtol=RTOL, atol=ATOL, err_msg=k)


def test_default_mesh_takes_the_devices_the_batch_splits_over():
    """The default (no --mesh) puts every device on `data` only where the batch splits over them:
    batch 1 runs on one device (the plain path), never a batch-split error."""
    n = len(jax.devices())
    assert parallel.resolve_mesh(None, 1) is None
    if n < 2:
        pytest.skip("needs the suite's forced host devices (tests/conftest.py)")
    assert parallel.resolve_mesh(None, n).shape["data"] == n
    assert parallel.resolve_mesh(None, 2 * n).shape["data"] == n
    odd = parallel.resolve_mesh(None, n + 1 if n % 2 == 0 else 1)
    assert odd is None or odd.shape["data"] == math.gcd(n, n + 1)
