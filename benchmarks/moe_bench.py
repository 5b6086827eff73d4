"""Mixture-of-experts QLoRA training step: jqlora vs transformers + PEFT + bitsandbytes, same GPU.

A Qwen3-30B-A3B-shaped model (48 layers, 128 experts top-8, hidden 2048, expert size 768, 32 heads /
4 KV heads of 128, vocab 151936; `--layers` shrinks the depth), random weights, LoRA r=16 (alpha 32)
on attention and experts, one row of 2048 tokens, per-layer remat / gradient checkpointing, AdamW
(`--optimizer adamw8bit`: its moments in 8 bits, jqlora.train.adamw8bit / bitsandbytes' AdamW8bit).

* jqlora: NF4 everywhere (attention and experts, blocksize 64, double quant; routers and
  embeddings dense bf16), experts through `jqlora.ops.qgmm`; the step `jqlora train` runs, with
  the attention its `auto` picks (cuDNN flash attention on a GPU).
* transformers + PEFT: attention as bitsandbytes `Linear4bit` NF4, experts in bf16 (what
  transformers + bitsandbytes give: they do not quantize 3-D expert parameters), LoRA through
  `target_parameters`; its `grouped_mm` experts path. "out of memory" is a result.

    python -m benchmarks.moe_bench --out benchmarks/results/latest          # both sides, one process each
    python -m benchmarks.moe_bench --side jax --layers 8 --steps 3           # one side, printed
    python -m benchmarks.moe_bench --tiny                                    # CPU smoke run
    python -m benchmarks.moe_bench --side jax --mesh fsdp=2                  # jqlora on 2 GPUs
    python -m benchmarks.moe_bench --target-modules q_proj,k_proj,v_proj,o_proj   # LoRA on attention only

Each side runs in its own process when both are asked for (peak memory is process-wide) and
reports the median step time, tokens/s and peak device memory. `--out` writes
`<gpu>-<date><tag>_moe.json` (both sides) or `..._moe_<side>.json` (one side), with the device,
date, commit and versions.

`--mesh` (jqlora.parallel's syntax, e.g. fsdp=2, data=2) runs the jqlora side on that many
devices as `jqlora train --mesh` runs them: the model built on the first device, then placed
(expert stacks and their LoRA cut over fsdp, `jqlora.parallel.place_state`), one row of `--seq`
tokens per device, the library's train step (`jqlora.train.step.train_step`) under the mesh;
`build_peak_gib` / `built_gib` are the peak and the bytes in use when the model is built, before the
first step. `resident_gib_per_device` is what each device holds after the steps (its peak includes the build
on the first device). The transformers side stays on one GPU. `--target-modules` names the LoRA
targets: all-linear (attention and experts) or a list of q_proj, k_proj, v_proj, o_proj,
gate_up_proj, down_proj.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

from benchmarks.timing import time_steps
from jqlora.train.config import OPTIMIZERS  # no jax behind it

QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                     hidden_act="silu", decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
TINY = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=256)
RANK, ALPHA = 16, 32
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGETS = ATTENTION + ["gate_up_proj", "down_proj"]


def parse_targets(spec: str) -> list[str] | str:
    """``--target-modules``: "all-linear" or a comma-separated subset of TARGETS (ValueError otherwise)."""
    if spec.strip() == "all-linear":
        return "all-linear"
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ValueError(f"--target-modules {spec!r}: expected all-linear or names among {', '.join(TARGETS)}")
    return names


def torch_targets(targets) -> tuple[list[str], list[str]]:
    """PEFT's (target_modules, target_parameters) for jqlora's target names."""
    if targets == "all-linear":
        return list(ATTENTION), list(EXPERT_PARAMS)
    return [n for n in ATTENTION if n in targets], [p for p in EXPERT_PARAMS if p.rsplit(".", 1)[1] in targets]


def config(tiny: bool, layers: int | None) -> dict:
    c = dict(TINY if tiny else QWEN3_30B_A3B)
    if layers is not None:
        c["num_hidden_layers"] = int(layers)
    return c


def active_params(c: dict) -> int:
    """Parameters a token multiplies (attention + k experts + router per layer), no embeddings."""
    h, d, L = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    attn = h * c["num_attention_heads"] * d * 2 + h * c["num_key_value_heads"] * d * 2
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    return L * (attn + experts + c["num_experts"] * h)


def _params_jax(c: dict, seed: int = 0) -> dict:
    """HF-keyed params: attention and expert stacks as random NF4 (made and quantized on device, one
    weight at a time), routers, norms, embeddings and head dense bf16."""
    import jax
    import jax.numpy as jnp

    from jqlora import quant

    key = jax.random.key(seed)
    h, e, i = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    qf, kf = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    quantize = jax.jit(lambda k, shape: quant.quantize_4bit(jax.random.normal(k, shape, jnp.bfloat16) * 0.02),
                       static_argnums=1)
    dense = jax.jit(lambda k, shape, s: (jax.random.normal(k, shape, jnp.float32) * s).astype(jnp.bfloat16),
                    static_argnums=(1, 2))
    p = {"model.embed_tokens.weight": dense(key, (c["vocab_size"], h), 0.02),
         "lm_head.weight": dense(jax.random.fold_in(key, 1), (c["vocab_size"], h), 0.02),
         "model.norm.weight": jnp.ones((h,), jnp.bfloat16)}
    for layer in range(c["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        k = jax.random.fold_in(key, 100 + layer)
        for j, (n, shape) in enumerate((("self_attn.q_proj", (qf, h)), ("self_attn.k_proj", (kf, h)),
                                        ("self_attn.v_proj", (kf, h)), ("self_attn.o_proj", (h, qf)))):
            p[f"{pre}.{n}"] = quantize(jax.random.fold_in(k, j), shape)
        p[f"{pre}.mlp.experts.gate_up_proj"] = quantize(jax.random.fold_in(k, 10), (e, 2 * i, h))
        p[f"{pre}.mlp.experts.down_proj"] = quantize(jax.random.fold_in(k, 11), (e, h, i))
        p[f"{pre}.mlp.gate.weight"] = dense(jax.random.fold_in(k, 12), (e, h), 0.5)
        for n in ("input_layernorm", "post_attention_layernorm"):
            p[f"{pre}.{n}.weight"] = jnp.ones((h,), jnp.bfloat16)
        for n in ("q_norm", "k_norm"):
            p[f"{pre}.self_attn.{n}.weight"] = jnp.ones((c["head_dim"],), jnp.bfloat16)
    return p


@dataclasses.dataclass
class JaxSide:
    """What `build_jax` gives: the model, its bound train step, one batch, the build's facts, the mesh."""
    model: object
    run: object
    batch: dict
    info: dict
    mesh: object


