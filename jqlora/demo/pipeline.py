"""The end-to-end demo (`jqlora demo`, `make demo`), on CPU, offline.

1. data       the reverse task: train / held-out splits (JSONL, deterministic)
2. base       a small Llama pretrained in PyTorch (fp32) on a *different* task: copying strings
3. quantize   transformers + bitsandbytes -> an NF4 (double-quant) HF checkpoint
4. load       jqlora.models.load_causal_lm in JAX, with LoRA on every projection;
              held-out exact-match accuracy on reversing BEFORE fine-tuning
5. fine-tune  jqlora.train.train on the JSONL (frozen 4-bit base, LoRA only): loss.csv / loss.png
6. evaluate   held-out accuracy AFTER; export the checkpoint to a PEFT adapter (export-peft)
7. crosscheck JAX (+ adapter) vs transformers + bitsandbytes + PEFT in torch on held-out prompts

The base never sees a reversed string: before fine-tuning it copies ("abc=" -> "abc"), so its
reverse accuracy is ~0 (palindromes aside); the held-out strings never occur in the training split.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np


@dataclasses.dataclass
class DemoSettings:
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    pretrain_steps: int = 400
    pretrain_batch: int = 64
    pretrain_lr: float = 3e-3
    n_train: int = 4000
    n_heldout: int = 200
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_steps: int = 300
    lora_lr: float = 3e-3
    lora_batch: int = 16
    seq_len: int = 64
    crosscheck_prompts: int = 4
    seed: int = 0
    min_gain: float = 0.5  # the demo reports FAILED when accuracy rises by less than this

    @classmethod
    def quick(cls, **kw) -> "DemoSettings":
        """Tiny settings that exercise every step in well under a minute (no accuracy claim)."""
        base = dict(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, pretrain_steps=20,
                    pretrain_batch=16, n_train=200, n_heldout=16, lora_rank=4, lora_alpha=8.0, lora_steps=8,
                    lora_batch=4, seq_len=32, crosscheck_prompts=2, min_gain=-1.0)
        base.update(kw)
        return cls(**base)


class _Steps:
    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.i, self.log = total, 0, log
        self.t = time.perf_counter()
        self.times: dict[str, float] = {}
        self.name: Optional[str] = None

    def start(self, name: str, what: str):
        self.stop()
        self.i += 1
        self.name = name
        self.t = time.perf_counter()
        self.log(f"[{self.i}/{self.total}] {what}")

    def stop(self):
        if self.name is not None:
            self.times[self.name] = round(time.perf_counter() - self.t, 2)
            self.name = None


def _examples(rows, k=3):
    return [f"{p}{o!r} (want {t!r}) {'ok' if o == t else 'wrong'}" for p, o, t in rows[:k]]


def run_demo(out="demo_out", settings: Optional[DemoSettings] = None, *, log: Callable[[str], None] = print,
             progress: Optional[bool] = None) -> dict:
    """Run the whole demo into `out`; returns the summary dict (also written to out/summary.json)."""
    from jqlora._util import quiet_third_party

    quiet_third_party()
    t_start = time.perf_counter()
    s = settings or DemoSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("data", "base-fp32", "base-nf4", "run", "adapter", "summary.json"):  # only what we write
        p = out / sub
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    steps = _Steps(7, log)

    # 1. data -------------------------------------------------------------------------------
    import jqlora.demo.task as task

    steps.start("data", "task: reverse lowercase strings (3-10 letters); prompt 's=' -> completion reversed(s)")
    split = task.make_split(s.n_train, s.n_heldout, seed=s.seed)
    train_file = task.write_jsonl(out / "data" / "train.jsonl", split.train)
    held_file = task.write_jsonl(out / "data" / "heldout.jsonl", split.heldout)
    log(f"      {len(split.train)} training / {len(split.heldout)} held-out examples (disjoint) -> {out / 'data'}")

    # 2. base model ---------------------------------------------------------------------------
    import jqlora.demo.build as build

    steps.start("pretrain", f"base model: Llama (hidden {s.hidden}, {s.layers} layers, {s.heads} heads / {s.kv_heads} "
                            f"kv, char vocab) pretrained from scratch in PyTorch fp32 on the COPY task "
                            f"('abc=' -> 'abc'), {s.pretrain_steps} steps")
    pre = build.pretrain_copy(out / "base-fp32", hidden=s.hidden, intermediate=s.intermediate, layers=s.layers,
                              heads=s.heads, kv_heads=s.kv_heads, steps=s.pretrain_steps, batch=s.pretrain_batch,
                              lr=s.pretrain_lr, seed=s.seed, progress=progress)
    log(f"      {pre['params']:,} parameters, final copy loss {pre['final_loss']:.4f} -> {pre['path']}")

    # 3. quantize -----------------------------------------------------------------------------
    steps.start("quantize", "quantize with transformers + bitsandbytes: NF4, blocksize 64, double quant (lm_head "
                            "and embeddings stay fp32)")
    qdir = build.quantize_with_bnb(out / "base-fp32", out / "base-nf4")
    from interop.inspect import inspect_checkpoint

    info = inspect_checkpoint(qdir)
    tot = info["totals"]
    log(f"      {qdir}: {tot['by_kind']} entries; {tot['bits_per_quantized_param']:.3f} bits/param over the "
        f"quantized weights, {tot['bits_per_param']:.2f} overall")

    # 4. load in JAX, accuracy before ------------------------------------------------------------
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import models
    from jqlora.lora import LoraConfig

    steps.start("load", f"load in JAX (jqlora.models.load_causal_lm, float32 compute, backend "
                        f"{jax.default_backend()}) with LoRA r={s.lora_rank} on all 7 projections; evaluate")
    lora_cfg = LoraConfig(rank=s.lora_rank, alpha=s.lora_alpha, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                                  "gate_proj", "up_proj", "down_proj"))
    model = models.load_causal_lm(qdir, lora=lora_cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(s.seed))
    copy_acc, _ = task.exact_match(model, split.heldout, task="copy")
    acc_before, rows_before = task.exact_match(model, split.heldout)
    log(f"      held-out: copy accuracy {copy_acc:.1%} (what the base was trained for); "
        f"REVERSE accuracy before fine-tuning {acc_before:.1%}")
    for e in _examples(rows_before):
        log(f"        {e}")

    # 5. fine-tune ------------------------------------------------------------------------------
    from jqlora.runs import LoraSettings, ModelSettings, RunSettings
    from jqlora.train import TrainConfig, train

    run_dir = out / "run"
    cfg = TrainConfig(data_path=str(train_file), tokenizer_path=str(qdir), eval_data_path=str(held_file),
                      seq_len=s.seq_len, batch_size=s.lora_batch, lr=s.lora_lr, warmup=max(1, s.lora_steps // 15),
                      steps=s.lora_steps, seed=s.seed, out_dir=str(run_dir), save_every=0,
                      log_every=max(1, s.lora_steps // 60), eval_every=max(1, s.lora_steps // 6),
                      eval_max_batches=4, progress=progress)
    steps.start("finetune", f"LoRA fine-tune on the reverse task with jqlora.train: {s.lora_steps} steps x "
                            f"{s.lora_batch} packed rows of {s.seq_len} tokens, lr {s.lora_lr:g}, 4-bit base frozen")
    RunSettings(model=ModelSettings(model=str(qdir.resolve()), compute_dtype="float32", backend="auto"),
                lora=LoraSettings.from_config(lora_cfg), train=cfg).write_record()
    res = train(model, cfg)
    log(f"      loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}"
        + (f"; held-out eval loss {res.eval_losses[-1][1]:.4f}" if res.eval_losses else ""))
    log(f"      loss curve: {res.png_path} ({res.csv_path})")

    # 6. accuracy after, export ---------------------------------------------------------------
    steps.start("export", "evaluate after fine-tuning; export the training checkpoint to a PEFT adapter")
    acc_after, rows_after = task.exact_match(model, split.heldout)
    log(f"      held-out REVERSE accuracy: before {acc_before:.1%} -> after {acc_after:.1%}")
    for e in _examples(rows_after):
        log(f"        {e}")
    from jqlora.runs import export_adapter

    exp = export_adapter(run_dir, out / "adapter")
    log(f"      {exp['modules']} LoRA modules of step {exp['step']} -> {exp['adapter']} (PEFT format)")

    # 7. crosscheck ------------------------------------------------------------------------------
    steps.start("crosscheck", "cross-check: JAX + adapter vs transformers + bitsandbytes + PEFT (torch, CPU) on "
                              "held-out prompts with their answers")
    from jqlora import adapters
    from jqlora.crosscheck import crosscheck, jax_states

    n = max(1, s.crosscheck_prompts)
    by_len: dict[int, list[str]] = {}
    for w in split.heldout:
        by_len.setdefault(len(w), []).append(w)
    words = max(by_len.values(), key=len)[:n]  # same length: no padding needed on either side
    ids = np.asarray([[task.BOS] + task.encode(w + task.SEP + w[::-1]) + [task.EOS] for w in words], np.int64)
    cc = crosscheck(qdir, adapter=out / "adapter", ids=ids, dtype="float32")
    log("      " + cc.format().replace("\n", "\n      "))
    # the adapter files reproduce the model that was trained in memory
    reloaded, _, _ = adapters.load_model_with_adapter(qdir, out / "adapter", compute_dtype=jnp.float32)
    model.eval()
    rt = float(np.max(np.abs(jax_states(model, ids)["logits"] - jax_states(reloaded, ids)["logits"])))
    log(f"      in-memory trained model vs model reloaded from the PEFT files: max |logits diff| = {rt:.2e}")
    steps.stop()

    total = time.perf_counter() - t_start
    gain = acc_after - acc_before
    ok = cc.passed and gain >= s.min_gain
    summary = dict(
        out=str(out), settings=dataclasses.asdict(s), backend=jax.default_backend(),
        data=dict(train=str(train_file), heldout=str(held_file)),
        base_fp32=pre["path"], base_nf4=str(qdir), pretrain_final_loss=pre["final_loss"],
        bits_per_quantized_param=tot["bits_per_quantized_param"],
        heldout_copy_accuracy_base=copy_acc, accuracy_before=acc_before, accuracy_after=acc_after,
        loss_first=res.losses[0], loss_last=res.losses[-1], loss_png=str(res.png_path), loss_csv=str(res.csv_path),
        checkpoint=str(res.checkpoint), adapter=exp["adapter"],
        crosscheck=dict(passed=cc.passed, logits_rel=cc.logits.rel, logits_max_abs=cc.logits.max_abs,
                        max_layer_rel=max(d.rel for d in cc.layers), tolerance=cc.tolerance),
        adapter_roundtrip_max_abs=rt, seconds=dict(steps.times, total=round(total, 1)), ok=ok)
    from interop.atomic_io import write_json_atomic

    write_json_atomic(out / "summary.json", summary)
    lines = [
        "", "=" * 78, "jqlora demo summary", "=" * 78,
        f"what was done : base Llama pretrained in PyTorch fp32 on COPYING strings ({s.pretrain_steps} steps), "
        f"quantized to NF4 by bitsandbytes, LoRA (r={s.lora_rank}) fine-tuned in JAX on REVERSING strings "
        f"({s.lora_steps} steps, 4-bit base frozen)",
        f"held-out exact match (reverse, {len(split.heldout)} unseen strings, greedy): "
        f"before {acc_before:.1%} -> after {acc_after:.1%}",
        f"base model    : {qdir} ({tot['bits_per_quantized_param']:.3f} bits/param in quantized layers)",
        f"loss curve    : {res.png_path}  /  {res.csv_path}",
        f"PEFT adapter  : {exp['adapter']}",
        f"crosscheck    : {'PASS' if cc.passed else 'FAIL'}, logits max abs err {cc.logits.max_abs:.2e}, "
        f"rel err {cc.logits.rel:.2e} (tolerance {cc.tolerance:.0e}); worst layer rel err "
        f"{max(d.rel for d in cc.layers):.2e}",
        f"time          : {total:.0f} s total (" + ", ".join(f"{k} {v:.0f}s" for k, v in steps.times.items()) + ")",
        f"summary JSON  : {out / 'summary.json'}",
    ]
    if not ok:
        why = [] if cc.passed else ["crosscheck failed"]
        if gain < s.min_gain:
            why.append(f"accuracy rose by only {gain:.1%} (< {s.min_gain:.0%})")
        lines.append("RESULT        : FAILED (" + "; ".join(why) + ")")
    else:
        lines.append("RESULT        : OK")
    for line in lines:
        log(line)
    sys.stdout.flush()
    return summary
