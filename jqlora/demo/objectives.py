"""`jqlora demo --objective grpo | dpo`: preference and RL fine-tuning on CPU in minutes, on the
demo's own base (a small Llama pretrained in PyTorch to COPY strings, quantized to NF4 by
bitsandbytes; :mod:`jqlora.demo.build`), towards the task it never saw: REVERSING them.

* grpo: prompts ``"abc="``; the reward is the share of the reversed string's characters that the
  completion has at the right place (:func:`chars_right`). The base copies, so its mean reward
  starts low; it rises as GRPO moves the LoRA towards reversing.
* dpo: pairs whose chosen completion is the reversed string and whose rejected one is the copy;
  the held-out pairs' reward accuracy starts at chance (0: the policy equals the reference) and
  rises.

Writes ``<out>/<objective>/`` (the run: loss.csv with the objective's metrics, checkpoints, the
adapter) and ``summary.json``; ``ok`` is whether the reward (GRPO) or the held-out accuracy (DPO)
rose by ``min_gain``.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

__all__ = ["ObjectiveDemoSettings", "chars_right", "run_objective_demo"]


def chars_right(prompts, completions, **_):
    """Per completion: the share of the reversed prompt string's characters it has in place."""
    out = []
    for p, c in zip(prompts, completions):
        target = p.rstrip("=")[::-1]
        out.append(sum(a == b for a, b in zip(c, target)) / max(len(target), len(c), 1))
    return out


@dataclasses.dataclass
class ObjectiveDemoSettings:
    objective: str = "grpo"
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    pretrain_steps: int = 400
    min_len: int = 3
    max_len: int = 5
    n_train: int = 400
    n_heldout: int = 64
    steps: int = 60
    lr: float = 2e-3
    rank: int = 16
    batch_size: int = 8          # GRPO: prompts per step; DPO: pairs per step
    num_generations: int = 16
    temperature: float = 2.0  # GRPO: the copying base is near-deterministic at 1
    dpo_beta: float = 0.1
    seed: int = 0
    min_gain: float = 0.1

    @classmethod
    def quick(cls, **kw) -> "ObjectiveDemoSettings":
        base = dict(hidden=64, intermediate=128, layers=1, pretrain_steps=20, n_train=32, n_heldout=8, steps=3,
                    batch_size=2, num_generations=2, min_gain=-1.0)
        return cls(**{**base, **kw})


def _base(out: Path, s: ObjectiveDemoSettings, progress) -> Path:
    from jqlora.demo import build

    qdir = out / "base-nf4"
    stamp = out / "base-settings.txt"
    want = (f"hidden {s.hidden} intermediate {s.intermediate} layers {s.layers} steps {s.pretrain_steps} "
            f"seed {s.seed}\n")
    if qdir.is_dir() and stamp.is_file() and stamp.read_text() == want:
        return qdir  # built by an earlier run with these settings
    build.pretrain_copy(out / "base-fp32", hidden=s.hidden, intermediate=s.intermediate, layers=s.layers,
                        heads=4 if s.hidden >= 128 else 2, kv_heads=2 if s.hidden >= 128 else 1,
                        steps=s.pretrain_steps, seed=s.seed, progress=progress)
    build.quantize_with_bnb(out / "base-fp32", qdir)
    stamp.write_text(want)
    return qdir


def run_objective_demo(out, settings: ObjectiveDemoSettings | None = None, *, progress=None) -> dict:
    """Build (or reuse) the copy-pretrained NF4 base, fine-tune it with GRPO or DPO towards
    reversing, and return (and write) the summary."""
    import jax.numpy as jnp
    from flax import nnx

    from jqlora import lora, models
    from jqlora.demo import task
    from jqlora.train import TrainConfig, train

    s = settings or ObjectiveDemoSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log = lambda msg: print(f"demo[{s.objective}]: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log("base: a small Llama pretrained in PyTorch to copy strings, NF4 by bitsandbytes")
    qdir = _base(out, s, progress)
    t_base = time.perf_counter() - t0
    split = task.make_split(s.n_train, s.n_heldout, seed=s.seed, min_len=s.min_len, max_len=s.max_len)
    run = out / s.objective
    shutil.rmtree(run, ignore_errors=True)
    model = models.load_causal_lm(qdir, lora=lora.LoraConfig(rank=s.rank, alpha=2.0 * s.rank),
                                  compute_dtype=jnp.float32, rngs=nnx.Rngs(s.seed))
    common = dict(tokenizer_path=str(qdir), steps=s.steps, lr=s.lr, lr_schedule="constant", batch_size=s.batch_size,
                  out_dir=str(run), save_every=0, log_every=1, seed=s.seed, progress=progress, tensorboard=False)
    t1 = time.perf_counter()
    if s.objective == "grpo":
        prompts = [{"prompt": w + task.SEP} for w in split.train]
        cfg = TrainConfig(objective="grpo", reward=["jqlora.demo.objectives:chars_right"],
                          num_generations=s.num_generations, max_completion_length=s.max_len + 1,
                          temperature=s.temperature, seq_len=s.max_len + 2 + s.max_len + 1, **common)
        log(f"GRPO: {s.steps} steps of {s.batch_size} prompts x {s.num_generations} completions, reward = "
            "share of the reversed string's characters in place")
        res = train(model, cfg, data=prompts)
        rewards = [m["reward"] for m in res.metrics]
        k = max(1, len(rewards) // 5)
        before, after = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        summary = {"reward_first_steps": before, "reward_last_steps": after, "rewards": rewards}
    else:
        def pairs(words):
            return [{"prompt": w + task.SEP, "chosen": w[::-1], "rejected": w} for w in words if w != w[::-1]]

        cfg = TrainConfig(objective="dpo", dpo_beta=s.dpo_beta, seq_len=2 * s.max_len + 3, eval_every=max(1, s.steps // 10),
                          **common)
        log(f"DPO: {s.steps} steps of {s.batch_size} pairs (chosen: reversed, rejected: copied), "
            f"held-out reward accuracy every {cfg.eval_every} steps")
        res = train(model, cfg, data=pairs(split.train), eval_data=pairs(split.heldout))
        acc = [(st, ev["rewards/accuracies"]) for st, ev in res.eval_metrics]
        before, after = res.metrics[0]["rewards/accuracies"], acc[-1][1]
        summary = {"train_accuracy_step1": before, "heldout_accuracy": acc}
    seconds = time.perf_counter() - t1
    ok = after - before >= s.min_gain
    summary.update(objective=s.objective, ok=ok, before=before, after=after, base_seconds=round(t_base, 1),
                   train_seconds=round(seconds, 1), steps=s.steps, run=str(run), settings=dataclasses.asdict(s))
    (out / f"summary_{s.objective}.json").write_text(json.dumps(summary, indent=1) + "\n")
    what = "mean reward" if s.objective == "grpo" else "held-out reward accuracy"
    print(f"{s.objective}: {what} {before:.3f} -> {after:.3f} in {s.steps} steps ({seconds:.0f} s; base "
          f"{t_base:.0f} s){'' if ok else '  FAILED: no clear rise'}")
    print(f"run: {run} (loss.csv, adapter checkpoints); summary: {out / f'summary_{s.objective}.json'}")
    return summary
