"""One GRPO step and one DPO step of jqlora's own training code, timed by part.

    python -m benchmarks.objective_bench --objective both --shape 8b --out DIR --tag _x
    python -m benchmarks.objective_bench --tiny          # CPU smoke run: tiny shape, a few tokens

The model is `benchmarks.train_bench.build_jax`'s (random NF4 weights, blocksize 64, double quant,
or dense bf16 with `--weights bf16`; LoRA r = 16 on every projection, unmerged, its B random as in
`benchmarks.rollout_bench`), with the compute dtype, remat and attention `jqlora train` picks by
default (bf16, "auto", "auto" on a GPU; float32 on a CPU). Each step is the one `jqlora.train.train` runs: the task of
`jqlora.train.objective_loop.make_task` (a `GRPOTask` or `DPOTask`) over data made here (random
token ids; a tokenizer that spells each id as a number), with the loop's optimizer and set-up,
bound and stepped as the loop does. One untimed step (compilation), then `--steps` timed steps;
the step reported is the median one, with its parts. Every part ends on host values (numpy), so
the device work of a part is inside its own time.

GRPO, `--prompts` x `--generations` rows, prompts of `--prompt-tokens` random ids, up to
`--new-tokens` new tokens (EOS id 2, as the config says), temperature 1, `--grpo-beta` (default
0.04, so the reference pass runs):
  rollout    `generate_batch` over every row (the task's `sample`: LoRA on, unmerged)
  reward     `even_share` (below) on the decoded completions
  update     the reference log-probs (LoRA off), the policy's forward and backward, AdamW: one
             compiled program. logp_old is logp without gradient (one update per rollout batch,
             TRL's num_iterations = 1): the loop runs no pass of its own for it.
  other_s    the rest of the step: advantages and right-padding on the host.
  `reference_alone_s` is the reference pass measured apart, on the step's own batch: a share of
  `update`, not a part of its own.
DPO, `--pairs` pairs of `--pair-tokens` tokens (chosen rows, then rejected rows):
  reference  the reference log-probs of the step's pairs (`DPOTask.reference_logps`, the program
             `precompute_ref` runs)
  update     the update given those log-probs (policy forward and backward, AdamW)
  `default_step_s` is the step `jqlora train --objective dpo` runs by default (the reference inside
  the update's program), timed after the split steps on the same model.

Peak device memory is the process's counter (JAX cannot reset it), read before and after each
objective. Writes `<device>-<date><tag>_objectives.json` to `--out` (device, date, commit,
versions, argv) and prints one JSON line per objective.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np

BOS_ID, EOS_ID = 1, 2  # benchmarks.train_bench.hf_config's ids; random tokens are drawn above them
REWARD = "benchmarks.objective_bench:even_share"
GPU_DEFAULTS = dict(prompts=8, generations=8, prompt_tokens=64, new_tokens=256, pairs=8, pair_tokens=1024)
TINY_DEFAULTS = dict(prompts=2, generations=2, prompt_tokens=8, new_tokens=8, pairs=2, pair_tokens=32)


def _note(msg: str, t0: float) -> None:
    """A progress line on stderr (a run cut off by its time limit still says how far it got)."""
    print(f"objective_bench: {time.perf_counter() - t0:7.1f} s  {msg}", file=sys.stderr, flush=True)


def even_share(prompts, completions, **_) -> list[float]:
    """GRPO's reward here: the share of even token ids in each completion (the tokenizer below
    spells ids as numbers). Random completions give rewards that differ within a group, so the
    advantages, and the update, are not zero."""
    out = []
    for text in completions:
        ids = text.split()
        out.append(sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1))
    return out


class IdTokenizer:
    """A stand-in tokenizer over random token ids: id i is the word "i". What the tasks ask of a
    tokenizer: the vocabulary (checked against the model's), token lookups for special tokens
    (none here: BOS and EOS are given as ids), and decoding completions for the reward."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def get_vocab(self, with_added_tokens: bool = True) -> dict:
        return {str(i): i for i in range(self.vocab_size)}

    def token_to_id(self, token: str):
        return int(token) if token.isdigit() and int(token) < self.vocab_size else None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def prompt_set(n: int, length: int, vocab: int, seed: int = 0):
    """`n` prompts of BOS + `length - 1` random ids (above the special ids), as `load_prompts` gives."""
    from jqlora.train.grpo import PromptSet

    rng = np.random.default_rng(seed)
    ids = [np.r_[BOS_ID, rng.integers(EOS_ID + 1, vocab, length - 1)].astype(np.int32) for _ in range(n)]
    return PromptSet("<objective_bench prompts>", [f"prompt {i + 1}" for i in range(n)], ids,
                     [f"prompt {i + 1}" for i in range(n)], [{} for _ in range(n)], [False] * n)


def pair_set(n: int, tokens: int, vocab: int, seed: int = 1):
    """`n` pairs whose chosen and rejected sequences fill `tokens` slots each (`tokens + 1` ids): a
    shared prompt of a quarter of them, then different random completions, scored."""
    from jqlora.train.preference import PairSet

    rng = np.random.default_rng(seed)
    prompt = max(1, (tokens + 1) // 4)
    seqs = []
    for _ in range(n):
        p = np.r_[BOS_ID, rng.integers(EOS_ID + 1, vocab, prompt - 1)]
        scored = np.r_[np.zeros(prompt, bool), np.ones(tokens + 1 - prompt, bool)]
        c, r = (np.r_[p, rng.integers(EOS_ID + 1, vocab, tokens + 1 - prompt)].astype(np.int32) for _ in range(2))
        seqs.append((c, scored, r, scored.copy()))
    return PairSet("<objective_bench pairs>", [f"pair {i + 1}" for i in range(n)], seqs)


def _config(objective: str, a, out_dir: str):
    from jqlora.train.config import TrainConfig

    common = dict(objective=objective, bos=BOS_ID, eos=EOS_ID, remat=a.remat, out_dir=out_dir, steps=1000,
                  lr=1e-5, progress=False, tensorboard=False, seed=0)
    if objective == "grpo":
        c = TrainConfig(seq_len=a.prompt_tokens + a.new_tokens, batch_size=a.prompts,
                        num_generations=a.generations, max_completion_length=a.new_tokens, reward=[REWARD],
                        grpo_beta=a.grpo_beta, temperature=1.0, **common)
    else:
        c = TrainConfig(seq_len=a.pair_tokens, batch_size=a.pairs, precompute_ref=True, **common)
    c.validate()
    return c


def bound_task(model, config, data, tokenizer, optimizer=None):
    """`(task, optimizer)`: the task `train_objective` makes, with its optimizer and the loop's set-up
    (remat, state committed to its device), bound as the loop binds it; `optimizer`: share one."""
    from flax import nnx

    from jqlora.train.loop import prepare_single_device_run
    from jqlora.train.objective_loop import make_task
    from jqlora.train.optim import make_optimizer

    task = make_task(model, config, data, tokenizer, None)
    if optimizer is None:
        tx = make_optimizer(config.lr, config.warmup, config.steps, config.weight_decay, config.b1, config.b2,
                            config.grad_clip, final_lr_ratio=config.final_lr_ratio, lr_schedule=config.lr_schedule)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    prepare_single_device_run(model, optimizer, config)
    model.train()
    task.bind(model, optimizer)
    return task, optimizer


class RematLog(logging.Handler):
    """The distinct lines `remat="auto"` logs (`jqlora.models`: the policy each compiled forward
    got and why) while an objective runs, for its record."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        if record.getMessage() not in self.lines:
            self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("jqlora.models").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jqlora.models").removeHandler(self)


def _peak_gib():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None


def _median_index(totals: list[float]) -> int:
    """The index of the median step (the lower one of an even count)."""
    return int(np.argsort(totals, kind="stable")[(len(totals) - 1) // 2])


def timed_steps(name: str, one, steps: int, parts: tuple, t0: float, warmup: str) -> tuple[dict, list, dict]:
    """One untimed warm-up call of `one` (it compiles; `warmup` says what it runs), then `steps`
    timed ones, each a record with "step_s", "loss" and "<part>_s" for each of `parts` (named in
    its progress line): (the warm-up record, the timed records, the median one by step_s)."""
    _note(f"{name}: warm-up step ({warmup}; compiles)", t0)
    first = one()
    _note(f"{name}: warm-up step {first['step_s']:.1f} s", t0)
    records = []
    for i in range(steps):
        s = one()
        records.append(s)
        shares = ", ".join(f"{p} {s[f'{p}_s']:.2f}" for p in parts)
        _note(f"{name}: step {i + 1}/{steps} {s['step_s']:.2f} s" + (f" ({shares})" if shares else "")
              + f", loss {s['loss']:.4f}", t0)
    return first, records, records[_median_index([s["step_s"] for s in records])]


def run_grpo(model, a, vocab: int, t0: float) -> dict:
    import jax
    import jax.numpy as jnp

    from jqlora.train.logps import token_logps
    from jqlora.train.objective_step import make_eval_fn

    peak_before = _peak_gib()
    with tempfile.TemporaryDirectory(prefix="objective_bench_") as d:
        config = _config("grpo", a, d)
        task, _ = bound_task(model, config, prompt_set(a.prompts, a.prompt_tokens, vocab), IdTokenizer(vocab))
    seen = {}
    update = task._step

    def keep_batch(batch):  # the update's batch, for the reference pass measured apart
        seen["batch"] = batch
        return update(batch)

    task._step = keep_batch

    def reference_logps(model, reference, mb):
        return token_logps(reference(), mb, temperature=float(config.temperature))

    reference = make_eval_fn(reference_logps).bind(model)

    def one():
        t = time.perf_counter()
        m = task.step()
        total = time.perf_counter() - t
        mb = {k: jnp.asarray(v[0]) for k, v in seen["batch"].items()
              if k in ("input_ids", "targets", "loss_mask", "positions")}
        jax.block_until_ready(mb)
        t = time.perf_counter()
        np.asarray(reference(mb))
        ref_s = time.perf_counter() - t
        return {"step_s": total, "rollout_s": m["time/rollout_s"], "reward_s": m["time/rewards_s"],
                "update_s": m["time/update_s"], "reference_alone_s": ref_s, "generated_tokens": int(m["tokens"]),
                "rollout_tokens_per_s": m["rollout_tokens_per_s"], "loss": m["loss"], "reward": m["reward"],
                "kl": m.get("kl"), "mean_completion_length": m["completions/mean_length"],
                "update_slots": int(seen["batch"]["input_ids"].size),
                "scored_tokens": int(seen["batch"]["loss_mask"].sum())}

    rows = a.prompts * a.generations
    first, steps, med = timed_steps("grpo", one, a.steps, ("rollout", "update"), t0,
                                    f"{rows} rows x {a.new_tokens} new tokens")
    parts = {k: round(med[f"{k}_s"], 4) for k in ("rollout", "reward", "update")}
    return {"objective": "grpo", "prompts": a.prompts, "generations": a.generations, "rows": rows,
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens, "grpo_beta": a.grpo_beta,
            "grpo_loss": config.grpo_loss, "steps": a.steps, "warmup_s": round(first["step_s"], 2),
            "step_s": round(med["step_s"], 4), "parts_s": parts,
            "other_s": round(med["step_s"] - sum(med[f"{k}_s"] for k in parts), 4),
            "reference_alone_s": round(med["reference_alone_s"], 4),
            "generated_tokens": med["generated_tokens"], "rollout_tokens_per_s": round(med["rollout_tokens_per_s"], 1),
            "mean_completion_length": med["mean_completion_length"], "update_slots": med["update_slots"],
            "scored_tokens": med["scored_tokens"],
            "update_slots_per_s": round(med["update_slots"] / med["update_s"], 1),
            "loss": med["loss"], "losses": [s["loss"] for s in steps], "reward": med["reward"], "kl": med["kl"],
            "per_step": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in steps],
            "peak_gib_before": peak_before, "peak_gib": _peak_gib()}


def run_dpo(model, a, vocab: int, t0: float) -> dict:
    peak_before = _peak_gib()
    pairs = pair_set(a.pairs, a.pair_tokens, vocab)
    with tempfile.TemporaryDirectory(prefix="objective_bench_") as d:
        config = _config("dpo", a, d)
        _note("dpo: binding (the reference log-probs of the pairs compile here)", t0)
        task, opt = bound_task(model, config, pairs, IdTokenizer(vocab))
        default_config = _config("dpo", a, d)
        default_config.precompute_ref = False
        default, _ = bound_task(model, default_config, pairs, IdTokenizer(vocab), optimizer=opt)

    def one():
        t = time.perf_counter()
        task.ref_table = task.reference_logps(task.pairs)  # this step's pairs: the whole set
        ref_s = time.perf_counter() - t
        u = time.perf_counter()
        m = task.step()
        end = time.perf_counter()
        return {"step_s": end - t, "reference_s": ref_s, "update_s": end - u, "loss": m["loss"],
                "tokens": int(m["tokens"]), "accuracy": m["rewards/accuracies"]}

    def one_default():
        t = time.perf_counter()
        loss = default.step()["loss"]
        return {"step_s": time.perf_counter() - t, "loss": loss}

    first, steps, med = timed_steps("dpo", one, a.steps, ("reference",), t0,
                                    f"{a.pairs} pairs x {a.pair_tokens} tokens")
    default_first, defaults, _ = timed_steps("dpo default", one_default, a.steps, (), t0,
                                             "the reference inside the update")
    default_warmup = default_first["step_s"]
    default_losses = [s["loss"] for s in defaults]
    default_s = float(np.median([s["step_s"] for s in defaults]))
    _note(f"dpo: default step {default_s:.2f} s", t0)
    return {"objective": "dpo", "pairs": a.pairs, "pair_tokens": a.pair_tokens, "rows": 2 * a.pairs,
            "dpo_loss": config.dpo_loss, "dpo_beta": config.dpo_beta, "steps": a.steps,
            "warmup_s": round(first["step_s"], 2), "step_s": round(med["step_s"], 4),
            "parts_s": {"reference": round(med["reference_s"], 4), "update": round(med["update_s"], 4)},
            "other_s": round(med["step_s"] - med["reference_s"] - med["update_s"], 4),
            "tokens": med["tokens"], "tokens_per_s": round(med["tokens"] / med["step_s"], 1),
            "default_step_s": round(default_s, 4), "default_tokens_per_s": round(med["tokens"] / default_s, 1),
            "default_warmup_s": round(default_warmup, 2), "loss": med["loss"], "losses": [s["loss"] for s in steps],
            "default_losses": default_losses, "accuracy": med["accuracy"],
            "per_step": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in steps],
            "peak_gib_before": peak_before, "peak_gib": _peak_gib()}


def run(a) -> list[dict]:
    import jax

    from benchmarks.rollout_bench import randomize_lora_b, short_commit
    from benchmarks.run import device_name, versions
    from benchmarks.train_bench import build_jax, frozen_formats, hf_config
    from jqlora._util import default_compute_dtype, resolve_attention

    t0 = time.perf_counter()
    dtype = default_compute_dtype()
    attention, why = resolve_attention(a.attention, dtype)
    _note(f"{dtype}, attention {attention} ({why}); building the {a.shape} model", t0)
    model, _, _ = build_jax(a.shape, 128, "auto", attention, remat=False, lora=True, weights=a.weights,
                            compute_dtype=dtype)
    randomize_lora_b(model)
    build_s = time.perf_counter() - t0
    vocab = int(hf_config(a.shape)["vocab_size"])
    common = {"shape": a.shape, "weights": a.weights, "frozen_formats": frozen_formats(model), "lora_rank": 16,
              "compute_dtype": dtype, "attention": attention, "remat": a.remat, "build_s": round(build_s, 1),
              "device": device_name(), "platform": jax.default_backend(),
              "date": datetime.date.today().isoformat(), "commit": short_commit(), "versions": versions()}
    recs = []
    for objective in (("grpo", "dpo") if a.objective == "both" else (a.objective,)):
        with RematLog() as remat:
            rec = (run_grpo if objective == "grpo" else run_dpo)(model, a, vocab, t0)
        recs.append({**rec, "remat_plans": remat.lines, **common})
        print(json.dumps(recs[-1]), flush=True)
    return recs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objective", choices=("grpo", "dpo", "both"), default="both")
    p.add_argument("--shape", default="8b", help="benchmarks.train_bench shape (tiny, 1b, 8b)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: tiny shape, 2 prompts x 2 generations of 8 tokens, 2 pairs of 32 tokens")
    p.add_argument("--weights", default="nf4", choices=("nf4", "bf16"), help="the frozen base (train_bench)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per objective, after one warm-up step")
    p.add_argument("--prompts", type=int, default=None, help="GRPO prompts per step (8; 2 with --tiny)")
    p.add_argument("--generations", type=int, default=None, help="GRPO completions per prompt (8; 2 with --tiny)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="GRPO prompt length (64; 8 with --tiny)")
    p.add_argument("--new-tokens", type=int, default=None, help="GRPO new tokens at most (256; 8 with --tiny)")
    p.add_argument("--grpo-beta", type=float, default=0.04, help="GRPO KL weight (> 0: the reference pass runs)")
    p.add_argument("--pairs", type=int, default=None, help="DPO pairs per step (8; 2 with --tiny)")
    p.add_argument("--pair-tokens", type=int, default=None, help="DPO tokens per sequence (1024; 32 with --tiny)")
    p.add_argument("--attention", default="auto", choices=("auto", "einsum", "xla", "cudnn"))
    p.add_argument("--remat", default="auto", help="as jqlora train's --remat (auto, a policy name, false)")
    p.add_argument("--out", default=None, help="folder for the JSON result (none: print only)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.tiny:
        a.shape = "tiny"
    for k, v in (TINY_DEFAULTS if a.tiny else GPU_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.remat = {"false": False, "none": False, "true": True}.get(str(a.remat).lower(), a.remat)
    from jqlora._util import raise_host_offload_limit

    raise_host_offload_limit()  # as the CLI does: an offloading remat policy past XLA's 64 GB default
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("jqlora.models").setLevel(logging.INFO)  # the remat plan "auto" chose, on stderr
    recs = run(a)
    if a.out:
        res = {"records": recs, "device": recs[0]["device"], "date": recs[0]["date"], "commit": recs[0]["commit"],
               "versions": recs[0]["versions"], "argv": list(argv if argv is not None else sys.argv[1:])}
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"{res['device'].lower().replace(' ', '-')}-{res['date']}{a.tag}_objectives.json")
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"objective_bench: wrote {path}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
