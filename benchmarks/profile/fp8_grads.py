"""Where the FP8 base products move the training step: LoRA gradients and a short loss curve of the
train_bench model with `--base-matmul fp8`, against the compute-dtype products, parameter by
parameter, with the forward and the backward switched to FP8 one at a time.

    OUT=/tmp/out python -m benchmarks.profile.fp8_grads --shape 8b [--layers N] [--seq 2048] [--steps 10]

Modes, each on its own copy of the same model (same random NF4 weights, same LoRA A):
  compute   both base products in the compute dtype (the default)
  fp8       both on E4M3 operands (`--base-matmul fp8`)
  fp8_fwd   the forward on FP8, the backward (dx) in the compute dtype
  fp8_bwd   the forward in the compute dtype, the backward on FP8
  f32       everything in float32 (not a default mode: `--modes f32,compute,fp8` compares both
            bf16 modes with it)
With `--model DIR` (a bitsandbytes NF4 checkpoint, e.g. the cached SmolLM2-135M) the model is that
checkpoint and the batch is English text from its tokenizer, `--seq` tokens (no loss curve).
The first mode is the reference the others are compared with.
Per mode: the loss and LoRA gradients of one batch with LoRA B drawn from N(0, 0.01) (B = 0 would
give A no gradient), compared leaf by leaf and layer by layer with `compute`'s (cosine, norm
ratio); then B back to 0 and `--steps` steps of `train_bench`'s loop on one batch (the losses).
Writes $OUT/fp8_grads_<shape>.json and prints one line per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

MODES = ("compute", "fp8", "fp8_fwd", "fp8_bwd")
ALL_MODES = MODES + ("f32",)
TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries the market grew into a town with walls, a cathedral and a "
        "university, and the river was bridged in stone. ")


def _patched(mode: str):
    """Context: in fp8_fwd / fp8_bwd, one of qmatmul's two FP8 products replaced by the
    compute-dtype product (qmatmul looks both up at trace time)."""
    import contextlib
    import importlib

    qm = importlib.import_module("jqlora.ops.qmatmul")  # the module (jqlora.ops.qmatmul is also the function's name)

    @contextlib.contextmanager
    def ctx():
        saved = qm.forward_fp8, qm.backward_fp8
        if mode == "fp8_fwd":
            qm.backward_fp8 = lambda plan, dy, q, *, out_dtype: qm.backward_product(plan, dy, q, out_dtype=out_dtype)
        elif mode == "fp8_bwd":
            qm.forward_fp8 = lambda plan, x, q, *, out_dtype: qm.forward_product(
                plan, x, q, out_dtype=out_dtype, numerics="weight_only")
        try:
            yield
        finally:
            qm.forward_fp8, qm.backward_fp8 = saved

    return ctx()


def _checkpoint_model(path: str, seq: int, compute_dtype, base_matmul: str):
    """A bitsandbytes checkpoint with LoRA r=16 on every projection, and one batch of text."""
    import jax.numpy as jnp
    import numpy as np
    from tokenizers import Tokenizer

    from jqlora.lora import LoraConfig
    from jqlora.models import load_causal_lm

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = []
    while len(ids) < seq + 1:
        ids += tok.encode(TEXT).ids
    ids = np.asarray(ids[:seq + 1], np.int32)[None, None]
    model = load_causal_lm(path, lora=LoraConfig(rank=16, alpha=32, target_modules="all-linear"),
                           compute_dtype=jnp.dtype(compute_dtype), base_matmul=base_matmul)
    batch = {"input_ids": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, 1, seq), np.float32),
             "positions": np.arange(seq, dtype=np.int32)[None, None]}
    return model, batch


def run_mode(mode: str, shape: str, layers, seq: int, steps: int, ref_grads, checkpoint=None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.rollout_bench import randomize_lora_b
    from benchmarks.train_bench import build_jax
    from jqlora.train.step import chunked_cross_entropy, train_step

    t0 = time.perf_counter()
    base_matmul = "compute" if mode in ("compute", "f32") else "fp8"
    compute_dtype = "float32" if mode == "f32" else "bfloat16"
    with _patched(mode):
        if checkpoint:
            model, batch = _checkpoint_model(checkpoint, seq, compute_dtype, base_matmul)
            opt, steps = None, 0
        else:
            # cuDNN attention takes 16-bit operands only
            attention = "cudnn" if jax.default_backend() == "gpu" and mode != "f32" else "einsum"
            model, opt, batch = build_jax(shape, seq, "auto", attention, layers=layers, remat="auto",
                                          base_matmul=base_matmul, compute_dtype=compute_dtype)
            del batch["segment_ids"]
        mb = {k: v[0] for k, v in batch.items()}
        # a snapshot (new Variable objects, same arrays) of the fresh LoRA, B = 0, restored before the curve
        zero_b = jax.tree.map(lambda a: a, nnx.state(model, nnx.LoRAParam))
        randomize_lora_b(model, seed=1)

        @nnx.jit
        def loss_and_grads(m):
            def f(m):
                h = m(mb["input_ids"], return_hidden=True, positions=mb["positions"])
                s, n = chunked_cross_entropy(m.lm_logits, h, mb["targets"], mb["loss_mask"])
                return s / n
            return nnx.value_and_grad(f, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

        loss, grads = loss_and_grads(model)
        flat = {jax.tree_util.keystr(p): np.asarray(jax.device_get(g.astype(jnp.float32)))
                for p, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]}
        nnx.update(model, zero_b)
        # train_step's compiled program is shared by models of one structure: the patched modes
        # would rerun the fp8 mode's program, so they get no curve
        losses = []
        if steps and mode not in ("fp8_fwd", "fp8_bwd"):
            run = train_step.bind(model, opt)
            losses = [float(run(batch)["loss"]) for _ in range(steps)]
    rec = {"mode": mode, "loss_random_b": float(loss), "losses": losses, "seconds": round(time.perf_counter() - t0, 1)}
    if ref_grads is not None:
        per_leaf = {}
        for k, g in flat.items():
            r = ref_grads[k]
            # stacked layers: the leading axis is the layer; one cosine per layer
            gl, rl = g.reshape(g.shape[0], -1), r.reshape(r.shape[0], -1)
            cos = (gl * rl).sum(1) / np.maximum(np.linalg.norm(gl, axis=1) * np.linalg.norm(rl, axis=1), 1e-30)
            ratio = np.linalg.norm(gl, axis=1) / np.maximum(np.linalg.norm(rl, axis=1), 1e-30)
            rel = np.linalg.norm(gl - rl, axis=1) / np.maximum(np.linalg.norm(rl, axis=1), 1e-30)
            per_leaf[k] = {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
                           "norm_ratio_mean": float(ratio.mean()), "rel_err_mean": float(rel.mean()),
                           "rel_err_by_layer": [round(float(x), 4) for x in rel]}
        rec["grads_vs_compute"] = per_leaf
    del model, opt
    return rec, flat


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES), help=f"from {', '.join(ALL_MODES)}; the first is the reference")
    p.add_argument("--model", default=None, help="a bitsandbytes NF4 checkpoint folder instead of --shape's random model")
    a = p.parse_args(argv)
    recs, ref = [], None
    for mode in a.modes.split(","):
        rec, flat = run_mode(mode, a.shape, a.layers, a.seq, a.steps, ref, a.model)
        if ref is None:
            ref = flat
        recs.append(rec)
        print(json.dumps({"mode": mode, "loss_random_b": rec["loss_random_b"],
                          "losses": [round(x, 3) for x in rec["losses"]], "seconds": rec["seconds"]}), flush=True)
        for k, v in rec.get("grads_vs_compute", {}).items():
            name = "/".join(re.findall(r"\['(\w+)'\]", k)[-2:])
            print(f"    {name:22s} cos {v['cos_mean']:.4f} (min {v['cos_min']:.4f})  rel err {v['rel_err_mean']:.4f}"
                  f"  norm ratio {v['norm_ratio_mean']:.3f}", flush=True)
    out = os.environ.get("OUT", "/tmp")
    name = os.path.basename(os.path.normpath(a.model)) if a.model else a.shape
    with open(os.path.join(out, f"fp8_grads_{name}.json"), "w") as f:
        json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
