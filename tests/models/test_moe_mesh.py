"""A mixture-of-experts model trains on a device mesh (jqlora.parallel) as on one device, with its
expert stacks cut over ``fsdp``: the NF4 `ExpertWeights`, the experts' stacked LoRA factors and
their AdamW moments each held half per device under fsdp=2, whole under data=2.

Runs in the suite's process on its 2 forced CPU host devices (tests/conftest.py sets
``--xla_force_host_platform_device_count=2``): a tiny random Qwen3-MoE saved by transformers +
bitsandbytes (experts dense in the folder, quantized to NF4 at load) of two layers, a mixture-of-experts
layer and a dense-MLP one (two layer stacks: each mesh compiles one train step, the cost of this file),
LoRA on attention and experts, 3 steps of `jqlora.train.train` on fixed token rows, float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

import moe_checkpoints as mc  # noqa: E402
from jqlora import models, parallel, quant  # noqa: E402
from jqlora.lora import LoraConfig  # noqa: E402
from jqlora.lora.linear import QuantizedBase  # noqa: E402
from jqlora.train import TrainConfig, make_optimizer, train  # noqa: E402

pytestmark = pytest.mark.torch

SPECS = ("data=1", "fsdp=2", "data=2")  # data=1: the one-device path
STEPS, BATCH, SEQ = 3, 4, 16
RTOL, ATOL = 1e-5, 1e-6  # fp32 on CPU: a mesh changes only the order of sums


class _Batches:
    """Fixed pseudo-random token rows: a BatchIterator stand-in."""

    def __init__(self):
        self.i = 0

    def __next__(self):
        rng = np.random.default_rng(1000 + self.i)
        self.i += 1
        ids = rng.integers(1, 256, (BATCH, SEQ + 1)).astype(np.int32)
        mask = np.ones((BATCH, SEQ), np.float32)
        mask[:, :4] = 0.0
        return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
                "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
                "segment_ids": np.ones((BATCH, SEQ), np.int32)}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = int(state["i"])


def _per_device(x) -> set:
    """The bytes each device holds of array x (one value when all hold the same)."""
    held = {}
    for s in x.addressable_shards:
        held[s.device.id] = held.get(s.device.id, 0) + int(s.data.nbytes)
    assert len(held) == len(x.sharding.device_set)
    return set(held.values())


def _expert_arrays(model, optimizer=None) -> dict:
    """{name: array}: every array of the expert stacks, the experts' LoRA factors and (with the
    optimizer) their optimizer state."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, QuantizedBase)):
        w = var.get_value()
        if isinstance(w, quant.ExpertWeights):
            for i, leaf in enumerate(jax.tree.leaves(w)):
                out[".".join(map(str, path)) + f"[{i}]"] = leaf
    states = [nnx.state(model, nnx.LoRAParam)] + ([] if optimizer is None else [nnx.state(optimizer)])
    for state in states:
        for path, var in nnx.to_flat_state(state):
            if "experts" in map(str, path) and path[-1] in ("lora_A", "lora_B"):
                out[".".join(map(str, path))] = var.get_value()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if len(jax.devices()) < 2:
        pytest.skip("needs the suite's 2 forced host devices (tests/conftest.py)")
    ckpt = mc.save_layout(mc.tiny_moe("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1]),
                          tmp_path_factory.mktemp("qwen3_moe-2-layers"), "nf4")
    lcfg = LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    root = tmp_path_factory.mktemp("moe-mesh")
    out = {}
    for spec in SPECS:
        mesh = spec
        model = models.load_causal_lm(str(ckpt), lora=lcfg, compute_dtype=jnp.float32, mesh=mesh, rngs=nnx.Rngs(0))
        loaded = {k: _per_device(v) for k, v in _expert_arrays(model).items()}
        cfg = TrainConfig(seq_len=SEQ, batch_size=BATCH, lr=5e-3, warmup=1, steps=STEPS, seed=0, save_every=0,
                          log_every=1, progress=False, tensorboard=False, out_dir=str(root / spec.replace("=", "")),
                          mesh=mesh)
        res = train(model, cfg, data=_Batches())
        # train's optimizer stays inside it: one placed as train places its own shows where the
        # AdamW moments live
        optimizer = nnx.Optimizer(model, make_optimizer(5e-3, 1, STEPS), wrt=nnx.LoRAParam)
        parallel.place_state(model, optimizer, parallel.resolve_mesh(mesh, BATCH))
        arrays = _expert_arrays(model, optimizer)
        out[spec] = {"losses": res.losses, "grad_norms": res.grad_norms, "loaded": loaded,
                     "trained": {k: _per_device(v) for k, v in arrays.items()},
                     "bytes": {k: int(v.nbytes) for k, v in arrays.items()},
                     "lora": {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}}
    return out


@pytest.mark.parametrize("spec", SPECS[1:])
def test_moe_mesh_training_matches_one_device(runs, spec):
    one, got = runs["data=1"], runs[spec]
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["grad_norms"], one["grad_norms"], rtol=RTOL, atol=ATOL)
    assert sorted(got["lora"]) == sorted(one["lora"])
    experts_b = [k for k in one["lora"] if "experts" in map(str, k) and k[-1] == "lora_B"]
    assert len(experts_b) == 2 and all(np.abs(one["lora"][k]).max() > 0 for k in experts_b)  # B starts at 0
    for k, ref in one["lora"].items():
        # AdamW divides by the root of the second moment: an element whose gradient is near 0
        # moves by up to lr on a rounding difference, so the factors agree to lr / 50
        np.testing.assert_allclose(got["lora"][k], ref, rtol=1e-4, atol=1e-4, err_msg=str(k))


@pytest.mark.parametrize("spec,fsdp", [("fsdp=2", 2), ("data=2", 1)])
def test_expert_stacks_are_cut_over_fsdp(runs, spec, fsdp):
    """Each device holds 1/fsdp of every expert array: the NF4 stacks from the loader on, and after
    training the stacks and the expert LoRA factors, and the AdamW moments of those factors."""
    got = runs[spec]
    names = got["bytes"]
    assert any(".base[" in k for k in names) and any("mu" in k for k in names)
    assert sum(k.endswith("lora_A") and "opt_state" not in k for k in names) == 2  # 1 MoE layer x 2 stacks
    for k, held in got["loaded"].items():
        assert held == {got["bytes"][k] // fsdp}, (spec, "loaded", k, held)
    for k, held in got["trained"].items():
        assert held == {got["bytes"][k] // fsdp}, (spec, "trained", k, held)
