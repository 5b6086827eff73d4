"""`jqlora generate PATH --prompt ...`: text generation with jqlora.models.generate."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jqlora.cli._common import CLIError

HELP = "generate text from a checkpoint (+ optional PEFT adapter)"
DESCRIPTION = """\
Load PATH with jqlora.models.load_causal_lm (bitsandbytes 4/8-bit or plain), apply the PEFT
adapter given with --adapter, tokenize the prompt (tokenizer.json of PATH, or --tokenizer), and
generate with a KV cache: greedy at --temperature 0 (default), else temperature + top-p
sampling with --seed. Generation stops at the model's EOS token. Prints the prompt followed by
the continuation (--show-ids also prints the token ids; --json prints one JSON object).
Without a tokenizer, pass --prompt-ids 1,5,9 and ids are printed."""


def add_arguments(p):
    p.add_argument("path", help="checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (may be given several times: one row each)", action="append")
    src.add_argument("--prompt-ids", dest="prompt_ids", help="comma-separated token ids (no tokenizer needed)")
    p.add_argument("--adapter", help="PEFT adapter directory to apply")
    p.add_argument("--tokenizer", help="tokenizer.json or a directory holding one (default: PATH)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token")
    p.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    p.add_argument("--json", action="store_true", help="print a JSON object (prompts, texts, ids)")


def _tokenizer(args):
    from jqlora.train import load_tokenizer

    src = Path(args.tokenizer) if args.tokenizer else Path(args.path)
    file = src / "tokenizer.json" if src.is_dir() else src
    if not file.is_file():
        if args.tokenizer:
            raise CLIError(f"{file}: tokenizer file not found")
        return None, None
    return load_tokenizer(file), file


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise CLIError("--max-new-tokens must be >= 1")
    from jqlora._util import default_compute_dtype, jnp_dtype, quiet_third_party

    quiet_third_party()
    import jax
    import numpy as np

    from jqlora import adapters, models
    from jqlora.train import special_tokens

    path = Path(args.path)
    if not path.is_dir():
        raise CLIError(f"{path}: no such checkpoint directory")
    tok, tok_file = (None, None) if args.prompt_ids else _tokenizer(args)
    if args.prompt is not None and tok is None:
        raise CLIError(f"{path} has no tokenizer.json: pass --tokenizer FILE, or --prompt-ids")
    model, report, _ = adapters.load_model_with_adapter(
        path, args.adapter, compute_dtype=jnp_dtype(args.dtype or default_compute_dtype()))
    if report is not None:
        print(f"adapter: {len(report['matched'])} LoRA modules from {args.adapter}", file=sys.stderr)
    cfg = model.config
    eos = cfg.eos_token_id
    if args.prompt_ids:
        try:
            rows = [[int(t) for t in args.prompt_ids.split(",") if t.strip()]]
        except ValueError:
            raise CLIError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
        prompts = [args.prompt_ids]
    else:
        sp = special_tokens(tok, tokenizer_path=tok_file)
        if eos is None:
            eos = sp.eos_id
        bos = [] if args.no_bos or sp.bos_id is None else [sp.bos_id]
        prompts = list(args.prompt)
        rows = [bos + list(tok.encode(p, add_special_tokens=False).ids) for p in prompts]
    if any(not r for r in rows):
        raise CLIError("empty prompt (no tokens)")
    bad = [t for r in rows for t in r if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CLIError(f"token id {bad[0]} is outside the model's vocabulary (vocab_size {cfg.vocab_size})")
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):  # left-pad
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    out = models.generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          rng=jax.random.key(args.seed) if args.temperature > 0 else None,
                          eos_token_id=eos, attention_mask=mask)
    new = np.asarray(out)[:, width:]
    eos_set = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
    results = []
    for i, p in enumerate(prompts):
        gen = [int(t) for t in new[i]]
        cut = next((j for j, t in enumerate(gen) if t in eos_set), None)
        gen = gen if cut is None else gen[:cut]
        text = tok.decode(gen, skip_special_tokens=True) if tok is not None else None
        results.append({"prompt": p, "text": text, "ids": gen, "stopped_at_eos": cut is not None})
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=1))
        return 0
    for r in results:
        if r["text"] is not None:
            print(r["prompt"] + r["text"])
        if r["text"] is None or args.show_ids:
            print("ids: " + " ".join(map(str, r["ids"])))
    return 0
