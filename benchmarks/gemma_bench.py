"""Gemma 3 QLoRA training step: jqlora vs transformers + PEFT + bitsandbytes, same GPU, one call;
and the time of sliding-window against global attention layers as the sequence grows.

A Gemma 3 12B-shaped model (the text model of google/gemma-3-12b-pt / -it: 48 layers, hidden 3840,
MLP 15360, 16 heads / 8 KV heads of 256, vocab 262208, 5 sliding (window 1024) : 1 global layers,
tied embeddings; `--layers` shrinks the depth; sources at `GEMMA3_12B`), random weights, NF4
(blocksize 64, double quant), LoRA r=16 (alpha 32) on every projection, one row of 4096 tokens,
per-layer remat / gradient checkpointing, AdamW.

    python -m benchmarks.gemma_bench --out benchmarks/results/latest     # both sides + the window sweep
    python -m benchmarks.gemma_bench --side jax --layers 8 --steps 3      # one side, printed
    python -m benchmarks.gemma_bench --tiny                               # CPU smoke run

The two sides run one after the other, each in a child process of this call (peak memory is
process-wide, and JAX preallocates most of the GPU), and the call writes one JSON with both rows,
the device, date, commit and versions. `window` rows: the jqlora step of a 1-layer model whose
layer is sliding or global, at 8k and 32k tokens (`--window-seqs`): the sliding
layers' time per token must stay flat as the sequence grows, the global ones' grows with it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from benchmarks.timing import time_steps

# The text config of google/gemma-3-12b-pt / -it. Sources: transformers' Gemma 3 conversion script
# (src/transformers/models/gemma3/convert_gemma3_weights.py, `_VARIANT_GEMMA_3_12B`: hidden 30 * 128,
# MLP 4 x hidden, 16 heads / 8 KV heads of 256, 48 layers, window 1024, linear RoPE factor 8 on the
# full layers only, theta 1e6 global / 1e4 local, query_pre_attn_scalar 256, no soft-caps; vocab
# 262144 + 64 rows added for the image tokens of the multimodal checkpoints = 262208), and for what
# the hub config leaves out, Gemma3TextConfig's defaults in transformers 5.23 (vocab 262208,
# max_position_embeddings 131072, rms_norm_eps 1e-6, gelu_pytorch_tanh, tied embeddings, 5 : 1
# layer pattern, bos 2 / eos 1 / pad 0; the -it config adds eos 106, <end_of_turn>).
GEMMA3_12B = dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                  sliding_window=1024, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=131072, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
                  bos_token_id=2, eos_token_id=1, pad_token_id=0)
TINY = dict(GEMMA3_12B, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=16, query_pre_attn_scalar=32,
            max_position_embeddings=4096)
# The text config of google/gemma-3-1b-pt / -it (its config.json: 26 layers, hidden 1152, MLP 6912,
# 4 heads / 1 KV head of 256, window 512, no RoPE scaling, theta 1e6 global / 1e4 local, 32,768
# positions, vocab 262,144): the decode benchmark's Gemma (`benchmarks.profile.decode_profile --shape
# gemma3-1b`), whose width is not a power of two.
GEMMA3_1B = dict({k: v for k, v in GEMMA3_12B.items() if k != "rope_scaling"}, hidden_size=1152,
                 intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 vocab_size=262144, sliding_window=512, max_position_embeddings=32768)
SHAPES = {"12b": GEMMA3_12B, "1b": GEMMA3_1B, "tiny": TINY}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32


def config(tiny: bool, layers: int | None = None, layer_kind: str | None = None, shape: str = "12b") -> dict:
    """The model's config.json dict (`shape` one of SHAPES; tiny: the tiny one); layer_kind
    "sliding" / "full" makes every layer that kind."""
    c = dict(TINY if tiny else SHAPES[shape])
    if layers is not None:
        c["num_hidden_layers"] = layers
    n = c["num_hidden_layers"]
    kinds = {"sliding": ["sliding_attention"] * n, "full": ["full_attention"] * n}
    c["layer_types"] = kinds.get(layer_kind) or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                                 for i in range(n)]
    return c


def _params_jax(c: dict, tiny: bool) -> dict:
    """Random HF-keyed params: linears as NF4 made on the device, norms and embeddings dense."""
    import jax
    import jax.numpy as jnp

    from jqlora import quant

    dtype = jnp.float32 if tiny else jnp.bfloat16
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    qd, kvd, d = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], c["head_dim"]
    nf4 = jax.jit(lambda k, s: quant.quantize_4bit(jax.random.normal(k, s, dtype) * 0.02, "nf4", 64, True),
                  static_argnums=1)
    norm = lambda n: jnp.zeros((n,), dtype)  # noqa: E731  Gemma's (1 + w): w = 0
    p = {"model.embed_tokens.weight": jax.random.normal(jax.random.key(0), (v, h), dtype) * 0.02,
         "model.norm.weight": norm(h)}
    dims = {"self_attn.q_proj": (qd, h), "self_attn.k_proj": (kvd, h), "self_attn.v_proj": (kvd, h),
            "self_attn.o_proj": (h, qd), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    for layer in range(c["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        for j, (name, s) in enumerate(dims.items()):
            p[f"{pre}.{name}"] = nf4(jax.random.key(1000 * layer + j + 7), s)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            p[f"{pre}.{n}.weight"] = norm(h)
        p[f"{pre}.self_attn.q_norm.weight"] = norm(d)
        p[f"{pre}.self_attn.k_norm.weight"] = norm(d)
    return jax.block_until_ready(p)


def decode_model(c: dict, tiny: bool, lora: bool):
    """A random NF4 model of config `c` for generation (no remat), with LoRA r = 16 on every
    projection when `lora` (B zero, as a fresh adapter's)."""
    import jax.numpy as jnp

    from jqlora import lora as jl, models
    from jqlora._util import resolve_attention

    dtype = "float32" if tiny else "bfloat16"
    return models.from_params(_params_jax(c, tiny), c, compute_dtype=jnp.dtype(dtype), remat=False,
                              attention=resolve_attention("auto", dtype)[0], donate_params=True,
                              lora=jl.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS) if lora else None)


