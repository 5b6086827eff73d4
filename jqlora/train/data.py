"""Training data: JSONL examples -> tokens -> fixed-shape batches, with a resumable iterator.

Input formats, one JSON object per line, each recognised by its keys (or forced with
``format=``, ``--data-format``):

* ``messages``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``,
  a conversation rendered with the tokenizer's chat template (:mod:`jqlora.tokenizer`); only the
  assistant turns (their text and end-of-turn marker) are training targets. The template writes
  the special tokens: no BOS/EOS is added.
* ``alpaca``: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional,
  may be empty), rendered with the Stanford Alpaca prompt (:data:`ALPACA_PROMPT`); the output and
  the EOS after it are training targets.
* ``text``: ``{"text": "..."}``: language modelling; every token after the first is a target.
* ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``: only the completion tokens
  (and the EOS after them) are training targets. Prompt and completion are tokenized separately
  and concatenated, so the boundary is exact.

Other keys on a line are ignored. A line that is not valid JSON, is not an object, is blank, has
the keys of no format or of two, has a field of the wrong type, an empty ``text``/``completion``/
``output``/message content, or a conversation without an assistant turn raises
:class:`DataError` naming the file and the 1-based line number.

Every example becomes a *piece* of ``(inputs, targets, mask)`` with ``inputs = ids[:-1]`` and
``targets = ids[1:]`` (so targets never cross an example boundary). A piece holds at most
``seq_len`` slots: longer examples are truncated (``overflow="truncate"``, default) or split into
several pieces (``overflow="split"``), each its own segment with positions starting at 0.

Batches (dicts of numpy arrays, all ``(batch_size, seq_len)``):

* ``input_ids`` int32, ``targets`` int32 (the next token), ``loss_mask`` float32 (1 = trained),
* ``segment_ids`` int32 (1, 2, ... per piece within a row; 0 = padding),
* ``positions`` int32 (0-based within each segment; 0 on padding).

Packing (``packing=True``) fills rows greedily in (shuffled) order: a piece that does not fit in
what is left of a row starts the next row; no piece is ever split across rows. Padding mode puts
one piece per row. Rows follow one another across epochs (the next epoch's permutation begins where
the previous one ended), so every batch is full and the row sequence does not depend on the batch
size: ``batch_size=2, grad_accum=2`` sees exactly the rows of ``batch_size=4``.

The iterator's position is ``{"epoch", "index", "seed", "fingerprint"}`` (``state_dict()``);
``load_state_dict()`` on a fresh iterator over the same data continues with exactly the batches an
uninterrupted iterator would have produced. The permutation of epoch ``e`` is a pure function of
``(seed, e)``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DataError",
    "FORMATS",
    "ALPACA_PROMPT",
    "check_data",
    "check_training_data",
    "Example",
    "SpecialTokens",
    "BatchIterator",
    "load_jsonl",
    "parse_example",
    "load_tokenizer",
    "check_tokenizer_fits",
    "special_tokens",
    "tokenize_example",
    "tokenize_examples",
    "make_batch_iterator",
    "SegmentTables",
]

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")

# Names tried (in order) when the tokenizer has no tokenizer_config.json saying which is which.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>", "<|startoftext|>", "<BOS>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>", "<|endoftext|>", "<EOS>",
              "<|im_end|>", "<|eot_id|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>", "<PAD>")


# The data formats, with the keys that identify each (a line must have the keys of exactly one).
FORMATS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "input", "output"),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
}

# The Stanford Alpaca prompts (with and without an input); the output follows "### Response:\n".
ALPACA_PROMPT = {
    True: ("Below is an instruction that describes a task, paired with an input that provides "
           "further context. Write a response that appropriately completes the request.\n\n"
           "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"),
    False: ("Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"),
}


class DataError(ValueError):
    """Bad training data or tokenizer; the message names the file and line where there is one."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One parsed JSONL line: ``text``, or ``prompt`` + ``completion`` (also what an Alpaca line
    becomes), or ``messages``. ``format`` is the line's format (a key of :data:`FORMATS`)."""

    source: str
    line: int
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict, ...] | None = None
    format: str = ""

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------

