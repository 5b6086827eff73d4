"""`jqlora.train.sources`: the same rows written as JSONL, a JSON array, CSV, TSV, Parquet, a
`datasets` save_to_disk folder and a hub dataset in a (temporary, offline) `datasets` cache read
back equal, with their rows named by file and row; malformed input in each format named by file
and row; readers stream (a bad row late in a file does not stop the first rows; a file many times
larger than the reader's memory passes through it)."""
from __future__ import annotations

import csv
import json
import tracemalloc
from pathlib import Path

import pytest

from jqlora.train import sources as S
from jqlora.train.examples import DataError

STORAGES = ("jsonl", "json", "csv", "tsv", "parquet", "folder", "hub")
CELLS_AS_JSON = ("csv", "tsv")  # storages whose cells are strings: lists and dicts stored as JSON


def write_rows(storage: str, rows: list[dict], tmp: Path, monkeypatch=None, name: str = "d") -> str:
    """Write `rows` in `storage`; return what read_rows takes (a path, or a hub id: then the
    `datasets` cache is a fresh folder under tmp, made current and offline with monkeypatch)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    table = [{c: r.get(c) for c in cols} for r in rows]  # columnar: a missing key is a null
    if storage == "jsonl":
        p = tmp / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif storage == "json":
        p = tmp / f"{name}.json"
        p.write_text(json.dumps(rows, indent=1))
    elif storage in ("csv", "tsv"):
        p = tmp / f"{name}.{storage}"
        with open(p, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, delimiter="," if storage == "csv" else "\t")
            w.writerow(cols)
            for r in rows:
                w.writerow([v if isinstance(v, str) else json.dumps(v) for v in (r.get(c, "") for c in cols)])
    elif storage == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table), p, row_group_size=2)  # several record batches
    elif storage == "folder":
        import datasets

        p = tmp / f"{name}_folder"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(table),
                              "test": datasets.Dataset.from_list(table[:1])}).save_to_disk(str(p))
    else:
        return _fake_hub_dataset(table, tmp, monkeypatch, name)
    return str(p)


def _fake_hub_dataset(rows, tmp: Path, monkeypatch, name: str) -> str:
    """`acme/<name>` prepared in a temporary `datasets` cache, as `load_dataset` leaves a hub
    dataset (<cache>/acme___<name>/default/0.0.0/<hash>), with datasets in offline mode."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = tmp / f"{name}_src.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    cache = tmp / "hf_datasets_cache"
    Parquet(cache_dir=str(cache), dataset_name=name, hash="0",
            data_files=DataFilesDict.from_patterns({"train": [str(src)]})).download_and_prepare()
    (cache / f"acme___{name}").mkdir()
    next((cache / name).glob("default-*")).rename(cache / f"acme___{name}" / "default")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return f"acme/{name}"


ROWS = [{"text": "hello, world", "n": "1"},
        {"text": "line one\nline two \"quoted\"", "n": "2"},
        {"text": "tab\there; ünïcödé", "n": "3"},
        {"text": "four", "n": "4"},
        {"text": "five", "n": "5"}]
NAMES = {  # storage -> the name of row 3 (the header and a two-line cell before it in CSV/TSV)
    "jsonl": "d.jsonl, line 3", "json": "d.json, row 3 (line 10)", "csv": "d.csv, row 3 (line 5)",
    "tsv": "d.tsv, row 3 (line 5)", "parquet": "d.parquet, row 3", "folder": "d_folder, split train, row 3",
    "hub": "acme/d, split train, row 3"}


@pytest.mark.parametrize("storage", STORAGES)
def test_every_storage_reads_the_same_rows_named_by_row(storage, tmp_path, monkeypatch):
    src = write_rows(storage, ROWS, tmp_path, monkeypatch)
    kind = S.source_kind(src)
    assert kind == {"folder": "dataset_folder"}.get(storage, storage)
    got = list(S.read_rows(src))
    assert [r for _, r in got] == ROWS
    where = got[2][0]
    assert where.endswith(NAMES[storage]) and where.startswith(src if storage == "hub" else str(tmp_path)), where


def test_json_named_json_with_one_object_per_line_is_jsonl(tmp_path):
    p = tmp_path / "lines.json"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert S.source_kind(p) == "jsonl" and [r for _, r in S.read_rows(p)] == ROWS
    q = tmp_path / "noext"
    q.write_text("\n  " + json.dumps(ROWS))  # an array, whatever the name
    assert S.source_kind(q) == "json" and [r for _, r in S.read_rows(q)] == ROWS


def test_folder_split_and_single_dataset(tmp_path):
    import datasets

    src = write_rows("folder", ROWS, tmp_path)
    assert [r for _, r in S.read_rows(src, split="test")] == ROWS[:1]
    with pytest.raises(DataError, match=r"d_folder: no split 'dev' \(splits: train, test\).*--data-split"):
        list(S.read_rows(src, split="dev"))
    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    got = list(S.read_rows(one))
    assert [r for _, r in got] == ROWS and got[4][0] == f"{one}, row 5"


def test_nulls_in_columnar_sources_are_absent_keys(tmp_path):
    rows = [{"text": "a"}, {"prompt": "p", "completion": "c"}]
    for storage in ("parquet", "folder"):
        assert [r for _, r in S.read_rows(write_rows(storage, rows, tmp_path / storage))] == rows


