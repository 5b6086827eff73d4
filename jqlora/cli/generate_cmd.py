"""`jqlora generate PATH --prompt ...`: text generation with jqlora.models.generate."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from jqlora._util import ATTENTION_AUTO_HELP, ATTENTION_CHOICES, DTYPES
from jqlora.cli._common import CLIError, model_dir, quantize_experts

HELP = "generate text from a checkpoint (+ optional PEFT adapter)"
QUANTIZE_EXPERTS = "auto"  # --quantize-experts' default (jqlora.cli.build_parser adds the flag)
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

--prompts-file FILE generates for many prompts, --batch-size at a time
(jqlora.models.rollout.generate_batch: prompts of different lengths in one batch). FILE holds one
prompt per line (plain text; blank lines skipped), or rows of a data file as `jqlora train` reads
them (JSON lines, a JSON array, CSV, Parquet), each {"prompt": "..."} or {"messages": [{"role",
"content"}, ...]} (other keys are copied to the output). With a bare --chat, each prompt is
rendered as a user turn (after --system) with the chat template, and a "messages" row as that
conversation; without it a prompt is plain text after BOS, and "messages" needs --chat. Writes
one JSON line per prompt, in order, {..., "completion": text, "ids": [...], "stopped_at_eos":
bool}, to stdout or --out FILE (written whole, or not at all).

Defaults are the fastest correct path here: bf16 compute and cuDNN attention on a GPU (each
decoded token's attention in the decode_attention kernel, its norms in the rms_norm kernel),
float32, einsum attention and XLA's norms elsewhere. --timing prints one line to stderr,
`timing: {json}`: seconds to load the model (load_s), seconds in generation (generate_s:
compiling, or loading from the compilation cache, plus prefill and decode), new tokens and their
rate, the prefill's attention and the decoding steps' (decode_attention: kernel or einsum, and
why; decode_norm: kernel or xla, and why)."""


def add_arguments(p):
    p.add_argument("path", help="checkpoint directory, or a Hugging Face model id org/name[@revision]")
    src = p.add_mutually_exclusive_group()  # one of these or --chat MESSAGE: checked in run()
    src.add_argument("--prompt", help="prompt text (may be given several times: one row each)", action="append")
    src.add_argument("--prompt-ids", dest="prompt_ids", help="comma-separated token ids (no tokenizer needed)")
    src.add_argument("--prompts-file", dest="prompts_file", metavar="FILE",
                     help="one prompt per line, or JSON lines {prompt} / {messages}; output: JSON lines (see above)")
    p.add_argument("--chat", action="append", nargs="?", const=None,
                   help="a user message, rendered with the chat template (may be given several times: one row "
                        "each); bare, with --prompts-file: render the file's prompts with the chat template")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=None,
                   help="prompts generated together with --prompts-file (default 64)")
    p.add_argument("--out", help="with --prompts-file: write the JSON lines to this file instead of stdout")
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