def _detect_format(obj: dict, where: str) -> str:
    found = [f for f, keys in FORMATS.items() if any(k in obj for k in keys)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DataError(f"{where}: no known format: needs a 'text' field, 'prompt' and "
                        f"'completion', 'instruction' and 'output', or 'messages' "
                        f"(found keys: {sorted(obj)})")
    keys = " and ".join(f"{f} ({', '.join(repr(k) for k in FORMATS[f] if k in obj)})" for f in found)
    raise DataError(f"{where}: has the keys of {'both' if len(found) == 2 else 'several'} "
                    f"formats, {keys}; use one format per line")


def _string(obj: dict, field: str, where: str, fmt: str, *, required=True, nonempty=True) -> str | None:
    if field not in obj:
        if required:
            need = " and ".join(repr(k) for k in FORMATS[fmt] if k != "input")
            raise DataError(f"{where}: missing field '{field}' (the {fmt} format needs {need})")
        return None
    v = obj[field]
    if not isinstance(v, str):
        raise DataError(f"{where}: '{field}' must be a string, got {type(v).__name__}")
    if nonempty and not v.strip():
        raise DataError(f"{where}: '{field}' is empty")
    return v


def _messages(obj: dict, where: str) -> tuple[dict, ...]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        raise DataError(f"{where}: 'messages' must be a list, got {type(msgs).__name__}")
    if not msgs:
        raise DataError(f"{where}: 'messages' is empty")
    for j, m in enumerate(msgs, start=1):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {j} must be an object, got {type(m).__name__}")
        for field in ("role", "content"):
            if field not in m:
                raise DataError(f"{where}: message {j} has no '{field}'")
            if not isinstance(m[field], str):
                raise DataError(f"{where}: message {j} '{field}' must be a string, got "
                                f"{type(m[field]).__name__}")
        if not m["content"].strip():
            raise DataError(f"{where}: message {j} ({m['role']}) has empty content")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message (nothing to train on); roles: "
                        f"{[m['role'] for m in msgs]}")
    return tuple(msgs)


def parse_example(obj: Any, *, source: str = "<data>", line: int = 0,
                  format: str = "auto") -> Example:
    """Validate one decoded JSON value; raise :class:`DataError` naming ``source:line``.

    Args:
      obj: the decoded line.
      source, line: where it comes from (for messages).
      format: "auto" (from the keys) or a key of :data:`FORMATS`.
    """
    where = f"{source}, line {line}"
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"data format must be 'auto' or one of {', '.join(FORMATS)}, got {format!r}")
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fmt = _detect_format(obj, where) if format == "auto" else format
    if fmt == "messages":
        if "messages" not in obj:
            raise DataError(f"{where}: missing field 'messages' (data format 'messages')")
        return Example(source, line, messages=_messages(obj, where), format=fmt)
    if fmt == "text":
        return Example(source, line, text=_string(obj, "text", where, fmt), format=fmt)
    if fmt == "alpaca":
        instruction = _string(obj, "instruction", where, fmt)
        inp = _string(obj, "input", where, fmt, required=False, nonempty=False)
        output = _string(obj, "output", where, fmt)
        has_input = bool(inp and inp.strip())
        prompt = ALPACA_PROMPT[has_input].format(instruction=instruction, input=inp)
        return Example(source, line, prompt=prompt, completion=output, format=fmt)
    prompt = _string(obj, "prompt", where, fmt, nonempty=False)
    completion = _string(obj, "completion", where, fmt)
    return Example(source, line, prompt=prompt, completion=completion, format=fmt)


