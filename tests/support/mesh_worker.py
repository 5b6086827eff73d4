"""Train a tiny NF4 checkpoint on several device meshes in one process; run by tests/models/test_mesh.py.

Not a test module. JAX reads ``XLA_FLAGS=--xla_force_host_platform_device_count`` once, when it
starts, so each mesh test runs this script in a fresh subprocess with the flag set (one process
for every mesh in turn: one JAX start-up and one set of compilations shared).

    python tests/support/mesh_worker.py CKPT ROOT --meshes "data=1;data=4;fsdp=4;data=2,fsdp=2"
        [--devices 4] [--resume-mesh data=2,fsdp=2]
        [--coordinator 127.0.0.1:PORT --num-processes 2 --process-id I]

For each mesh it loads CKPT with ``load_causal_lm(..., mesh=...)``, trains LoRA on every linear
layer for STEPS steps (fp32, fixed token batches) with ``jqlora.train.train``, exports a PEFT
adapter, and records the losses, the final LoRA weights and, for each 4-bit weight, the sharding
of its packed codes and the bytes each device holds. ``data=1`` is the one-device path. With
``--resume-mesh`` that mesh also trains half the steps, stops (a checkpoint), and resumes from it
in a freshly loaded model. Results go to ``ROOT/<mesh>/`` (train out_dir, ``adapter/``) and
``ROOT/results.json`` + ``ROOT/lora.npz``; under ``jax.distributed`` process I writes under
``ROOT/p<I>/``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("root")
    p.add_argument("--meshes", default="data=1;data=4;fsdp=4;data=2,fsdp=2")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--resume-mesh", default=None)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    return p.parse_args(argv)


STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 128


class Batches:
    """Fixed pseudo-random token rows (the same in every process): a BatchIterator stand-in."""

    def __init__(self):
        self.i = 0

    def __next__(self):
        import numpy as np

        rng = np.random.default_rng(1000 + self.i)
        self.i += 1
        ids = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
        mask = np.ones((BATCH, SEQ), np.float32)
        mask[:, : SEQ // 4] = 0.0  # a prompt part without loss
        return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
                "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
                "segment_ids": np.ones((BATCH, SEQ), np.int32)}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = int(state["i"])


def main(argv=None) -> int:
    a = _args(argv if argv is not None else sys.argv[1:])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={a.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if a.coordinator:
        jax.distributed.initialize(a.coordinator, num_processes=a.num_processes, process_id=a.process_id)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jqlora import adapters, models, parallel, quant
    from jqlora.lora import LoraConfig
    from jqlora.lora.linear import QuantizedBase
    from jqlora.train import TrainConfig, train

    root = os.path.join(a.root, f"p{a.process_id}") if a.coordinator else a.root
    os.makedirs(root, exist_ok=True)
    lcfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"])

    def load(mesh):
        return models.load_causal_lm(a.ckpt, lora=lcfg, compute_dtype=jnp.float32, mesh=mesh,
                                     rngs=nnx.Rngs(0))

    def config(out_dir, mesh, **kw):
        return TrainConfig(seq_len=SEQ, batch_size=BATCH, lr=5e-3, warmup=1, steps=a.steps, seed=0,
                           out_dir=out_dir, save_every=0, log_every=1, progress=False, mesh=mesh, **kw)

    def shards(model):
        out = {}
        for path, var in nnx.to_flat_state(nnx.state(model, QuantizedBase)):
            w = var.get_value()
            if not isinstance(w, quant.Weight4bit):
                continue
            name = ".".join(str(p) for p in path)
            per_device = {}
            for s in w.packed.addressable_shards:
                per_device[str(s.device.id)] = per_device.get(str(s.device.id), 0) + int(s.data.nbytes)
            out[name] = {"bytes": int(w.packed.nbytes), "spec": str(getattr(w.packed.sharding, "spec", None)),
                         "absmax_spec": str(getattr(w.absmax.sharding, "spec", None)),
                         "devices": len(w.packed.sharding.device_set), "per_device": per_device}
        return out

    def lora(model):
        return {".".join(str(p) for p in path): np.asarray(v.get_value())
                for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}

    results, arrays = {}, {}
    for spec in [s for s in a.meshes.split(";") if s]:
        mesh = parallel.resolve_mesh(spec)
        tag = spec.replace(",", "_").replace("=", "")
        model = load(mesh)
        placed = shards(model)  # right after loading: the loader put each tensor on its shards
        res = train(model, config(os.path.join(root, tag), spec), data=Batches())
        entry = {"losses": res.losses, "grad_norms": res.grad_norms, "loaded": placed,
                 "trained": shards(model), "mesh_devices": 1 if mesh is None else int(mesh.size)}
        if mesh is not None:  # the loader's put: one tensor straight onto its shards
            put = parallel.placement(mesh)(np.arange(4096, dtype=np.uint8))
            entry["placement"] = sorted(int(s.data.nbytes) for s in put.addressable_shards)
        if jax.process_index() == 0 or a.coordinator:
            adapters.save_adapter(os.path.join(root, tag, "adapter"), model, lcfg)
        for k, v in lora(model).items():
            arrays[f"{tag}/{k}"] = v
        if spec == a.resume_mesh:
            first = load(mesh)
            out = os.path.join(root, tag + "_resumed")
            train(first, config(out, spec), data=Batches(), on_step=lambda s, m: s < a.steps // 2)
            again = load(mesh)
            r2 = train(again, config(out, spec, resume=True), data=Batches())
            entry["resumed"] = {"from": r2.resumed_from, "losses": r2.losses}
            for k, v in lora(again).items():
                arrays[f"{tag}_resumed/{k}"] = v
        results[spec] = entry
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    np.savez(os.path.join(root, "lora.npz"), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
