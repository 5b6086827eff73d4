"""The demo's synthetic tasks over lowercase strings, with a character-level tokenizer.

* copy (used to pretrain the base model):    "<s>abcde=abcde</s>"
* reverse (the LoRA fine-tuning task):        prompt "abcde=" -> completion "edcba"

Strings are 3..10 random letters, generated deterministically from a seed. The held-out split
holds strings that are not in the training split. Accuracy is exact match of the greedy
generation (up to EOS) against the answer.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SEP = "="
VOCAB = {**{t: i for i, t in enumerate(SPECIALS)}, SEP: 4, **{c: 5 + i for i, c in enumerate(LETTERS)}}
MODEL_VOCAB_SIZE = 64  # the model's embedding rows (>= len(VOCAB); a round number)


def build_tokenizer():
    """A `tokenizers.Tokenizer` with one token per character (BPE over single characters, no merges)."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()
    return tok


def save_tokenizer(directory) -> Path:
    """Write tokenizer.json + tokenizer_config.json (bos/eos/pad names) into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, indent=1) + "\n")
    return d / "tokenizer.json"


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def decode(ids: Sequence[int]) -> str:
    inv = {i: t for t, i in VOCAB.items()}
    return "".join(inv.get(int(i), "?") for i in ids if int(i) not in (PAD, BOS, EOS))


def random_strings(n: int, rng: np.random.Generator, min_len: int = 3, max_len: int = 10) -> list[str]:
    lens = rng.integers(min_len, max_len + 1, size=n)
    letters = np.array(list(LETTERS))
    return ["".join(letters[rng.integers(0, 26, size=int(k))]) for k in lens]


@dataclasses.dataclass
class Split:
    train: list[str]
    heldout: list[str]


def make_split(n_train: int, n_heldout: int, seed: int = 0, min_len: int = 3, max_len: int = 10) -> Split:
    """Distinct training strings and held-out strings that never occur in the training split."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1234]))
    seen: set[str] = set()

    def fresh(n: int) -> list[str]:  # n strings not drawn before (by either split)
        out: list[str] = []
        while len(out) < n:
            for s in random_strings(n, rng, min_len, max_len):
                if s not in seen and len(out) < n:
                    seen.add(s)
                    out.append(s)
        return out

    train = fresh(n_train)
    return Split(train, fresh(n_heldout))


def reverse_example(s: str) -> dict:
    return {"prompt": s + SEP, "completion": s[::-1]}


def write_jsonl(path, strings: Sequence[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        for s in strings:
            f.write(json.dumps(reverse_example(s)) + "\n")
    os.replace(tmp, p)
    return p


def copy_batch(rng: np.random.Generator, batch: int, seq_len: int, min_len: int = 3, max_len: int = 10):
    """Pretraining batch for the copy task: (input_ids, labels) int64 (batch, seq_len); labels are
    -100 except on the copied string and the EOS after it."""
    ids = np.full((batch, seq_len), PAD, np.int64)
    labels = np.full((batch, seq_len), -100, np.int64)
    lens = rng.integers(min_len, max_len + 1, size=batch)
    for b, n in enumerate(lens):
        s = rng.integers(5, 5 + 26, size=int(n))
        row = np.concatenate([[BOS], s, [VOCAB[SEP]], s, [EOS]])
        ids[b, :len(row)] = row
        labels[b, n + 2:len(row)] = row[n + 2:]
    return ids, labels


def exact_match(model, strings: Sequence[str], *, task: str = "reverse", batch: int = 256,
                max_new_tokens: int | None = None):
    """Greedy-generate the answer for each "s=" prompt; -> (accuracy, list of (prompt, output, target))."""
    from jqlora import models

    if not strings:
        return 0.0, []
    max_new = max_new_tokens or max(len(s) for s in strings) + 1
    width = max(len(s) for s in strings) + 2  # BOS + s + "="
    rows = []
    for i in range(0, len(strings), batch):
        chunk = list(strings[i:i + batch])
        ids = np.zeros((batch, width), np.int32)  # fixed shape: one compilation
        mask = np.zeros_like(ids)
        for r, s in enumerate(chunk):
            e = [BOS] + encode(s + SEP)
            ids[r, width - len(e):] = e
            mask[r, width - len(e):] = 1
        mask[len(chunk):, -1] = 1  # filler rows: one token, ignored
        out = np.asarray(models.generate(model, ids, max_new, attention_mask=mask, eos_token_id=EOS))[:, width:]
        for r, s in enumerate(chunk):
            gen = list(out[r])
            gen = gen[:gen.index(EOS)] if EOS in gen else gen
            target = s[::-1] if task == "reverse" else s
            rows.append((s + SEP, decode(gen), target))
    acc = sum(o == t for _, o, t in rows) / len(rows)
    return acc, rows