def load_jsonl(path: str | os.PathLike, format: str = "auto") -> list[Example]:
    """Read and validate a JSONL file. Raises :class:`DataError` naming the file and line number.

    A final newline is fine; any other blank line is an error (it usually means a broken file).

    Args:
      path: the JSONL file.
      format: "auto" (each line's format from its keys) or a key of :data:`FORMATS`.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e}") from e
    examples = []
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # trailing newline
    for i, bline in enumerate(lines, start=1):
        where = f"{path}, line {i}"
        try:
            sline = bline.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 ({e})") from None
        if sline.endswith("\r"):
            sline = sline[:-1]
        if not sline.strip():
            raise DataError(f"{where}: empty line")
        try:
            obj = json.loads(sline)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        examples.append(parse_example(obj, source=str(path), line=i, format=format))
    if not examples:
        raise DataError(f"{path}: no examples (file is empty)")
    return examples


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike, *, chat_template: str | os.PathLike | None = None):
    """Load the tokenizer of a Hugging Face folder or a lone tokenizer.json: a
    :class:`jqlora.tokenizer.HFTokenizer` (a ``tokenizers.Tokenizer`` with the folder's special
    tokens and chat template).

    Args:
      path: tokenizer.json or a directory holding it (and tokenizer_config.json,
        chat_template.jinja).
      chat_template: a Jinja file that replaces the folder's chat template.
    """
    from jqlora.tokenizer import TokenizerError, load_hf_tokenizer

    try:
        return load_hf_tokenizer(path, chat_template=chat_template)
    except TokenizerError as e:
        raise DataError(str(e)) from None


def _max_token_id(tokenizer) -> int:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) if vocab else -1


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Raise :class:`DataError` unless every token id of ``tokenizer`` is < ``vocab_size``.

    A model may have more rows than the tokenizer has tokens (padded embeddings); never fewer.
    """
    n = _max_token_id(tokenizer) + 1
    if n > int(vocab_size):
        raise DataError(
            f"tokenizer has token ids up to {n - 1} (needs vocab_size >= {n}) but the model's "
            f"vocab_size is {vocab_size}: wrong tokenizer for this model?")


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Ids added around every example. ``None`` = not added. ``pad_id`` fills padding slots
    (they carry no loss, so any valid id works)."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int = 0


def _config_token(config: dict, key: str) -> str | None:
    v = config.get(key)
    if isinstance(v, dict):  # {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _resolve_one(tokenizer, spec, *, what: str, names: Sequence[str], config_name: str | None):
    if spec is None or spec is False:
        return None
    if isinstance(spec, bool) or spec == "auto":
        # True or "auto": from tokenizer_config.json if given, else well-known names.
        if config_name is not None:
            tid = tokenizer.token_to_id(config_name)
            if tid is not None:
                return int(tid)
        for name in names:
            tid = tokenizer.token_to_id(name)
            if tid is not None:
                return int(tid)
        if spec is True:
            raise DataError(f"tokenizer has no {what} token (tried {', '.join(names)}); "
                            f"pass {what}=<token or id> or {what}=None")
        return None
    if isinstance(spec, (int, np.integer)):
        if not 0 <= int(spec) <= _max_token_id(tokenizer):
            raise DataError(f"{what} id {spec} is outside the tokenizer's vocabulary")
        return int(spec)
    if isinstance(spec, str):
        tid = tokenizer.token_to_id(spec)
        if tid is None:
            raise DataError(f"{what} token {spec!r} is not in the tokenizer's vocabulary")
        return int(tid)
    raise TypeError(f"{what}: expected 'auto', True, None, a token string or an id; got {spec!r}")


def special_tokens(tokenizer, *, bos="auto", eos="auto", pad="auto",
                   tokenizer_path: str | os.PathLike | None = None) -> SpecialTokens:
    """Resolve BOS/EOS/PAD ids.

    Each of ``bos``/``eos``/``pad`` is ``"auto"`` (use the tokenizer's token if it has one, else
    don't add it), ``True`` (like auto, but an error if missing), ``None``/``False`` (don't add), a
    token string, or an id. "The tokenizer's token" comes from a ``tokenizer_config.json`` beside
    ``tokenizer_path`` when there is one (``bos_token``/``eos_token``/``pad_token``), else from
    the special tokens the tokenizer was loaded with (:func:`load_tokenizer`), else from
    well-known names (``<s>``, ``<|begin_of_text|>``, ``</s>``, ``<|endoftext|>``, ...).
    Padding falls back to EOS, then 0.
    """
    config: dict = dict(getattr(tokenizer, "special_tokens", None) or {})
    if tokenizer_path is not None:
        p = Path(tokenizer_path)
        cfg = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
        if cfg.is_file():
            try:
                config = json.loads(cfg.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise DataError(f"{cfg}: cannot read: {e}") from e
    bos_id = _resolve_one(tokenizer, bos, what="bos", names=_BOS_NAMES,
                          config_name=_config_token(config, "bos_token"))
    eos_id = _resolve_one(tokenizer, eos, what="eos", names=_EOS_NAMES,
                          config_name=_config_token(config, "eos_token"))
    pad_id = _resolve_one(tokenizer, pad, what="pad", names=_PAD_NAMES,
                          config_name=_config_token(config, "pad_token"))
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else 0
    return SpecialTokens(bos_id, eos_id, pad_id)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids) if text else []


