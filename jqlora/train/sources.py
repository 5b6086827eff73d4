"""Training data as people store it: one reader per storage format, each the only code that parses
its format, each yielding rows as ``(where, obj)``: ``where`` names the file and row in every error
message, ``obj`` is the row as a dict. What a row *means* (messages, Alpaca, ...) is
:mod:`jqlora.train.examples`' job.

Sources (:func:`source_kind`), each read lazily, a row at a time, so a file larger than memory
streams through:

* ``jsonl``: one JSON object per line (``.jsonl``, ``.ndjson``, and ``.json`` or any other name
  whose first non-space character is not ``[``); rows are named ``"data.jsonl, line 3"``.
* ``json``: a JSON array of objects (a file whose first non-space character is ``[``), decoded
  item by item from a buffer; ``"data.json, row 3 (line 7)"``.
* ``csv`` / ``tsv``: a header row, then one row per record (:mod:`csv`; quoted cells may span
  lines); every cell is a string; ``"chat.csv, row 12 (line 13)"`` (row: the 12th record after
  the header; line: where it starts). Blank lines are skipped.
* ``parquet``: read by record batches (``pyarrow``); ``"data.parquet, row 5"``.
* ``dataset_folder``: a ``datasets`` ``save_to_disk`` folder, a ``DatasetDict`` (``split`` picks
  one, default ``"train"``) or a ``Dataset``; ``"folder, split train, row 5"``.
* ``hub``: a Hugging Face dataset id (``org/name``) already in the local ``datasets`` cache
  (``HF_DATASETS_CACHE``; ``HF_DATASETS_OFFLINE=1`` keeps ``datasets`` off the network);
  never downloaded here: a missing one is an error that gives the command that downloads it.

In Parquet and ``datasets`` rows a null cell is left out, as a key missing from a JSON line (a
table with columns of several formats has nulls where a row's format has no field). ``pyarrow``
and ``datasets`` are optional (``pip install 'jqlora[data]'``) and imported only for their sources.

Bad input raises :class:`DataError` naming the file and row: invalid JSON or UTF-8, a row that is
not an object, a CSV record with the wrong number of fields, an unreadable Parquet file, a source
without rows.
"""
from __future__ import annotations

import codecs
import csv
import importlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jqlora.errors import Error

__all__ = ["DataError", "KINDS", "read_rows", "source_kind", "json_cell"]

KINDS = ("jsonl", "json", "csv", "tsv", "parquet", "dataset_folder", "hub")
INSTALL = "pip install 'jqlora[data]'"
BATCH_ROWS = 1024            # rows per Parquet / Arrow record batch
CHUNK_BYTES = 1 << 20        # a JSON array is decoded from a buffer refilled this much at a time
MAX_ITEM_CHARS = 1 << 28     # one JSON array item larger than this is an error, not a buffer
_SUFFIX_KIND = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
                ".parquet": "parquet", ".pq": "parquet"}
