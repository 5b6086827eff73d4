"""End-to-end QLoRA training step: jqlora vs transformers + PEFT + bitsandbytes, same GPU.

Each side runs in its own process (peak memory is process-wide) and prints one JSON line:
    python -m benchmarks.train_bench --side jax   --shape 1b --steps 5
    python -m benchmarks.train_bench --side torch --shape 1b --steps 5
Random weights, NF4 blocksize 64 with double quant, LoRA r=16 (alpha 32) on all linear layers,
batch 1 x 2048, gradient checkpointing, AdamW. `--weights bf16` (jax side) keeps the frozen base
dense bf16 with the LoRA and everything else unchanged: jqlora's bf16-weight LoRA step, the
ceiling the NF4 step is measured against (run each in its own process; the line says `weights`).
`--optimizer adamw8bit` keeps AdamW's moments in 8 bits on both sides (jqlora.train.adamw8bit;
bitsandbytes' `AdamW8bit` on the torch side); the line says `optimizer`.

Each side reports two loops over the same number of steps: `step_s` / `tokens_per_s`, the median
step when each step's loss is read before the next dispatch, and `pipelined_step_s` /
`pipelined_tokens_per_s`, the mean step with one step in flight (the loss of step i read after
step i + 1 is dispatched), which is how `jqlora.train.train` runs between checkpoints.
"""
from __future__ import annotations

import argparse
import json
import time

from jqlora.train.config import OPTIMIZERS  # no jax behind it

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False),  # CPU smoke
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # Qwen3-8B's shape (q/k norms, vocab 151,936): the configuration Surogate publishes is batch 2 x
    # 2,048 tokens, packed (`--shape qwen3-8b --rows 2 --packed`)
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     model_type="qwen3"),
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False,
                       model_type="qwen3"),  # CPU smoke
}
FAMILY = {"llama": dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192),
          "qwen3": dict(architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1000000.0,
                        max_position_embeddings=40960)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = ("nf4", "bf16")  # the frozen base: random NF4 (QLoRA) or dense bf16 (bf16-weight LoRA)


def _note(msg: str, t0: float) -> None:
    """A progress line on stderr (a run cut off by its time limit still says how far it got)."""
    import sys

    print(f"train_bench: {time.perf_counter() - t0:7.1f} s  {msg}", file=sys.stderr, flush=True)


def hf_config(shape: str, layers: int | None = None) -> dict:
    c = dict(SHAPES[shape])
    if layers is not None:
        c["num_hidden_layers"] = layers
    family = c.setdefault("model_type", "llama")
    c.update(FAMILY[family], hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
             bos_token_id=1, eos_token_id=2)
    return c