def build_jax(c: dict, seq: int, tiny: bool, *, mesh_spec: str | None = None, targets="all-linear",
              optimizer: str = "adamw"):
    """The jqlora side as `jqlora train` runs it: the model, the library's train step
    (`jqlora.train.step.train_step`: chunked cross-entropy, gradient clipping, the LoRA params and
    optimizer state donated) bound to it, one batch of one `seq`-token row per device, and the
    facts of the build (`JaxSide`). With `mesh_spec` the state is placed on the mesh first (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jqlora import lora, models, parallel
    from jqlora._util import resolve_attention
    from jqlora.ops import sharding
    from jqlora.train.optim import make_optimizer
    from jqlora.train.step import train_step

    t0 = time.perf_counter()
    dtype = jnp.float32 if tiny else jnp.bfloat16
    attention, _ = resolve_attention("auto", jnp.dtype(dtype).name)  # the CLI's default: cuDNN on a GPU
    model = models.from_params(_params_jax(c), c, compute_dtype=dtype, remat=not tiny, donate_params=True,
                               attention=attention,
                               lora=lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets))
    info = {"side": "jqlora", "build_s": time.perf_counter() - t0, "experts": "nf4", "target_modules": targets,
            "attention": attention,
            "lora_params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))),
            "optimizer": optimizer, "device": jax.devices()[0].device_kind, "mesh": mesh_spec}
    mesh = parallel.resolve_mesh(mesh_spec) if mesh_spec else None  # none: one device
    devices = 1 if mesh is None else int(mesh.size)
    opt = nnx.Optimizer(model, make_optimizer(1e-4, 2, 1000, optimizer=optimizer), wrt=nnx.LoRAParam)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, c["vocab_size"], (1, devices, seq + 1)).astype(np.int32)
    batch = {"input_ids": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, devices, seq), np.float32),
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (1, devices, seq)).copy()}
    run = train_step.bind(model, opt)
    if mesh is not None:
        parallel.place_state(model, opt, mesh)
        run = sharding.with_mesh(mesh, train_step.bind(model, opt))
        batch = parallel.shard_batch(batch, mesh)
    return JaxSide(model, run, batch, {**info, "devices": devices, "rows": devices}, mesh)


def run_jax(c: dict, seq: int, steps: int, tiny: bool, *, mesh_spec: str | None = None,
            targets="all-linear", optimizer: str = "adamw") -> dict:
    """`build_jax`'s step timed: the median of `steps` after the first; peak and resident memory."""
    import jax

    side = build_jax(c, seq, tiny, mesh_spec=mesh_spec, targets=targets, optimizer=optimizer)
    info, mesh = side.info, side.mesh
    local = mesh.local_devices if mesh is not None else jax.devices()[:1]
    stat = lambda d, k: (d.memory_stats() or {}).get(k, 0) / 2**30  # noqa: E731
    built = {"build_peak_gib": max(stat(d, "peak_bytes_in_use") for d in local),
             "built_gib": max(stat(d, "bytes_in_use") for d in local)}
    first, step_s, loss = time_steps(lambda: float(side.run(side.batch)["loss"]), steps)
    return {**info, **built, "step_s": step_s, "tokens_per_s": info["devices"] * seq / step_s, "loss": loss,
            "first_step_s": first, "peak_gib": max(stat(d, "peak_bytes_in_use") for d in local),
            "peak_gib_per_device": [stat(d, "peak_bytes_in_use") for d in local],
            "resident_gib_per_device": [stat(d, "bytes_in_use") for d in local]}