def _peak_gib() -> float:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30


def run_jax(c: dict, seq: int, steps: int, tiny: bool, attention: str = "auto") -> dict:
    """jqlora's own training step (`jqlora.train.step.train_step`: chunked loss, remat per layer)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.train_bench import make_batch
    from jqlora import lora, models
    from jqlora._util import resolve_attention
    from jqlora.train.optim import make_optimizer
    from jqlora.train.step import train_step

    dtype = "float32" if tiny else "bfloat16"
    impl, _ = resolve_attention(attention, dtype)
    t0 = time.perf_counter()
    model = models.from_params(_params_jax(c, tiny), c, compute_dtype=jnp.dtype(dtype), remat=not tiny,
                               attention=impl, donate_params=True,
                               lora=lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS))
    build_s = time.perf_counter() - t0
    opt = nnx.Optimizer(model, make_optimizer(1e-4, 2, 1000), wrt=nnx.LoRAParam)
    batch = make_batch(c["vocab_size"], 1, seq)
    del batch["segment_ids"]  # one unpacked sequence, as the torch side runs
    run = train_step.bind(model, opt)
    first, step_s, loss = time_steps(lambda: float(run(batch)["loss"]), steps)
    return {"side": "jqlora", "step_s": step_s, "tokens_per_s": seq / step_s, "peak_gib": _peak_gib(),
            "loss": loss, "build_s": build_s, "first_step_s": first, "attention": impl,
            "layers": c["num_hidden_layers"], "device": jax.devices()[0].device_kind}


def run_torch(c: dict, seq: int, steps: int, tiny: bool) -> dict:
    """transformers' Gemma3ForCausalLM loaded through bitsandbytes NF4 (double quant), PEFT LoRA,
    gradient checkpointing (prepare_model_for_kbit_training), AdamW; sdpa attention on a GPU."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    cuda = torch.cuda.is_available() and not tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    attn = "sdpa" if cuda else "eager"
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
            torch.manual_seed(0)
            with torch.device(dev):
                base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c), dtype=dtype)
            base.save_pretrained(d)
            del base
            if cuda:
                torch.cuda.empty_cache()
            qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=dtype)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, device_map=dev, quantization_config=qc,
                                                         attn_implementation=attn)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=not tiny)
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, c["vocab_size"], (1, seq), device=dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        first, step_s, loss = time_steps(step, steps)  # float(loss) waits for the step's CUDA stream
    except torch.OutOfMemoryError as e:
        return {"side": "torch qlora+peft", "oom": True, "error": str(e).splitlines()[0],
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
    return {"side": "torch qlora+peft", "oom": False, "step_s": step_s, "tokens_per_s": seq / step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "loss": loss,
            "first_step_s": first, "attention": attn, "layers": c["num_hidden_layers"],
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def run_windows(tiny: bool, seqs: list[int], steps: int, attention: str = "auto") -> list[dict]:
    """The jqlora step of a 1-layer model, sliding or global, at each sequence length."""
    rows = []
    for kind in ("sliding", "full"):
        for seq in seqs:
            r = run_jax(config(tiny, layers=1, layer_kind=kind), seq, steps, tiny, attention)
            rows.append({"layers": kind, "seq": seq, "step_s": r["step_s"], "us_per_token": 1e6 * r["step_s"] / seq,
                         "attention": r["attention"], "peak_gib": r["peak_gib"]})
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _side_in_subprocess(side: str, a) -> object:
    argv = [sys.executable, "-m", "benchmarks.gemma_bench", "--side", side, "--seq", str(a.seq), "--steps",
            str(a.steps), "--attention", a.attention, "--window-seqs", ",".join(map(str, a.window_seqs))] \
        + (["--layers", str(a.layers)] if a.layers is not None else []) + (["--tiny"] if a.tiny else [])
    r = subprocess.run(argv, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("{", "["))]
    if r.returncode or not lines:
        return {"side": side, "error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"],
                "returncode": r.returncode}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["jax", "torch", "windows", "both"], default="both",
                   help="both: jax, torch and the window sweep, each in its own process")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a smoke run")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; 6 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="tokens in the row (default 4096; 32 with --tiny)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    p.add_argument("--attention", default="auto", choices=["auto", "einsum", "xla", "cudnn"], help="jqlora side")
    p.add_argument("--window-seqs", default=None, help="sequence lengths of the window sweep (default 8192,32768; "
                                                       "32,64 with --tiny)")
    p.add_argument("--out", default=None, help="folder for the JSON result (none: print only)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    a.seq = a.seq or (32 if a.tiny else 4096)
    a.window_seqs = [int(s) for s in (a.window_seqs or ("32,64" if a.tiny else "8192,32768")).split(",")]
    c = config(a.tiny, a.layers)
    if a.side != "both":
        if a.side == "windows":
            res = run_windows(a.tiny, a.window_seqs, a.steps, a.attention)
        elif a.side == "jax":
            res = run_jax(c, a.seq, a.steps, a.tiny, a.attention)
        else:
            res = run_torch(c, a.seq, a.steps, a.tiny)
        print(json.dumps(res), flush=True)
        return 0
    from benchmarks.run import device_name, versions

    rows = [_side_in_subprocess(s, a) for s in ("jax", "torch")]
    windows = _side_in_subprocess("windows", a)
    ok = all("step_s" in r for r in rows)
    res = dict(rows=rows, windows=windows, config=c, seq=a.seq, steps=a.steps, tiny=a.tiny,
               speedup=rows[1]["step_s"] / rows[0]["step_s"] if ok else None,
               memory_ratio=rows[0]["peak_gib"] / rows[1]["peak_gib"] if ok and rows[1]["peak_gib"] else None,
               device=device_name(), date=datetime.date.today().isoformat(), commit=_commit(),
               versions=versions(), argv=list(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"{res['device'].lower().replace(' ', '-')}-{res['date']}{a.tag}_gemma.json")
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