def transformers_config(c: dict):
    """The transformers config of an `hf_config` dict, of the shape's own family (Llama, Qwen3)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(c["model_type"], **{k: v for k, v in c.items()
                                                    if k not in ("model_type", "architectures", "torch_dtype")})


def non_embedding_params(c: dict) -> int:
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c["head_dim"]
    attn = h * c["num_attention_heads"] * d * 2 + h * c["num_key_value_heads"] * d * 2
    return L * (attn + 3 * h * i)


def flops_per_token(c: dict, seq: int) -> float:
    """Model FLOPs per token of a LoRA step with a frozen base: forward 2N + backward (dx) 2N,
    plus attention (4 * seq * hidden per layer forward, twice that backward) and the LM head.
    Recomputation under gradient checkpointing is not counted (it is overhead, not model work)."""
    n = non_embedding_params(c)
    attn = 4 * seq * c["num_attention_heads"] * c["head_dim"] * c["num_hidden_layers"] * 0.5  # causal
    head = 2 * c["hidden_size"] * c["vocab_size"]
    return 2 * (2 * n + head) + 3 * attn


def _random_nf4(key, shape, mesh, makers: dict):
    """A random NF4 (blocksize 64, double quant) weight made directly as packed bytes and scales,
    each array created on its shards (jqlora.parallel's layout): no dense weight, no quantization.
    `makers` holds one compiled maker per weight shape (a 70B model has 560 weights of 7 shapes:
    one compilation each, not one per weight)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jqlora import parallel, quant
    from jqlora.quant.tables import code_4bit, dynamic_map

    shape = tuple(shape)
    if shape not in makers:
        n = shape[0] * shape[1]
        nb = n // 64
        ng = -(-nb // 256)
        q = quant.Weight4bit(packed=jax.ShapeDtypeStruct((n // 2,), jnp.uint8),
                             absmax=jax.ShapeDtypeStruct((nb,), jnp.uint8), code=None,
                             nested_absmax=jax.ShapeDtypeStruct((ng,), jnp.float32), shape=shape)
        lay = parallel.weight_layout(q, int(mesh.shape["fsdp"]))
        cut = lambda ax: NamedSharding(mesh, P("fsdp") if ax is not None else P())  # noqa: E731

        def make(k):
            k1, k2, k3 = jax.random.split(k, 3)
            return (jax.random.bits(k1, (n // 2,), jnp.uint8), jax.random.bits(k2, (nb,), jnp.uint8),
                    jax.random.uniform(k3, (ng,), jnp.float32, 0.01, 0.03))

        makers[shape] = jax.jit(make, out_shardings=(cut(lay.packed), cut(lay.absmax), cut(lay.nested_absmax)))
    packed, absmax, nested = makers[shape](key)
    rep = NamedSharding(mesh, P())
    return quant.Weight4bit(packed=packed, absmax=absmax, code=jax.device_put(code_4bit("nf4"), rep),
                            nested_absmax=nested, nested_code=jax.device_put(dynamic_map(), rep),
                            offset=jax.device_put(jnp.float32(0.0), rep), shape=shape,
                            quant_type="nf4", blocksize=64, stored_dtype="bfloat16")


def build_jax(shape: str, seq: int, backend: str, attention: str = "einsum", layers: int | None = None,
              mesh=None, remat="nothing_saveable", lora: bool = True, weights: str = "nf4",
              compute_dtype: str = "bfloat16", base_matmul: str = "compute", optimizer: str = "adamw",
              rows: int = 1):
    """The jqlora side's model, optimizer and one batch (random weights, quantized on device);
    `layers` overrides the shape's layer count; lora=False builds the bare quantized model (what
    `jqlora generate` runs without an adapter). With a `mesh` (jqlora.parallel) every weight is
    made on its shards as random NF4 bytes and scales, and the batch has one row per device.
    weights="bf16": the decoder's linear weights stay dense bf16 (no quantization), everything
    else as with "nf4". compute_dtype: the model's (float32 is what the CLI runs on a CPU).
    base_matmul: "compute" or "fp8", the NF4 weights' products (`from_params(base_matmul=)`).
    optimizer: "adamw" or "adamw8bit" (`make_optimizer(optimizer=)`). rows: rows of `seq` tokens
    a device takes per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jqlora import quant
    from jqlora.lora import LoraConfig
    from jqlora.models import from_params
    from jqlora.train.optim import make_optimizer

    c = hf_config(shape, layers)
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    qd, kvd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    key = jax.random.key(0)
    t_build = time.perf_counter()
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec as P

        normal = jax.jit(lambda k, s: jax.random.normal(k, s, jnp.bfloat16) * 0.02, static_argnums=1,
                         out_shardings=NamedSharding(mesh, P("fsdp")))
        makers: dict = {}
        quantize = lambda k, s: _random_nf4(k, s, mesh, makers)  # noqa: E731
    else:
        normal = lambda k, s: jax.random.normal(k, s, jnp.bfloat16) * 0.02  # noqa: E731
    params = {"model.embed_tokens.weight": normal(key, (v, h)),
              "model.norm.weight": jnp.ones((h,), jnp.bfloat16)}
    if not c["tie_word_embeddings"]:
        params["lm_head.weight"] = normal(jax.random.key(1), (v, h))
    quantize = quantize if mesh is not None else jax.jit(lambda k, shape: quant.quantize_4bit(jax.random.normal(k, shape, jnp.bfloat16) * 0.02,
                                                            "nf4", 64, True), static_argnums=1)
    # a quantized linear is keyed by its module name, a dense one by "<module>.weight" (from_params)
    make, suffix = (quantize, "") if weights == "nf4" else (normal, ".weight")
    dims = {"self_attn.q_proj": (qd, h), "self_attn.k_proj": (kvd, h), "self_attn.v_proj": (kvd, h),
            "self_attn.o_proj": (h, qd), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for layer in range(L):
        for j, (name, s) in enumerate(dims.items()):
            params[f"model.layers.{layer}.{name}{suffix}"] = make(jax.random.key(1000 * layer + j + 7), s)
        if c["model_type"] == "qwen3":  # RMSNorm of each head's q and k
            for norm in ("q_norm", "k_norm"):
                params[f"model.layers.{layer}.self_attn.{norm}.weight"] = jnp.ones((c["head_dim"],), jnp.bfloat16)
        params[f"model.layers.{layer}.input_layernorm.weight"] = jnp.ones((h,), jnp.bfloat16)
        params[f"model.layers.{layer}.post_attention_layernorm.weight"] = jnp.ones((h,), jnp.bfloat16)
    jax.block_until_ready(params)
    _note(f"{len(params)} weights made", t_build)
    model = from_params(params, c, lora=LoraConfig(rank=16, alpha=32, target_modules=TARGETS) if lora else None,
                        compute_dtype=jnp.dtype(compute_dtype), remat=remat, backend=backend, attention=attention,
                        donate_params=True, base_matmul=base_matmul)  # stacking the layers deletes the per-layer arrays as it goes
    del params
    _note("model built (layers stacked)", t_build)
    if not lora:
        return model, None, None
    opt = nnx.Optimizer(model, make_optimizer(1e-4, 2, 1000, optimizer=optimizer), wrt=nnx.LoRAParam)
    return model, opt, make_batch(v, rows * (1 if mesh is None else int(mesh.size)), seq)


def frozen_formats(model) -> dict:
    """How many linear layers hold each kind of frozen base, read off the built model: "nf4" (a
    4-bit weight), "int8", "bf16" / "float32" (dense). A stacked decoder layer kind counts once."""
    from flax import nnx

    from jqlora import quant
    from jqlora.lora.linear import QLoRALinear

    out: dict = {}
    for _, mod in nnx.iter_graph(model):
        if isinstance(mod, QLoRALinear):
            w = mod.base.get_value()
            kind = (w.quant_type if isinstance(w, quant.Weight4bit) else "int8" if isinstance(w, quant.Int8Weight)
                    else str(w.dtype))
            out[kind] = out.get(kind, 0) + 1
    return out


def make_batch(vocab: int, rows: int, seq: int) -> dict:
    """One micro-batch of random tokens: `rows` rows of `seq` tokens, one document each."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, vocab, (1, rows, seq + 1), dtype=np.int32)
    return {"input_ids": ids[..., :-1], "targets": ids[..., 1:], "loss_mask": np.ones((1, rows, seq), np.float32),
            "segment_ids": np.ones((1, rows, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (1, rows, seq)).copy()}


def compile_only(shape: str, seqs: list[int], backend: str, attention: str, remat, weights: str = "nf4",
                 optimizer: str = "adamw") -> list[dict]:
    """XLA's own memory analysis of the one-device train step at each sequence length, compiled and
    never run (a step at 350k tokens takes minutes): device temporaries, arguments, outputs and
    host temporaries (offloaded activations), with the policy `remat="auto"` chose."""
    import jax

    from jqlora import models
    from jqlora.train.step import train_step

    model, opt, _ = build_jax(shape, seqs[0], backend, attention, remat=remat, weights=weights, optimizer=optimizer)
    c = hf_config(shape)
    out = []
    for seq in seqs:
        batch = make_batch(c["vocab_size"], 1, seq)
        del batch["segment_ids"]  # one unpacked sequence per row, as run_jax runs it
        t0 = time.perf_counter()
        ma = train_step.bind(model, opt).lower(batch).compile().memory_analysis()
        rec = {"side": "jqlora", "mode": "compile-only", "weights": weights, "optimizer": optimizer, "shape": shape,
               "seq": seq, "remat": remat, "compile_s": round(time.perf_counter() - t0, 1)}
        for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "host_temp_size_in_bytes", "host_argument_size_in_bytes"):
            if hasattr(ma, k):
                rec[k.replace("_size_in_bytes", "_gib")] = round(getattr(ma, k) / 2**30, 2)
        if remat == "auto":
            rec["plan"] = models.remat_plan(c, 1, seq, attention=attention).reason
        rec["device"] = jax.devices()[0].device_kind
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def run_jax(shape: str, steps: int, seq: int, backend: str, attention: str = "einsum",
            loss_chunk: int | None = None, dispatch: str = "bound", packed: bool = False,
            docs: int = 1, segment_tables: bool = True, mesh_spec: str | None = None,
            remat="nothing_saveable", weights: str = "nf4", base_matmul: str = "compute",
            optimizer: str = "adamw", rows_per_device: int = 1) -> dict:
    import functools

    import jax
    import numpy as np

    from jqlora.train.frozen import frozen_jit
    from jqlora.train.step import LOSS_CHUNK, _train_step_impl, train_step

    step = train_step
    if loss_chunk is not None and loss_chunk != LOSS_CHUNK:  # the library's step, another chunk
        step = frozen_jit(functools.partial(_train_step_impl, loss_chunk=loss_chunk), nodes=2, donate=True)
    from jqlora import parallel
    from jqlora.ops import sharding

    mesh = parallel.resolve_mesh(mesh_spec) if mesh_spec else None
    model, opt, batch = build_jax(shape, seq, backend, attention, mesh=mesh, remat=remat, weights=weights,
                                  base_matmul=base_matmul, optimizer=optimizer, rows=rows_per_device)
    formats = frozen_formats(model)
    rows = batch["input_ids"].shape[1]  # tokens per step: rows x seq
    if not packed:  # one sequence per row, as train(packing=False) feeds it (and as torch runs)
        del batch["segment_ids"]
    else:  # `docs` equal documents per row, positions restarting in each, as train() packs them
        seg = np.minimum(np.arange(seq) * docs // seq + 1, docs).astype(np.int32)
        starts = np.searchsorted(seg, seg)
        batch["segment_ids"] = np.broadcast_to(seg, (1, rows, seq)).copy()
        batch["positions"] = np.broadcast_to((np.arange(seq) - starts).astype(np.int32), (1, rows, seq)).copy()
        if attention == "cudnn" and segment_tables:  # what train() adds for cuDNN's packed layout
            from jqlora.train.data import SegmentTables

            SegmentTables().add(batch)
    # "bound" is what jqlora.train.train runs; "unbound" splits the model graph on every call
    run = step.bind(model, opt) if dispatch == "bound" else functools.partial(step, model, opt)
    if mesh is not None:  # as jqlora.train runs a mesh: state placed, batch rows split, mesh active
        parallel.place_state(model, opt, mesh)
        run = sharding.with_mesh(mesh, step.bind(model, opt))
        batch = parallel.shard_batch(batch, mesh)
    if steps == 0:
        if mesh is not None:
            raise SystemExit("--steps 0 runs one device only")
        return {**one_step(run, batch, rows, seq, backend, attention), "weights": weights, "frozen_formats": formats}
    built = jax.devices()[0].memory_stats() or {}
    # JAX cannot reset its peak counter: the build's own peak is recorded, so a reader can check
    # that the reported peak is the step's and not the weight generation's.
    before, build_peak = built.get("bytes_in_use", 0), built.get("peak_bytes_in_use", 0)
    t0 = time.perf_counter()
    jax.block_until_ready(run(batch)["loss"])
    compile_s = time.perf_counter() - t0
    _note(f"first step (compile) {compile_s:.1f} s", t0)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        m = run(batch)
        losses.append(float(m["loss"]))
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    # As jqlora.train.train runs between checkpoints: step i's loss is read after step i + 1 is
    # dispatched, so host time per step overlaps device time (JAX tracks readiness per buffer).
    t0, prev, piped_losses = time.perf_counter(), None, []
    for _ in range(steps):
        m = run(batch)
        if prev is not None:
            piped_losses.append(float(prev["loss"]))
        prev = m
    piped_losses.append(float(prev["loss"]))
    piped_s = (time.perf_counter() - t0) / steps
    stats = jax.devices()[0].memory_stats() or {}
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
             for d in (mesh.local_devices if mesh is not None else jax.devices()[:1])]
    return {"side": "jqlora", "weights": weights, "frozen_formats": formats, "mesh": mesh_spec,
            "devices": 1 if mesh is None else int(mesh.size), "rows": rows, "peak_gib_per_device": peaks,
            "backend": backend, "attention": attention, "dispatch": dispatch,
            "segment_mask": packed, "docs": docs if packed else None,
            "segment_tables": "segment_lengths" in batch,
            "loss_chunk": loss_chunk or LOSS_CHUNK, "step_s": step_s, "tokens_per_s": rows * seq / step_s,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "resident_gib_before_step": before / 2**30,
            "peak_gib_before_step": build_peak / 2**30,
            "compile_s": compile_s, "losses": losses,
            "pipelined_step_s": piped_s, "pipelined_tokens_per_s": rows * seq / piped_s,
            "pipelined_losses": piped_losses}


def one_step(run, batch, rows: int, seq: int, backend: str, attention: str) -> dict:
    """`--steps 0`: one step whose length makes a loop of steps too long (hundreds of thousands of
    tokens). The step is compiled ahead (XLA's memory analysis, with host offload) into a fresh
    persistent cache, then run once: its wall time is the run plus a cache lookup."""
    import resource
    import tempfile

    import jax

    from jqlora import compile_cache

    compile_cache.enable(tempfile.mkdtemp(prefix="jqlora-one-step-"))
    t0 = time.perf_counter()
    ma = run.lower(batch).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    _note(f"compiled in {compile_s:.1f} s", t0)
    t0 = time.perf_counter()
    m = run(batch)
    loss = float(m["loss"])
    step_s = time.perf_counter() - t0
    _note(f"one step {step_s:.1f} s, loss {loss:.4f}", t0)
    stats = jax.devices()[0].memory_stats() or {}
    gib = lambda k: round(getattr(ma, k, 0) / 2**30, 2)  # noqa: E731
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    return {"side": "jqlora", "mode": "one step", "mesh": None, "devices": 1, "rows": rows, "backend": backend,
            "attention": attention, "compile_s": compile_s, "step_s": step_s, "tokens_per_s": rows * seq / step_s,
            "pipelined_step_s": step_s, "pipelined_tokens_per_s": rows * seq / step_s, "losses": [loss],
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "device_limit_gib": stats.get("bytes_limit", 0) / 2**30,
            "temp_gib": gib("temp_size_in_bytes"), "host_temp_gib": gib("host_temp_size_in_bytes"),
            "host_peak_rss_gib": round(host_peak, 2), "device": jax.devices()[0].device_kind}


def run_torch(shape: str, steps: int, seq: int, quantized: bool = True, optimizer: str = "adamw",
              rows: int = 1) -> dict:
    import os
    import tempfile

    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    c = hf_config(shape)
    cfg = transformers_config(c)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        torch.manual_seed(0)
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of this code path
        with torch.device(dev):  # random init on the GPU: minutes faster at 8B than on the host
            base = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        base.save_pretrained(d)
        del base
        if dev == "cuda":
            torch.cuda.empty_cache()
        kw = dict(torch_dtype=torch.bfloat16, device_map=dev)
        if quantized:
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(d, **kw)
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM"))
    # from_pretrained returns an eval-mode model, and transformers checkpoints layers only in
    # training mode: without this the step runs with no gradient checkpointing at all.
    model.train()
    if optimizer == "adamw8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, c["vocab_size"], (rows, seq), device=dev)
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()

    t0 = time.perf_counter()
    step()
    sync()
    warm_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    # The same overlap as the jax side's pipelined loop: each step's loss is copied to pinned host
    # memory behind an event and read after the next step has been dispatched (a plain .item()
    # would wait for everything queued, the next step included).
    pin = cuda
    sync()
    t0, pending, piped_losses = time.perf_counter(), None, []
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host = torch.empty((), dtype=out.loss.dtype, pin_memory=pin)
        host.copy_(out.loss.detach(), non_blocking=pin)
        ev = torch.cuda.Event() if cuda else None
        if cuda:
            ev.record()
        if pending is not None:
            if pending[1] is not None:
                pending[1].synchronize()
            piped_losses.append(pending[0].item())
        pending = (host, ev)
    if pending[1] is not None:
        pending[1].synchronize()
    piped_losses.append(pending[0].item())
    piped_s = (time.perf_counter() - t0) / steps
    return {"side": "torch qlora" if quantized else "torch bf16 lora",
            "model_class": type(model.get_base_model()).__name__, "rows": rows, "step_s": step_s,
            "tokens_per_s": rows * seq / step_s, "pipelined_step_s": piped_s,
            "pipelined_tokens_per_s": rows * seq / piped_s, "pipelined_losses": piped_losses,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "warmup_s": warm_s,
            "gradient_checkpointing": model.training and any(
                getattr(mod, "gradient_checkpointing", False) is True for mod in model.modules()),
            "losses": losses}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["jax", "torch", "torch-bf16"], required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per loop; 0 (jax side, one device): compile ahead, run one step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rows", type=int, default=1, help="rows of --seq tokens per step (per device with --mesh)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--attention", default="einsum", choices=["einsum", "xla", "cudnn"])
    p.add_argument("--loss-chunk", type=int, default=None, help="tokens per LM-head/loss chunk (jax side)")
    p.add_argument("--docs", type=int, default=1, help="with --packed: equal documents per row")
    p.add_argument("--no-segment-tables", action="store_true",
                   help="with --packed and cudnn: keep the (T, T) mask (no segment tables, as before)")
    p.add_argument("--packed", action="store_true",
                   help="jax side: pass segment ids (the packing path: a (T, T) mask in attention); "
                        "by default the row is one unpacked sequence, as on the torch side")
    p.add_argument("--dispatch", default="bound", choices=["bound", "unbound"],
                   help="jax side: train_step.bind(model, opt) (as jqlora.train runs it) or a full "
                        "graph split per call")
    p.add_argument("--mesh", default=None,
                   help="jax side: a device mesh, e.g. data=2 or fsdp=2 (jqlora.parallel); one row of "
                        "--seq tokens per device; weights made as random NF4 bytes on their shards")
    p.add_argument("--remat", default="nothing_saveable",
                   help="jax side: none, auto (jqlora.models.remat_plan) or a policy name in REMAT_POLICIES")
    p.add_argument("--weights", default="nf4", choices=WEIGHTS,
                   help="jax side: the frozen base as random NF4 (QLoRA) or dense bf16 (bf16-weight LoRA, "
                        "the ceiling NF4 is measured against); the LoRA is the same")
    p.add_argument("--base-matmul", default="compute", choices=["compute", "fp8"],
                   help="jax side: the NF4 weights' products in the compute dtype, or on FP8 (E4M3) "
                        "operands scaled per row (docs/numerics.md); recorded as base_matmul")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="AdamW, or AdamW with 8-bit moments (jqlora's adamw8bit; bitsandbytes' AdamW8bit on the "
                        "torch side); recorded as optimizer")
    p.add_argument("--compile-only", default=None, metavar="SEQS",
                   help="jax side, one device: compile the step at each of these sequence lengths "
                        "(e.g. 131072,262144) and print XLA's memory analysis; nothing runs")
    a = p.parse_args(argv)
    from jqlora._util import raise_host_offload_limit

    raise_host_offload_limit()  # as the CLI does: offloaded layer inputs past XLA's 64 GB default
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("jqlora.models").setLevel(logging.INFO)  # the remat plan "auto" chose, on stderr
    if a.compile_only:
        compile_only(a.shape, [int(x) for x in a.compile_only.split(",")], a.backend, a.attention,
                     False if a.remat == "none" else a.remat, weights=a.weights, optimizer=a.optimizer)
        return
    if a.side == "jax":
        remat = False if a.remat == "none" else a.remat
        res = run_jax(a.shape, a.steps, a.seq, a.backend, a.attention, a.loss_chunk, a.dispatch, a.packed,
                      a.docs, not a.no_segment_tables, a.mesh, remat=remat, weights=a.weights,
                      base_matmul=a.base_matmul, optimizer=a.optimizer, rows_per_device=a.rows)
        res["remat"] = a.remat
        res["base_matmul"] = a.base_matmul
    else:
        res = run_torch(a.shape, a.steps, a.seq, quantized=a.side == "torch", optimizer=a.optimizer, rows=a.rows)
        res["weights"] = "nf4" if a.side == "torch" else "bf16"
    res["optimizer"] = a.optimizer
    c = hf_config(a.shape)
    res.update(shape=a.shape, seq=a.seq, flops_per_token=flops_per_token(c, a.seq))
    res["model_tflops"] = res["flops_per_token"] * res["tokens_per_s"] / 1e12
    res["pipelined_model_tflops"] = res["flops_per_token"] * res["pipelined_tokens_per_s"] / 1e12
    print(json.dumps(res))


if __name__ == "__main__":
    main()