_DATA_SUFFIXES = (*_SUFFIX_KIND, ".json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_JSON_SPACE = " \t\r\n"


class DataError(Error, ValueError):
    """Bad training data or tokenizer; the message names the file and row where there is one."""


# ----------------------------------------------------------------------------------------------
# which reader
# ----------------------------------------------------------------------------------------------

def _sniff(head: bytes, suffix: str) -> str:
    """The kind of a file from its suffix, else from its first bytes."""
    kind = _SUFFIX_KIND.get(suffix.lower())
    if kind is not None:
        return kind
    if head.startswith(b"PAR1"):
        return "parquet"
    text = head.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
    return "json" if text.startswith(b"[") else "jsonl"


def _is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.lower().endswith(_DATA_SUFFIXES)


def _locate(path: str | os.PathLike) -> str:
    """"file", "dataset_folder" or "hub", without opening anything."""
    p = Path(path)
    if p.is_dir():
        return "dataset_folder"
    if p.exists():
        return "file"
    if _is_hub_id(str(path)):
        return "hub"
    raise DataError(f"{path}: no such data file or folder")


def source_kind(path: str | os.PathLike) -> str:
    """Which reader :func:`read_rows` uses for ``path``: one of :data:`KINDS`. A path that does
    not exist is a hub id when it looks like one (``org/name``, no data-file suffix); a file's
    kind comes from its suffix, else from its first bytes.

    Raises:
      DataError: no such file or folder (and not a hub id), or the file cannot be opened.
    """
    where = _locate(path)
    if where != "file":
        return where
    try:
        with open(path, "rb") as f:
            return _sniff(f.read(4096), Path(path).suffix)
    except OSError as e:
        raise DataError(f"{path}: cannot read data file: {e.strerror or e}") from None


def read_rows(path: str | os.PathLike, *, split: str | None = None) -> Iterator[tuple[str, dict]]:
    """The rows of a data source as ``(where, obj)``, lazily (see the module docstring). A file
    is opened once.

    Args:
      path: a JSONL, JSON, CSV, TSV or Parquet file, a ``datasets`` ``save_to_disk`` folder, or
        a Hugging Face dataset id in the local cache.
      split: the split of a folder or dataset id (default ``"train"``); files have none.

    Raises:
      DataError: naming the file and row of the first bad row, or a source without rows; a
        missing source at the call, the others while iterating.
    """
    where = _locate(path)
    if where == "hub":
        rows = _hub_rows(str(path), split)
    elif where == "dataset_folder":
        rows = _folder_rows(Path(path), split)
    else:
        rows = _file_rows(Path(path))
    return _count(rows, str(path))


def _count(rows: Iterator[tuple[str, dict]], name: str) -> Iterator[tuple[str, dict]]:
    """``rows``, then an error if there were none."""
    n = 0
    for n, row in enumerate(rows, start=1):
        yield row
    if n == 0:
        raise DataError(f"{name}: no examples (the source is empty)")


def _file_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Open the file once; sniff its kind from the first bytes; hand the open file to its reader."""
    name = str(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{name}: cannot read data file: {e.strerror or e}") from None
    with f:
        kind = _sniff(f.peek(4096)[:4096], path.suffix)
        if kind == "jsonl":
            yield from _jsonl_rows(f, name)
        elif kind == "json":
            yield from _json_array_rows(f, name)
        elif kind in ("csv", "tsv"):
            yield from _csv_rows(f, name, "," if kind == "csv" else "\t")
        else:
            yield from _parquet_rows(f, name)


def _object(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)") from None


# ----------------------------------------------------------------------------------------------
# JSON lines, JSON arrays, JSON cells
# ----------------------------------------------------------------------------------------------

def _jsonl_rows(f, name: str) -> Iterator[tuple[str, dict]]:
    """One JSON object per line. A final newline is fine; any other blank line is an error (it
    usually means a broken file). A UTF-8 byte order mark before the first line is skipped."""
    for i, raw in enumerate(f, start=1):
        where = f"{name}, line {i}"
        line = _utf8(raw, where)
        if i == 1:
            line = line.removeprefix("\ufeff")
        line = line.removesuffix("\n").removesuffix("\r")
        if not line.strip():
            raise DataError(f"{where}: empty line")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        yield where, _object(obj, where)


def json_cell(value: Any, where: str, field: str) -> Any:
    """A cell that holds a JSON array or object as a string (a CSV or Parquet column of
    conversations) decoded; any other value as it is."""
    if not isinstance(value, str) or not value.lstrip().startswith(("[", "{")):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: '{field}' is a string but not valid JSON ({e.msg} at column "
                        f"{e.colno})") from None


class _Chars:
    """The text of a binary file, decoded incrementally into a buffer: ``buf[pos:]`` is what is
    not consumed yet, ``line`` the 1-based line of ``buf[pos]``."""

    def __init__(self, f, name: str):
        self.f, self.name = f, name
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.line, self.eof, self.first = "", 0, 1, False, True

    def fill(self, where: str) -> bool:
        """Read more; False at the end of the file."""
        if self.eof:
            return False
        raw = self.f.read(max(CHUNK_BYTES, len(self.buf) - self.pos))
        self.eof = not raw
        try:
            text = self.decoder.decode(raw, final=self.eof)
        except UnicodeDecodeError as e:
            line = self.line + self.buf.count("\n", self.pos) + raw[:max(e.start, 0)].count(b"\n")
            raise DataError(f"{self.name}, line {line}: not valid UTF-8 ({e.reason})") from None
        if self.first:
            text, self.first = text.removeprefix("\ufeff"), False
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        return True

    def advance(self, end: int) -> None:
        self.line += self.buf.count("\n", self.pos, end)
        self.pos = end

    def skip_space(self, where: str) -> str:
        """Skip JSON whitespace; the next character, or "" at the end of the file."""
        while True:
            end = self.pos
            while end < len(self.buf) and self.buf[end] in _JSON_SPACE:
                end += 1
            self.advance(end)
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill(where):
                return ""


def _json_array_rows(f, name: str) -> Iterator[tuple[str, dict]]:
    """A JSON array of objects, decoded one item at a time from a buffer of about
    :data:`CHUNK_BYTES` (an item never has to fit in one chunk: the buffer grows until it does)."""
    decoder = json.JSONDecoder()
    text = _Chars(f, name)
    if text.skip_space(f"{name}, line 1") != "[":
        raise DataError(f"{name}, line {text.line}: a JSON data file is one object per line or an "
                        "array of objects; this one starts with neither")
    text.advance(text.pos + 1)
    n = 0
    while True:
        c = text.skip_space(f"{name}, row {n + 1}")
        if c == "]" and n == 0:
            text.advance(text.pos + 1)
            break
        where = f"{name}, row {n + 1} (line {text.line})"
        if c == "":
            raise DataError(f"{where}: the file ends inside the array (no closing ']')")
        while True:
            try:
                obj, end = decoder.raw_decode(text.buf, text.pos)
                break
            except json.JSONDecodeError as e:
                if len(text.buf) - text.pos > MAX_ITEM_CHARS or not text.fill(where):
                    line = text.line + text.buf.count("\n", text.pos, e.pos)
                    raise DataError(f"{where}: invalid JSON ({e.msg} at line {line})") from None
        n += 1
        text.advance(end)
        yield where, _object(obj, where)
        c = text.skip_space(f"{name}, after row {n}")
        if c == "]":
            text.advance(text.pos + 1)
            break
        if c == "":
            raise DataError(f"{name}: the file ends inside the array (no closing ']' after row {n})")
        if c != ",":
            raise DataError(f"{name}, line {text.line}: expected ',' or ']' after row {n}, found {c!r}")
        text.advance(text.pos + 1)
    if text.skip_space(f"{name}, line {text.line}"):
        raise DataError(f"{name}, line {text.line}: text after the closing ']' of the array")


# ----------------------------------------------------------------------------------------------
# CSV / TSV
# ----------------------------------------------------------------------------------------------

def _csv_rows(f, name: str, delimiter: str) -> Iterator[tuple[str, dict]]:
    """A header, then records of as many cells; each line decoded as UTF-8 on its own, so a bad
    byte is named by its line."""
    at = {"header": False, "row": 0}  # header read; records after it so far

    def lines():
        for i, raw in enumerate(f, start=1):
            what = f"row {at['row'] + 1} (line {i})" if at["header"] else f"line {i}"
            line = _utf8(raw, f"{name}, {what}")
            yield line.removeprefix("\ufeff") if i == 1 else line

    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))  # long texts are normal here
    reader = csv.reader(lines(), delimiter=delimiter, strict=True)
    header: list[str] | None = None
    start = 1
    while True:
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            what = f"row {at['row'] + 1} (line {start})" if at["header"] else f"line {start}"
            raise DataError(f"{name}, {what}: not valid {'CSV' if delimiter == ',' else 'TSV'} ({e})") from None
        first, start = start, reader.line_num + 1
        if not record:
            continue  # a blank line
        if header is None:
            header = record
            dup = sorted({c for c in header if header.count(c) > 1})
            if dup or not all(c.strip() for c in header):
                raise DataError(f"{name}, line {first}: the header row needs distinct, non-empty column "
                                f"names (got {header})")
            at["header"] = True
            continue
        at["row"] += 1
        where = f"{name}, row {at['row']} (line {first})"
        if len(record) != len(header):
            raise DataError(f"{where}: {len(record)} fields, the header has {len(header)}")
        yield where, dict(zip(header, record))


# ----------------------------------------------------------------------------------------------
# Parquet, datasets folders, hub ids
# ----------------------------------------------------------------------------------------------

def _optional(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the '{module.split('.')[0]}' package: {INSTALL}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _arrow_rows(batches, prefix: str, errors) -> Iterator[tuple[str, dict]]:
    """Rows of record batches (pyarrow RecordBatch or Table), nulls left out."""
    n = 0
    it = iter(batches)
    while True:
        try:
            batch = next(it)
            rows = batch.to_pylist()
        except StopIteration:
            return
        except errors as e:
            raise DataError(f"{prefix}, row {n + 1}: unreadable ({_one_line(e)})") from None
        for row in rows:
            n += 1
            yield f"{prefix}, row {n}", {k: v for k, v in row.items() if v is not None}


def _parquet_rows(f, name: str) -> Iterator[tuple[str, dict]]:
    pa = _optional("pyarrow", f"{name}: reading Parquet")
    pq = _optional("pyarrow.parquet", f"{name}: reading Parquet")
    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{name}: not a readable Parquet file ({_one_line(e)})") from None
    yield from _arrow_rows(pf.iter_batches(batch_size=BATCH_ROWS), name, (pa.ArrowException, OSError))


def _dataset_rows(ds, prefix: str) -> Iterator[tuple[str, dict]]:
    """The rows of a ``datasets.Dataset`` (memory-mapped Arrow), by record batches."""
    pa = _optional("pyarrow", prefix)
    yield from _arrow_rows(ds.with_format("arrow").iter(batch_size=BATCH_ROWS), prefix,
                           (pa.ArrowException, OSError))


def _pick_split(obj, name: str, split: str | None) -> tuple[Any, str]:
    """(the Dataset, the row prefix) of a Dataset or DatasetDict."""
    if hasattr(obj, "keys"):  # a DatasetDict
        want = split or "train"
        if want not in obj:
            raise DataError(f"{name}: no split {want!r} (splits: {', '.join(obj.keys())}); pick one "
                            "with data_split (--data-split)")
        return obj[want], f"{name}, split {want}"
    own = getattr(obj, "split", None)
    if split is not None and own is not None and str(own) != split:
        raise DataError(f"{name}: holds split {str(own)!r} only, asked for {split!r}")
    return obj, name


def _folder_rows(path: Path, split: str | None) -> Iterator[tuple[str, dict]]:
    name = str(path)
    if not any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        raise DataError(f"{name}: a folder, but not a `datasets` save_to_disk folder (no "
                        "dataset_dict.json or state.json); give a data file or such a folder")
    datasets = _optional("datasets", f"{name}: reading a datasets folder")
    try:
        obj = datasets.load_from_disk(name)
    except (OSError, ValueError) as e:
        raise DataError(f"{name}: cannot load the datasets folder ({_one_line(e)})") from None
    ds, prefix = _pick_split(obj, name, split)
    yield from _dataset_rows(ds, prefix)


def download_command(repo_id: str) -> str:
    """What puts a hub dataset into the local ``datasets`` cache."""
    return f"python -c \"import datasets; datasets.load_dataset('{repo_id}')\""


def _in_cache(datasets, repo_id: str) -> bool:
    """Whether the ``datasets`` cache holds a prepared copy of ``repo_id`` (the folders
    ``<org>___<name>/<config>/<version>/<hash>`` that ``load_dataset`` falls back to offline)."""
    org, name = repo_id.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE) / f"{org}___{datasets.naming.camelcase_to_snakecase(name)}"
    return any(p.is_dir() for p in root.glob("*/*/*"))


def _hub_rows(repo_id: str, split: str | None) -> Iterator[tuple[str, dict]]:
    datasets = _optional("datasets", f"{repo_id}: a Hugging Face dataset id")
    missing = (f"{repo_id}: no such data file or folder, and not a dataset in the local Hugging Face "
               f"cache ({datasets.config.HF_DATASETS_CACHE}); to download it: {download_command(repo_id)}")
    if not _in_cache(datasets, repo_id):
        raise DataError(missing)
    errors = (OSError, ValueError, getattr(datasets.exceptions, "DatasetsError", OSError))
    try:
        obj = datasets.load_dataset(repo_id, download_mode="reuse_cache_if_exists")
    except ConnectionError:
        raise DataError(missing) from None
    except errors as e:
        raise DataError(f"{repo_id}: cannot load the cached dataset ({_one_line(e)})") from None
    ds, prefix = _pick_split(obj, repo_id, split)
    yield from _dataset_rows(ds, prefix)
