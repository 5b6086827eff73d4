"""Training batches: tokenized examples -> fixed-shape (packed or padded) batches, with a
resumable iterator. Reading rows is :mod:`jqlora.train.sources`, examples
:mod:`jqlora.train.examples`; tokenizing them is :mod:`jqlora.train.tokenization`.

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

import hashlib
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import SettingError
from .examples import DataError, Schema
from .tokenization import SpecialTokens, load_tokenizer, special_tokens, tokenize_source

__all__ = [
    "check_training_data",
    "BatchIterator",
    "make_batch_iterator",
    "SegmentTables",
]

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------

def _pieces(tokenized, seq_len: int, overflow: str):
    """(ids, trained) -> list of (inputs, targets, mask) pieces of at most seq_len slots."""
    if overflow not in ("truncate", "split"):
        raise SettingError(f"overflow must be 'truncate' or 'split', got {overflow!r}")
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

    def rows_per_epoch(self) -> int:
        """The rows one pass over the data starts: the rows :meth:`__next__` fills with the first
        epoch's pieces, packed the same way (the last of them may be completed by the next
        epoch's pieces). What ``TrainConfig.epochs`` counts in."""
        if not self.packing:
            return len(self.pieces)
        rows, fill = 0, None
        for i in self._order(0):
            n = len(self.pieces[int(i)][0])
            if fill is None or fill == self.seq_len or fill + n > self.seq_len:
                rows, fill = rows + 1, 0
            fill += n
        return rows

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


def checkpoint_config(model_dir: str | os.PathLike | None) -> dict:
    """A checkpoint folder's config.json (`interop.bnb_common.read_config`: a nested text_config's
    fields when there is one); {} without a folder or the file. Read once per run by the data
    check, which hands it on (the attention choice needs it before the model loads)."""
    from interop.bnb_common import CONFIG_FILE, read_config

    if model_dir is None or not (Path(model_dir) / CONFIG_FILE).is_file():
        return {}
    return read_config(model_dir)


def config_vocab_size(cfg: dict) -> int | None:
    """The vocab_size of a checkpoint config; None when it holds no integer there."""
    v = cfg.get("vocab_size")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def check_supervised(tokenized, config, source: str) -> None:
    """Refuse data with no supervised token once examples are cut to ``seq_len`` (the rule of
    :class:`BatchIterator`: a piece's targets are ``ids[1:]``, truncated to ``seq_len`` unless
    ``overflow="split"``), and warn about the examples that have none."""
    counts = []
    for _ids, trained in tokenized:
        mask = np.asarray(trained, bool)[1:]
        if config.overflow != "split":
            mask = mask[:config.seq_len]
        counts.append(int(mask.sum()))
    empty = sum(1 for c in counts if c == 0)
    if counts and empty == len(counts):
        raise DataError(
            f"{source}: nothing to train on: all {len(counts)} examples have no supervised token "
            f"within seq_len={config.seq_len} (every completion is cut off by truncation); raise "
            f"seq_len, shorten the prompts or use overflow='split'")
    if empty:
        warnings.warn(f"{source}: {empty} of {len(counts)} examples have no supervised token "
                      f"within seq_len={config.seq_len} (their completions are cut off); they "
                      f"add no loss", stacklevel=5)


def training_batches(config, tokenized, special: SpecialTokens, *, source: str,
                     eval_: bool = False) -> BatchIterator:
    """The :class:`BatchIterator` :func:`jqlora.train.train` draws from: `tokenized` cut into
    `config`'s batches (seq_len, batch_size, packing, seed, shuffle, overflow), padded with
    ``special.pad_id``. Training data (not ``eval_``) must have a supervised token
    (:func:`check_supervised`, naming `source`); eval data is never shuffled."""
    if not eval_:
        check_supervised(tokenized, config, source)
    return BatchIterator(tokenized, seq_len=config.seq_len, batch_size=config.batch_size,
                         packing=config.packing, seed=config.seed,
                         shuffle=config.shuffle and not eval_, pad_id=special.pad_id,
                         overflow=config.overflow)


def check_training_data(config, model_dir: str | os.PathLike | None = None) -> dict:
    """Everything :func:`jqlora.train.train` will do to its data, done first and without a model:
    load the tokenizer, resolve BOS/EOS, read, validate and tokenize the training (and eval) data
    (any source :func:`jqlora.train.sources.read_rows` takes, tokenized as it streams) and cut it
    into batches. A checkpoint's weights can take minutes to load; a bad line should not
    wait for them. Hand ``"batches"`` and ``"eval_batches"`` to ``train(data=..., eval_data=...)``:
    the files are then read and tokenized once.

    Args:
      config: a :class:`jqlora.train.TrainConfig` (its data_path, data_split, eval_data_path,
        eval_data_split, tokenizer_path, chat_template, data_format, the column names and
        role_map (:meth:`~jqlora.train.examples.Schema.from_config`), bos, eos and the batch
        settings).
      model_dir: the checkpoint folder; its config.json's vocab_size bounds the tokenizer's ids.

    Returns:
      ``{"train": summary, "eval": summary or None, "batches": BatchIterator, "eval_batches":
      BatchIterator or None, "model_config": model_dir's config.json or {}}``; a summary is :func:`~jqlora.train.tokenization.check_data`'s.

    Raises:
      DataError: the first problem, naming the file (and line); also training data without a
        supervised token within seq_len.
      interop.CheckpointError: model_dir's config.json is unreadable or not a JSON object.
    """
    tok = load_tokenizer(config.tokenizer_path, chat_template=getattr(config, "chat_template", None))
    special = special_tokens(tok, bos=config.bos, eos=config.eos, tokenizer_path=config.tokenizer_path)
    model_cfg = checkpoint_config(model_dir)
    vocab = config_vocab_size(model_cfg)
    fmt = getattr(config, "data_format", "auto")
    schema = Schema.from_config(config)
    summary, tokenized = tokenize_source(config.data_path, tok, special, format=fmt, vocab_size=vocab,
                                         schema=schema, split=getattr(config, "data_split", None))
    out = {"train": summary, "eval": None, "eval_batches": None, "model_config": model_cfg}
    if getattr(config, "eval_data_path", None):  # every source's rows are checked before the batches
        out["eval"], eval_tokenized = tokenize_source(config.eval_data_path, tok, special, format=fmt,
                                                      schema=schema,
                                                      split=getattr(config, "eval_data_split", None))
        out["eval_batches"] = training_batches(config, eval_tokenized, special,
                                               source=str(config.eval_data_path), eval_=True)
    out["batches"] = training_batches(config, tokenized, special, source=str(config.data_path))
    return out


def make_batch_iterator(data_path: str | os.PathLike, tokenizer, *, seq_len: int,
                        batch_size: int, packing: bool = True, seed: int = 0,
                        shuffle: bool = True, special: SpecialTokens | None = None,
                        vocab_size: int | None = None, overflow: str = "truncate",
                        tokenizer_path: str | os.PathLike | None = None,
                        format: str = "auto", schema: Schema | None = None,
                        split: str | None = None) -> BatchIterator:
    """Data source (file, ``datasets`` folder, cached hub id) -> :class:`BatchIterator`
    (validates the tokenizer against ``vocab_size``)."""
    if special is None:
        special = special_tokens(tokenizer, tokenizer_path=tokenizer_path)
    _, tokenized = tokenize_source(data_path, tokenizer, special, format=format, vocab_size=vocab_size,
                                   schema=schema, split=split)
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