def _torch_model(c: dict, cuda: bool):
    """transformers' Qwen3-MoE in bf16, random, its attention Linears swapped for bitsandbytes NF4
    `Linear4bit`s (what `load_in_4bit` gives a Qwen3-MoE: experts and routers stay bf16)."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**c)
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation="grouped_mm"
                                                 if cuda else "eager")
    with torch.no_grad():
        for name, mod in list(model.named_modules()):
            for n in ATTENTION:
                lin = getattr(mod, n, None)
                if isinstance(lin, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=dtype,
                                          quant_type="nf4", compress_statistics=True, device=dev)
                    q.weight = bnb.nn.Params4bit(lin.weight.data.to("cpu"), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                    setattr(mod, n, q.to(dev))  # Params4bit quantizes on its move to a device
    return model


def run_torch(c: dict, seq: int, steps: int, tiny: bool, *, targets="all-linear", optimizer: str = "adamw") -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    cuda = torch.cuda.is_available() and not tiny
    modules, parameters = torch_targets(targets)
    try:
        model = _torch_model(c, cuda)
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules or None,
                                                 target_parameters=parameters or None, lora_dropout=0.0))
        if not tiny:
            model.gradient_checkpointing_enable()
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]
        if optimizer == "adamw8bit":
            import bitsandbytes as bnb

            opt = bnb.optim.AdamW8bit(trained, lr=1e-4)
        else:
            opt = torch.optim.AdamW(trained, lr=1e-4)
        ids = torch.randint(0, c["vocab_size"], (1, seq + 1), device="cuda" if cuda else "cpu")
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        def step():
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:].contiguous()).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        first, step_s, loss = time_steps(step, steps)  # float(loss) waits for the step's CUDA stream
    except torch.OutOfMemoryError as e:
        return {"side": "torch qlora+peft", "oom": True, "error": str(e).splitlines()[0], "optimizer": optimizer,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0}
    return {"side": "torch qlora+peft", "oom": False, "step_s": step_s, "tokens_per_s": seq / step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "loss": loss,
            "first_step_s": first, "experts": "bf16", "target_modules": targets, "optimizer": optimizer,
            "mesh": None, "devices": 1,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def _commit() -> str:
    """$JQLORA_COMMIT where set (the GPU machine's copy of the tree has another .git), else HEAD."""
    from benchmarks.product_bench import measured_commit

    return measured_commit() or "unknown"


def _side_in_subprocess(side: str, a) -> dict:
    argv = [sys.executable, "-m", "benchmarks.moe_bench", "--side", side, "--seq", str(a.seq),
            "--steps", str(a.steps)] + (["--layers", str(a.layers)] if a.layers is not None else []) \
        + (["--tiny"] if a.tiny else []) + ["--target-modules", a.target_modules, "--optimizer", a.optimizer] \
        + (["--mesh", a.mesh] if a.mesh and side == "jax" else [])
    r = subprocess.run(argv, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"side": side, "error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"],
                "returncode": r.returncode}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["jax", "torch", "both"], default="both")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a smoke run")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="tokens in the row (default 2048; 32 with --tiny)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    p.add_argument("--out", default=None, help="folder for the JSON result (none: print only)")
    p.add_argument("--tag", default="")
    p.add_argument("--mesh", default=None,
                   help="jax side: a device mesh, e.g. fsdp=2 or data=2 (jqlora.parallel); one row of --seq "
                        "tokens per device; the transformers side stays on one GPU")
    p.add_argument("--target-modules", default="all-linear",
                   help=f"LoRA targets: all-linear (attention and experts) or a comma-separated list of "
                        f"{', '.join(TARGETS)}")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="AdamW, or AdamW with 8-bit moments (jqlora's adamw8bit; bitsandbytes' AdamW8bit on "
                        "the transformers side)")
    a = p.parse_args(argv)
    try:
        targets = parse_targets(a.target_modules)
        if a.mesh:
            from jqlora.parallel import parse_mesh_spec

            parse_mesh_spec(a.mesh)
    except ValueError as e:
        p.error(str(e))
    a.seq = a.seq or (32 if a.tiny else 2048)
    c = config(a.tiny, a.layers)
    if a.side != "both":
        res = (run_jax(c, a.seq, a.steps, a.tiny, mesh_spec=a.mesh, targets=targets, optimizer=a.optimizer)
               if a.side == "jax" else run_torch(c, a.seq, a.steps, a.tiny, targets=targets, optimizer=a.optimizer))
        print(json.dumps(res), flush=True)  # the one line the both-sides run reads back
        if a.out:
            _write(a.out, f"{a.tag}_moe_{a.side}", dict(res, **_about(argv)))
        return 0
    rows = [_side_in_subprocess(s, a) for s in ("jax", "torch")]
    # only now: jax's first device query takes most of the GPU's memory, which the sides need
    res = dict(rows=rows, config=c, seq=a.seq, steps=a.steps, tiny=a.tiny, active_params=active_params(c),
               mesh=a.mesh, target_modules=targets, optimizer=a.optimizer, **_about(argv))
    print(json.dumps(res, indent=1))
    if a.out:
        _write(a.out, f"{a.tag}_moe", res)
    return 0


def _about(argv) -> dict:
    """Device, date, commit, versions and arguments of a run, asked for after its steps."""
    from benchmarks.run import device_name, versions

    return dict(device=device_name(), date=datetime.date.today().isoformat(), commit=_commit(),
                versions=versions(), argv=list(argv if argv is not None else sys.argv[1:]))


def _write(out: str, suffix: str, res: dict) -> None:
    """<out>/<gpu>-<date><suffix>.json, written whole or not at all."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{res['device'].lower().replace(' ', '-')}-{res['date']}{suffix}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
