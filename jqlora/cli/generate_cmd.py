"""`jqlora generate PATH --prompt ...`: text generation with jqlora.models.generate."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from jqlora._util import ATTENTION_AUTO_HELP, ATTENTION_CHOICES, DTYPES
from jqlora.cli._common import CLIError

HELP = "generate text from a checkpoint (+ optional PEFT adapter)"
DESCRIPTION = """\
Load PATH with jqlora.models.load_causal_lm (bitsandbytes 4/8-bit or plain), apply the PEFT
adapter given with --adapter, tokenize the prompt (tokenizer.json of PATH, or --tokenizer), and
generate with a KV cache: greedy at --temperature 0 (default), else temperature + top-p
sampling with --seed. Generation stops at every EOS id of the model (config.json's
eos_token_id, generation_config.json's, the tokenizer's eos_token). --prompt tokenizes plain text
(after the BOS token) and prints the prompt followed by the continuation; --chat "question" renders
the question as a user turn (after --system, if given) with the tokenizer's chat template and
add_generation_prompt, and prints the answer (--show-ids also prints the token ids; --json prints
one JSON object). Without a tokenizer, pass --prompt-ids 1,5,9 and ids are printed.

Defaults are the fastest correct path here: bf16 compute and cuDNN attention on a GPU, float32
and einsum attention elsewhere. --timing prints one line to stderr, `timing: {json}`: seconds
to load the model (load_s), seconds in generation (generate_s: compiling, or loading from the
compilation cache, plus prefill and decode), new tokens and their rate."""


def add_arguments(p):
    p.add_argument("path", help="checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (may be given several times: one row each)", action="append")
    src.add_argument("--prompt-ids", dest="prompt_ids", help="comma-separated token ids (no tokenizer needed)")
    src.add_argument("--chat", action="append",
                     help="a user message, rendered with the chat template (may be given several times: one row each)")
    p.add_argument("--system", help="system message before each --chat message")
    p.add_argument("--adapter", help="PEFT adapter directory to apply")
    p.add_argument("--tokenizer", help="tokenizer.json or a directory holding one (default: PATH)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto",
                   help=f"attention implementation; {ATTENTION_AUTO_HELP}")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token")
    p.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    p.add_argument("--json", action="store_true", help="print a JSON object (prompts, texts, ids)")
    p.add_argument("--timing", action="store_true", help="print load and generation times to stderr (see above)")


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
    from jqlora._util import default_compute_dtype, jnp_dtype, quiet_third_party, resolve_attention

    t_start = time.perf_counter()
    quiet_third_party()
    import jax
    import numpy as np

    from jqlora import adapters, models
    from jqlora.train import special_tokens

    path = Path(args.path)
    if not path.is_dir():
        raise CLIError(f"{path}: no such checkpoint directory")
    tok, tok_file = (None, None) if args.prompt_ids else _tokenizer(args)
    if (args.prompt is not None or args.chat is not None) and tok is None:
        raise CLIError(f"{path} has no tokenizer.json: pass --tokenizer FILE, or --prompt-ids")
    if args.system is not None and args.chat is None:
        raise CLIError("--system needs --chat")
    if args.chat is not None and not getattr(tok, "chat_template", None):
        raise CLIError(f"{tok_file.parent}: the tokenizer has no chat template (no chat_template.jinja, no "
                       "chat_template in tokenizer_config.json): use --prompt")
    dtype = args.dtype or default_compute_dtype()
    attention, why = resolve_attention(args.attention, dtype)
    model, report, _ = adapters.load_model_with_adapter(path, args.adapter, compute_dtype=jnp_dtype(dtype),
                                                        attention=attention)
    if report is not None:
        print(f"adapter: {len(report['matched'])} LoRA modules from {args.adapter}", file=sys.stderr)
    cfg = model.config
    from jqlora.tokenizer import generation_eos_ids

    eos = list(generation_eos_ids(path, cfg.eos_token_id))  # every id generation stops at
    if args.prompt_ids:
        try:
            rows = [[int(t) for t in args.prompt_ids.split(",") if t.strip()]]
        except ValueError:
            raise CLIError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
        prompts = [args.prompt_ids]
    else:
        sp = special_tokens(tok, tokenizer_path=tok_file)
        named = tok.token_id("eos_token")  # tokenizer_config.json's eos_token (an instruct model's end of turn)
        if named is not None and named not in eos:
            eos.append(named)
        if not eos and sp.eos_id is not None:
            eos.append(sp.eos_id)
        if args.chat is not None:  # the template writes any BOS itself
            system = [] if args.system is None else [{"role": "system", "content": args.system}]
            prompts = list(args.chat)
            rows = [tok.apply_chat_template(system + [{"role": "user", "content": c}], add_generation_prompt=True)
                    for c in prompts]
        else:
            bos = [] if args.no_bos or sp.bos_id is None else [sp.bos_id]
            prompts = list(args.prompt)
            rows = [bos + list(tok.encode(p, add_special_tokens=False).ids) for p in prompts]
    eos = eos or None
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
    t_gen = time.perf_counter()
    out = models.generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          rng=jax.random.key(args.seed) if args.temperature > 0 else None,
                          eos_token_id=eos, attention_mask=mask)
    new = np.asarray(out)[:, width:]  # waits for the device
    t_end = time.perf_counter()
    eos_set = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
    results = []
    for i, p in enumerate(prompts):
        gen = [int(t) for t in new[i]]
        cut = next((j for j, t in enumerate(gen) if t in eos_set), None)
        gen = gen if cut is None else gen[:cut]
        text = tok.decode(gen, skip_special_tokens=True) if tok is not None else None
        results.append({"prompt": p, "text": text, "ids": gen, "stopped_at_eos": cut is not None})
    if args.timing:
        new_tokens = sum(len(r["ids"]) for r in results)
        print("timing: " + json.dumps({
            "load_s": round(t_gen - t_start, 4), "generate_s": round(t_end - t_gen, 4), "new_tokens": new_tokens,
            "tokens_per_s": round(new_tokens / max(t_end - t_gen, 1e-9), 2), "compute_dtype": dtype,
            "attention": attention, "attention_reason": why}), file=sys.stderr)
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=1))
        return 0
    for r in results:
        if r["text"] is not None:
            print(r["text"] if args.chat is not None else r["prompt"] + r["text"])
        if r["text"] is None or args.show_ids:
            print("ids: " + " ".join(map(str, r["ids"])))
    return 0