def _check_sources(args) -> None:
    """Exactly one prompt source; a bare --chat only with --prompts-file."""
    bare = args.chat is not None and None in args.chat
    messages = args.chat is not None and not bare
    if bare and args.prompts_file is None:
        raise CLIError("--chat needs a message (or --prompts-file FILE, whose prompts it renders)")
    if bare and len(args.chat) > 1:
        raise CLIError("--chat: with --prompts-file, give it once and without a message")
    given = [n for n, v in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids),
                            ("--prompts-file", args.prompts_file), ("--chat", args.chat if messages else None))
             if v is not None]
    if not given:
        raise CLIError("one of --prompt, --prompt-ids, --chat MESSAGE or --prompts-file is required")
    if len(given) > 1:
        raise CLIError(f"{given[0]} and {given[1]} cannot be combined")
    if args.prompts_file is None and (args.out is not None or args.batch_size is not None):
        raise CLIError("--out and --batch-size go with --prompts-file")
    if args.prompts_file is not None:
        if args.batch_size is not None and args.batch_size < 1:
            raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.json or args.show_ids:
            raise CLIError("--json / --show-ids: the output of --prompts-file is JSON lines already")


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise CLIError("--max-new-tokens must be >= 1")
    _check_sources(args)
    entries = None
    if args.prompts_file is not None:
        entries = _read_prompts_file(Path(args.prompts_file), chat=args.chat is not None)
    from jqlora._util import default_compute_dtype, jnp_dtype, quiet_third_party, resolve_attention

    t_start = time.perf_counter()
    quiet_third_party()
    path = model_dir(args.path, "PATH")  # before jax loads: a missing model fails at once
    args.path = str(path)  # the tokenizer defaults to the model's folder
    import jax
    import numpy as np

    from jqlora import adapters, models
    from jqlora.train import special_tokens

    tok, tok_file = (None, None) if args.prompt_ids else _tokenizer(args)
    if (args.prompt is not None or args.chat is not None or entries is not None) and tok is None:
        raise CLIError(f"{path} has no tokenizer.json: pass --tokenizer FILE, or --prompt-ids")
    if args.system is not None and args.chat is None:
        raise CLIError("--system needs --chat")
    if args.chat is not None and not getattr(tok, "chat_template", None):
        raise CLIError(f"{tok_file.parent}: the tokenizer has no chat template (no chat_template.jinja, no "
                       "chat_template in tokenizer_config.json): use --prompt")
    dtype = args.dtype or default_compute_dtype()
    from interop.bnb_common import read_config
    from jqlora.models.config import attn_softcap_of

    attention, why = resolve_attention(args.attention, dtype,
                                       soft_capped=attn_softcap_of(read_config(path)) is not None)
    model, report, _ = adapters.load_model_with_adapter(path, args.adapter, compute_dtype=jnp_dtype(dtype),
                                                        attention=attention,
                                                        quantize_experts=quantize_experts(args, QUANTIZE_EXPERTS))
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
        if args.chat is not None:  # an assistant turn ends at the template's end-of-turn token
            eos += [i for i in tok.end_of_turn_ids() if i not in eos]
        if entries is not None:
            return _generate_file(args, model, tok, entries, eos, bos=None if args.no_bos else sp.bos_id,
                                  t_start=t_start, dtype=dtype, attention=attention, why=why)
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
            "attention": attention, "attention_reason": why, **_decode_paths(model, len(rows))}), file=sys.stderr)
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=1))
        return 0
    for r in results:
        if r["text"] is not None:
            print(r["text"] if args.chat is not None else r["prompt"] + r["text"])
        if r["text"] is None or args.show_ids:
            print("ids: " + " ".join(map(str, r["ids"])))
    return 0