def tokenize_example(tokenizer, example: Example, special: SpecialTokens
                     ) -> tuple[np.ndarray, np.ndarray]:
    """-> ``(ids int32 (n,), trained bool (n,))``; ``trained[i]`` says whether token ``i`` is a
    training target. BOS (if any) is never a target; EOS (if any) is. A conversation gets the
    ids of its chat template (no BOS/EOS added), its assistant tokens the targets."""
    where = f"{example.source}, line {example.line}"
    if example.messages is not None:
        return _tokenize_chat(tokenizer, example.messages, where)
    bos = [special.bos_id] if special.bos_id is not None else []
    eos = [special.eos_id] if special.eos_id is not None else []
    if example.text is not None:
        body = _encode(tokenizer, example.text)
        ids = bos + body + eos
        trained = [False] * len(bos) + [True] * (len(body) + len(eos))
    else:
        p = _encode(tokenizer, example.prompt)
        c = _encode(tokenizer, example.completion)
        if not c:
            raise DataError(f"{example.source}, line {example.line}: completion tokenizes to "
                            f"no tokens")
        ids = bos + p + c + eos
        trained = [False] * (len(bos) + len(p)) + [True] * (len(c) + len(eos))
    if len(ids) < 2:
        raise DataError(f"{example.source}, line {example.line}: example tokenizes to "
                        f"{len(ids)} token(s); need at least 2 (one input, one target)")
    return np.asarray(ids, np.int32), np.asarray(trained, bool)


