"""Training data: JSONL examples -> tokens -> fixed-shape batches, with a resumable iterator.

Input format, one JSON object per line:

* ``{"text": "..."}``: language modelling; every token after the first is a training target.
* ``{"prompt": "...", "completion": "..."}``: supervised fine-tuning; only the completion tokens
  (and the EOS after them) are training targets. Prompt and completion are tokenized separately
  and concatenated, so the boundary is exact.

Other keys on a line are ignored. A line that is not valid JSON, is not an object, is blank, has
neither/both forms, has a field of the wrong type, or an empty ``text``/``completion`` raises
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


class DataError(ValueError):
    """Bad training data or tokenizer; the message names the file and line where there is one."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One parsed JSONL line. ``text`` xor (``prompt``, ``completion``) is set."""

    source: str
    line: int
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------

def parse_example(obj: Any, *, source: str = "<data>", line: int = 0) -> Example:
    """Validate one decoded JSON value; raise :class:`DataError` naming ``source:line``."""
    where = f"{source}, line {line}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_text = "text" in obj
    has_pc = "prompt" in obj or "completion" in obj
    if has_text and has_pc:
        raise DataError(f"{where}: has both 'text' and 'prompt'/'completion'; use one form")
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise DataError(f"{where}: 'text' is empty")
        return Example(source, line, text=text)
    if has_pc:
        for field in ("prompt", "completion"):
            if field not in obj:
                raise DataError(f"{where}: missing field '{field}' (need 'prompt' and 'completion')")
            if not isinstance(obj[field], str):
                raise DataError(
                    f"{where}: '{field}' must be a string, got {type(obj[field]).__name__}")
        if not obj["completion"].strip():
            raise DataError(f"{where}: 'completion' is empty")
        return Example(source, line, prompt=obj["prompt"], completion=obj["completion"])
    raise DataError(f"{where}: needs a 'text' field or 'prompt' and 'completion' fields "
                    f"(found keys: {sorted(obj)})")


def load_jsonl(path: str | os.PathLike) -> list[Example]:
    """Read and validate a JSONL file. Raises :class:`DataError` naming the file and line number.

    A final newline is fine; any other blank line is an error (it usually means a broken file).
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
        examples.append(parse_example(obj, source=str(path), line=i))
    if not examples:
        raise DataError(f"{path}: no examples (file is empty)")
    return examples


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def load_tokenizer(path: str | os.PathLike):
    """Load a ``tokenizers.Tokenizer`` from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"{file}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise DataError(f"{file}: cannot load tokenizer: {e}") from e


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
    well-known names (``<s>``, ``<|begin_of_text|>``, ``</s>``, ``<|endoftext|>``, ...).
    Padding falls back to EOS, then 0.
    """
    config: dict = {}
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
    training target. BOS (if any) is never a target; EOS (if any) is."""
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


def tokenize_examples(tokenizer, examples: Sequence[Example], special: SpecialTokens
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [tokenize_example(tokenizer, ex, special) for ex in examples]


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


def make_batch_iterator(data_path: str | os.PathLike, tokenizer, *, seq_len: int,
                        batch_size: int, packing: bool = True, seed: int = 0,
                        shuffle: bool = True, special: SpecialTokens | None = None,
                        vocab_size: int | None = None, overflow: str = "truncate",
                        tokenizer_path: str | os.PathLike | None = None) -> BatchIterator:
    """JSONL file -> :class:`BatchIterator` (validates the tokenizer against ``vocab_size``)."""
    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    if special is None:
        special = special_tokens(tokenizer, tokenizer_path=tokenizer_path)
    examples = load_jsonl(data_path)
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