# ------------------------------------------------------------------------------ --prompts-file
def _read_prompts_file(path: Path, chat: bool) -> list:
    """[(where, fields dict)] of a prompts file. A text file (any suffix but a data file's) whose
    first non-blank character is not "{" or "[" holds one prompt per line (blank lines skipped);
    anything else is read by `jqlora.train.sources.read_rows` (JSON lines, a JSON array, CSV,
    Parquet), each row an object with a string "prompt" or a "messages" list (which needs `chat`)."""
    if not path.exists():
        raise CLIError(f"{path}: no such prompts file")
    if path.is_file() and path.suffix.lower() not in (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet"):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not text.lstrip().startswith(("{", "[")):
            lines = [(f"{path}, line {i}", {"prompt": ln}) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
            if not lines:
                raise CLIError(f"{path}: no prompts (the file is empty)")
            return lines
    from jqlora.train.sources import read_rows  # the one reader of each data format

    entries = []
    for where, obj in read_rows(path):
        has_p, has_m = "prompt" in obj, "messages" in obj
        if has_p == has_m:
            raise CLIError(f"{where}: expected exactly one of \"prompt\" and \"messages\", got keys {sorted(obj)}")
        if has_p and not isinstance(obj["prompt"], str):
            raise CLIError(f"{where}: \"prompt\" must be a string, got {type(obj['prompt']).__name__}")
        if has_p and not obj["prompt"].strip():
            raise CLIError(f"{where}: empty prompt")
        if has_m:
            msgs = obj["messages"]
            if not chat:
                raise CLIError(f"{where}: \"messages\" are rendered with the chat template: pass --chat")
            if (not isinstance(msgs, list) or not msgs
                    or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in msgs)):
                raise CLIError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
        entries.append((where, obj))
    return entries


def _generate_file(args, model, tok, entries, eos, *, bos, t_start, dtype, attention, why) -> int:
    """Tokenize every prompt of the file, generate --batch-size at a time, write JSON lines."""
    import jax

    from interop.atomic_io import write_text_atomic
    from jqlora.models.rollout import generate_batch

    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    rows = []
    for where, obj in entries:
        if args.chat is not None:
            conv = obj["messages"] if "messages" in obj else system + [{"role": "user", "content": obj["prompt"]}]
            ids = list(tok.apply_chat_template(conv, add_generation_prompt=True))
        else:
            ids = ([] if bos is None else [bos]) + list(tok.encode(obj["prompt"], add_special_tokens=False).ids)
        if not ids:
            raise CLIError(f"{where}: empty prompt (no tokens)")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise CLIError(f"{where}: token id {bad[0]} is outside the model's "
                           f"vocabulary (vocab_size {model.config.vocab_size})")
        rows.append(ids)
    t_gen = time.perf_counter()
    key = jax.random.key(args.seed)
    out, new_tokens = [], 0
    eos_set = set(eos)
    size = args.batch_size or 64
    for start in range(0, len(rows), size):
        r = generate_batch(model, rows[start:start + size], args.max_new_tokens,
                           key=jax.random.fold_in(key, start), temperature=args.temperature, top_p=args.top_p,
                           eos_token_id=eos or None)
        for j, ids in enumerate(r.completions()):
            stopped = bool(r.finished[j])
            ids = ids[:-1] if stopped and ids and ids[-1] in eos_set else ids
            new_tokens += len(ids) + stopped
            obj = dict(entries[start + j][1])
            obj.update(completion=tok.decode(ids, skip_special_tokens=True), ids=ids, stopped_at_eos=stopped)
            out.append(json.dumps(obj, ensure_ascii=False))
    t_end = time.perf_counter()
    text = "".join(line + "\n" for line in out)
    if args.out:
        write_text_atomic(args.out, text)
    else:
        sys.stdout.write(text)
    if args.timing:
        print("timing: " + json.dumps({
            "load_s": round(t_gen - t_start, 4), "generate_s": round(t_end - t_gen, 4), "prompts": len(rows),
            "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / max(t_end - t_gen, 1e-9), 2),
            "compute_dtype": dtype, "attention": attention, "attention_reason": why,
            **_decode_paths(model, min(size, len(rows)))}), file=sys.stderr)
    return 0


def _decode_paths(model, batch: int) -> dict:
    """The decoding steps' attention and norm paths for the timing line
    (`jqlora.ops.cached_attention`, `jqlora.ops.decode_norm`)."""
    from jqlora.ops.cached_attention import decode_path
    from jqlora.ops.decode_norm import norm_problem

    cfg = model.config
    path, why = decode_path(model.backend, batch, cfg.num_attention_heads, cfg.head_dim)
    if any(w is not None for w in cfg.sliding_windows):
        why += "; sliding layers with a ring buffer: einsum"
    problem = norm_problem(model.backend, (batch, 1, cfg.hidden_size))
    norm = ("kernel", f"{model.backend}: the rms_norm kernel, one launch a norm") if problem is None \
        else ("xla", f"{model.backend}: {problem}")
    return {"decode_attention": path, "decode_attention_reason": why, "decode_norm": norm[0],
            "decode_norm_reason": norm[1]}