def test_hub_id_not_in_the_cache_names_the_download_command(tmp_path, monkeypatch):
    write_rows("hub", ROWS, tmp_path, monkeypatch)  # a cache with acme/d only, offline
    with pytest.raises(DataError) as e:
        S.read_rows("acme/other")
        list(S.read_rows("acme/other"))
    msg = str(e.value)
    assert msg.startswith("acme/other: no such data file or folder, and not a dataset in the local") \
        and "datasets.load_dataset('acme/other')" in msg and "\n" not in msg, msg
    with pytest.raises(DataError, match="missing.jsonl: no such data file"):
        S.read_rows(tmp_path / "missing.jsonl")  # a path with a data suffix is never a hub id


# ------------------------------------------------------------------------------ malformed input
def _bad(tmp: Path, name: str, content: bytes | str) -> Path:
    p = tmp / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


@pytest.mark.parametrize("name, content, needle", [
    ("a.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": \n', "a.jsonl, line 3: invalid JSON"),
    ("a.jsonl", '{"text": "a"}\n\n{"text": "b"}\n', "a.jsonl, line 2: empty line"),
    ("a.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', "a.jsonl, line 2: not valid UTF-8"),
    ("a.jsonl", '{"text": "a"}\n[1]\n', "a.jsonl, line 2: expected a JSON object, got list"),
    ("a.json", '[{"text": "a"},\n{"text": "b"},\n {"text": }\n]', "a.json, row 3 (line 3): invalid JSON"),
    ("a.json", '[{"text": "a"},\n "b"]', "a.json, row 2 (line 2): expected a JSON object, got str"),
    ("a.json", '[{"text": "a"} {"text": "b"}]', "a.json, line 1: expected ',' or ']' after row 1"),
    ("a.json", '[{"text": "a"},\n{"text": "b"}', "a.json: the file ends inside the array"),
    ("a.json", b'[{"text": "a"},\n{"text": "\xc3("}]', "a.json, line 2: not valid UTF-8"),
    ("a.csv", 'text,n\na,1\nb,2,3\n', "a.csv, row 2 (line 3): 3 fields, the header has 2"),
    ("a.csv", 'text,n\n"a\nb",1\nc\n', "a.csv, row 2 (line 4): 1 fields, the header has 2"),
    ("a.csv", b'text,n\na,1\nb,2\n\xff,3\n', "a.csv, row 3 (line 4): not valid UTF-8"),
    ("a.csv", 'text,text\na,b\n', "a.csv, line 1: the header row needs distinct"),
    ("a.tsv", 'text\tn\na\t1\nb\n', "a.tsv, row 2 (line 3): 1 fields, the header has 2"),
    ("a.parquet", b"PAR1 not really parquet", "a.parquet: not a readable Parquet file"),
    ("a.jsonl", "", "a.jsonl: no examples"),
    ("a.json", " [ ] ", "a.json: no examples"),
    ("a.csv", "text,n\n", "a.csv: no examples"),
    ("a.parquet", b"", "a.parquet: not a readable Parquet file"),
])
def test_malformed_input_is_named_by_file_and_row(tmp_path, name, content, needle):
    p = _bad(tmp_path, name, content)
    with pytest.raises(DataError) as e:
        list(S.read_rows(p))
    msg = str(e.value)
    assert msg.startswith(str(tmp_path)) and needle in msg and "\n" not in msg, msg


def test_empty_parquet_and_plain_folder_are_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="e.parquet: no examples"):
        list(S.read_rows(tmp_path / "e.parquet"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="plain: a folder, but not a `datasets` save_to_disk folder"):
        list(S.read_rows(tmp_path / "plain"))


def test_missing_optional_package_says_how_to_install(tmp_path, monkeypatch):
    import importlib

    real = importlib.import_module

    def no_pyarrow(name, *a):
        if name.split(".")[0] == "pyarrow":
            raise ImportError(name)
        return real(name, *a)

    p = write_rows("parquet", ROWS, tmp_path)
    monkeypatch.setattr(importlib, "import_module", no_pyarrow)
    with pytest.raises(DataError, match=r"d.parquet: reading Parquet needs the 'pyarrow' package: "
                                        r"pip install 'jqlora\[data\]'"):
        list(S.read_rows(p))


# ----------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("storage", ["jsonl", "json", "csv"])
def test_rows_before_a_bad_one_are_read_first(storage, tmp_path):
    """Lazy: the first rows come out before the reader has seen the broken end of the file."""
    rows = [{"text": f"row {i}"} for i in range(2000)]
    src = Path(write_rows(storage, rows, tmp_path))
    if storage == "json":  # the array's last item broken
        src.write_text(src.read_text().rstrip().removesuffix("]") + ',\n{"text": }]')
    else:
        with open(src, "ab") as f:
            f.write(b'{"text": \n' if storage == "jsonl" else b"a,b,c\n")
    it = S.read_rows(src)
    assert [next(it)[1] for _ in range(3)] == rows[:3]
    with pytest.raises(DataError, match="line 2001|row 2001"):
        list(it)


@pytest.mark.parametrize("storage", ["jsonl", "csv", "json"])
def test_a_file_larger_than_the_readers_memory_streams_through(storage, tmp_path, monkeypatch):
    """Python's allocations while every row passes through stay far below the file's size (a
    JSON array's buffer refilled 64 KiB at a time here)."""
    monkeypatch.setattr(S, "CHUNK_BYTES", 1 << 16)
    mib, bound_mib = 2, 0.5
    row = {"text": "x" * 90}
    src = Path(write_rows(storage, [row] * (mib * (1 << 20) // 100), tmp_path))
    assert src.stat().st_size > mib * 0.9 * (1 << 20)
    tracemalloc.start()
    try:
        n = sum(1 for _ in S.read_rows(src))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == mib * (1 << 20) // 100 and peak < bound_mib * (1 << 20), (n, peak)