def _tokenize_chat(tokenizer, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
    from jqlora.tokenizer import TokenizerError

    if not callable(getattr(tokenizer, "chat_ids_and_mask", None)):
        raise DataError(f"{where}: a 'messages' line needs a tokenizer with a chat template "
                        "(load it with jqlora.train.load_tokenizer from its Hugging Face folder)")
    try:
        ids, trained = tokenizer.chat_ids_and_mask(messages)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    if not trained.any():
        raise DataError(f"{where}: the chat template renders no assistant tokens")
    if len(ids) < 2:
        raise DataError(f"{where}: conversation tokenizes to {len(ids)} token(s)")
    return ids, trained


def tokenize_examples(tokenizer, examples: Sequence[Example], special: SpecialTokens
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [tokenize_example(tokenizer, ex, special) for ex in examples]


def check_data(data_path: str | os.PathLike, tokenizer, special: SpecialTokens, *,
               format: str = "auto", vocab_size: int | None = None) -> dict:
    """Read, validate and tokenize a whole JSONL file (what training does first), so that a bad
    line is reported before a model is loaded.

    Args:
      data_path: the JSONL file.
      tokenizer: from :func:`load_tokenizer`.
      special: the BOS/EOS/PAD ids (:func:`special_tokens`).
      format: "auto" or a key of :data:`FORMATS`.
      vocab_size: when given, the tokenizer's ids must fit it.

    Returns:
      ``{"examples", "formats" ({format: count}), "tokens", "trained_tokens"}``.

    Raises:
      DataError: naming the file and line of the first bad example.
    """
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    examples = load_jsonl(data_path, format=format)
    tokenized = tokenize_examples(tokenizer, examples, special)
    formats: dict[str, int] = {}
    for ex in examples:
        formats[ex.format] = formats.get(ex.format, 0) + 1
    return {"examples": len(examples), "formats": formats,
            "tokens": int(sum(len(ids) for ids, _ in tokenized)),
            "trained_tokens": int(sum(int(t.sum()) for _, t in tokenized))}


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------

def _pieces(tokenized, seq_len: int, overflow: str):
    """(ids, trained) -> list of (inputs, targets, mask) pieces of at most seq_len slots."""
    if overflow not in ("truncate", "split"):
        raise ValueError(f"overflow must be 'truncate' or 'split', got {overflow!r}")
    out = []
    for ids, trained in tokenized:
        ids = np.asarray(ids, np.int32)
        trained = np.asarray(trained, bool)
        inputs, targets, mask = ids[:-1], ids[1:], trained[1:]
        n = len(inputs)
        if n <= seq_len:
            out.append((inputs, targets, mask))
        elif overflow == "truncate":
            out.append((inputs[:seq_len], targets[:seq_len], mask[:seq_len]))
        else:
            for s in range(0, n, seq_len):
                out.append((inputs[s:s + seq_len], targets[s:s + seq_len], mask[s:s + seq_len]))
    return out


class BatchIterator:
    """Deterministic, seedable, resumable infinite iterator of batches (see module docstring)."""

    def __init__(self, tokenized: Sequence[tuple[np.ndarray, np.ndarray]], *, seq_len: int,
                 batch_size: int, packing: bool = True, seed: int = 0, shuffle: bool = True,
                 pad_id: int = 0, overflow: str = "truncate"):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1 (got {seq_len}, {batch_size})")
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.packing = bool(packing)
        self.shuffle = bool(shuffle)
        self.pad_id = int(pad_id)
        self.seed = int(seed)
        self.pieces = _pieces(tokenized, self.seq_len, overflow)
        if not self.pieces:
            raise DataError("no training examples")
        h = hashlib.sha256()
        h.update(f"{self.seq_len}|{overflow}|{len(self.pieces)}".encode())
        for inp, tgt, m in self.pieces:
            h.update(np.int64(len(inp)).tobytes())
            h.update(inp.tobytes())
            h.update(tgt[-1:].tobytes())
            h.update(np.packbits(m).tobytes())
        self.fingerprint = h.hexdigest()[:16]
        self.epoch = 0
        self.index = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        try:
            epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"bad data iterator state {state!r}: {e}") from None
        fp = state.get("fingerprint")
        if strict and fp is not None and fp != self.fingerprint:
            raise DataError(
                f"data iterator state was saved for different data (fingerprint {fp}, this data "
                f"{self.fingerprint}): the data file, tokenizer, seq_len or overflow changed")
        if not 0 <= index <= len(self.pieces) or epoch < 0:
            raise DataError(f"data iterator state {state!r} is out of range for "
                            f"{len(self.pieces)} examples")
        self.epoch, self.index, self.seed = epoch, index, seed
        self._order_cache = None

    # -- iteration -----------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.pieces)
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                order = rng.permutation(n)
            else:
                order = np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _peek(self):
        if self.index >= len(self.pieces):
            self.epoch += 1
            self.index = 0
        return self.pieces[int(self._order(self.epoch)[self.index])]

    def _empty(self, rows: int) -> dict[str, np.ndarray]:
        T = self.seq_len
        return {
            "input_ids": np.full((rows, T), self.pad_id, np.int32),
            "targets": np.full((rows, T), self.pad_id, np.int32),
            "loss_mask": np.zeros((rows, T), np.float32),
            "segment_ids": np.zeros((rows, T), np.int32),
            "positions": np.zeros((rows, T), np.int32),
        }

    @staticmethod
    def _put(batch, row: int, start: int, seg: int, piece) -> int:
        inp, tgt, m = piece
        n = len(inp)
        sl = slice(start, start + n)
        batch["input_ids"][row, sl] = inp
        batch["targets"][row, sl] = tgt
        batch["loss_mask"][row, sl] = m
        batch["segment_ids"][row, sl] = seg
        batch["positions"][row, sl] = np.arange(n, dtype=np.int32)
        return start + n

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self._empty(self.batch_size)
        for row in range(self.batch_size):
            fill, seg = 0, 0
            while True:
                piece = self._peek()
                if fill + len(piece[0]) > self.seq_len:
                    break  # starts the next row (a piece always fits an empty row)
                seg += 1
                fill = self._put(batch, row, fill, seg, piece)
                self.index += 1
                if not self.packing or fill == self.seq_len:
                    break
        return batch

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """One pass over all pieces in file order (no shuffle), the last batch padded with empty
        rows. Does not touch the training position."""
        rows, fill, seg = [], 0, 0
        cur: list = []
        for piece in self.pieces:
            if cur and (not self.packing or fill + len(piece[0]) > self.seq_len):
                rows.append(cur)
                cur, fill = [], 0
            cur.append(piece)
            fill += len(piece[0])
        if cur:
            rows.append(cur)
        for b in range(0, len(rows), self.batch_size):
            batch = self._empty(self.batch_size)
            for r, row in enumerate(rows[b:b + self.batch_size]):
                start = 0
                for seg, piece in enumerate(row, start=1):
                    start = self._put(batch, r, start, seg, piece)
            yield batch


def _model_vocab_size(model_dir: str | os.PathLike) -> int | None:
    cfg_file = Path(model_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{cfg_file}: cannot read: {e}") from None
    if isinstance(cfg, dict) and "vocab_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    v = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def check_training_data(config, model_dir: str | os.PathLike | None = None) -> dict:
    """Everything :func:`jqlora.train.train` will do to its data, done first and without a model:
    load the tokenizer, resolve BOS/EOS, read, validate and tokenize the training (and eval) file.
    A checkpoint's weights can take minutes to load; a bad line should not wait for them.

    Args:
      config: a :class:`jqlora.train.TrainConfig` (its data_path, eval_data_path, tokenizer_path,
        chat_template, data_format, bos and eos).
      model_dir: the checkpoint folder; its config.json's vocab_size bounds the tokenizer's ids.

    Returns:
      ``{"train": check_data(...), "eval": check_data(...) or None}``.

    Raises:
      DataError: the first problem, naming the file (and line).
    """
    tok = load_tokenizer(config.tokenizer_path, chat_template=getattr(config, "chat_template", None))
    special = special_tokens(tok, bos=config.bos, eos=config.eos, tokenizer_path=config.tokenizer_path)
    vocab = _model_vocab_size(model_dir) if model_dir is not None else None
    fmt = getattr(config, "data_format", "auto")
    out = {"train": check_data(config.data_path, tok, special, format=fmt, vocab_size=vocab),
           "eval": None}
    if getattr(config, "eval_data_path", None):
        out["eval"] = check_data(config.eval_data_path, tok, special, format=fmt)
    return out


def make_batch_iterator(data_path: str | os.PathLike, tokenizer, *, seq_len: int,
                        batch_size: int, packing: bool = True, seed: int = 0,
                        shuffle: bool = True, special: SpecialTokens | None = None,
                        vocab_size: int | None = None, overflow: str = "truncate",
                        tokenizer_path: str | os.PathLike | None = None,
                        format: str = "auto") -> BatchIterator:
    """JSONL file -> :class:`BatchIterator` (validates the tokenizer against ``vocab_size``)."""
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    if special is None:
        special = special_tokens(tokenizer, tokenizer_path=tokenizer_path)
    examples = load_jsonl(data_path, format=format)
    tokenized = tokenize_examples(tokenizer, examples, special)
    return BatchIterator(tokenized, seq_len=seq_len, batch_size=batch_size, packing=packing,
                         seed=seed, shuffle=shuffle, pad_id=special.pad_id, overflow=overflow)


class SegmentTables:
    """Host side of packed attention under cuDNN: adds to a packed batch "segment_lengths"
    (..., M) and "segment_offsets" (..., M + 1), each row's runs of one segment id
    (`jqlora.models.packed_attention.segment_runs`), so the model runs cuDNN's packed layout
    instead of a (T, T) mask. M is a power of two that only grows during a run (each new M
    compiles the step once more); a batch with more than `packed_attention.MAX_WIDTH` runs in a
    row gets no table and keeps the mask (the packed layout's cost grows with M; see
    `packed_attention.MAX_WIDTH`)."""

    def __init__(self):
        self.width = 4

    def add(self, batch: dict) -> dict:
        from jqlora.models import packed_attention

        width = packed_attention.table_width(batch["segment_ids"], self.width)
        if width is not None:
            self.width = width
            batch["segment_lengths"], batch["segment_offsets"] = packed_attention.segment_runs(
                np.asarray(batch["segment_ids"]), width)
        return batch
