"""interop.atomic_io: temp name, fsync, rename; nothing half-written, no temp litter."""
from __future__ import annotations

import json
import os

import pytest

import interop.atomic_io as aio
from interop.atomic_io import (atomic_directory, atomic_path, fsync_dir, write_bytes_atomic,
                               write_json_atomic, write_text_atomic)


class Boom(Exception):
    pass


def test_write_bytes_and_text(tmp_path):
    p = tmp_path / "a.bin"
    assert write_bytes_atomic(p, b"one") == p
    assert p.read_bytes() == b"one"
    write_bytes_atomic(str(p), b"two")  # replaces, str paths accepted
    assert p.read_bytes() == b"two"
    t = write_text_atomic(tmp_path / "b.txt", "h\u00e9\n")
    assert t.read_bytes() == "h\u00e9\n".encode()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.txt"]
    fsync_dir(tmp_path)
    fsync_dir(tmp_path / "missing")  # no-op, no error


def test_write_json_creates_parent_sorts_keys_and_stringifies(tmp_path):
    from pathlib import PurePosixPath

    p = tmp_path / "new" / "run.json"
    assert write_json_atomic(p, {"b": 1, "a": [PurePosixPath("/x/y"), None]}) == p
    assert p.read_text() == '{\n  "a": [\n    "/x/y",\n    null\n  ],\n  "b": 1\n}\n'
    with pytest.raises(ValueError, match="Circular"):  # nothing half-written on a failure
        loop = {}
        loop["self"] = loop
        write_json_atomic(p, loop)
    assert json.loads(p.read_text())["b"] == 1 and os.listdir(p.parent) == ["run.json"]


def test_atomic_path_failure_keeps_previous_file(tmp_path, monkeypatch):
    p = tmp_path / "a.bin"
    p.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic_path(p) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".a.bin.tmp-")
            tmp.write_bytes(b"half")
            raise Boom
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]

    def failing_replace(src, dst):
        raise OSError("replace failed (simulated)")

    monkeypatch.setattr(aio.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        write_bytes_atomic(p, b"new")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_atomic_directory_success_creates_parent(tmp_path):
    target = tmp_path / "sub" / "out"
    with atomic_directory(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".out.tmp-")
        assert not target.exists()
        (tmp / "f.txt").write_text("x")
        (tmp / "d").mkdir()
        (tmp / "d" / "g.txt").write_text("y")
    assert (target / "f.txt").read_text() == "x"
    assert (target / "d" / "g.txt").read_text() == "y"
    assert os.listdir(tmp_path / "sub") == ["out"]


def test_atomic_directory_failure_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "f.txt").write_text("half")
            raise Boom
    assert os.listdir(tmp_path) == []


def test_atomic_directory_refuses_existing_without_overwrite(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_directory(target):
            pytest.fail("must not yield")
    # target appearing while the new one is being built: still refused, nothing replaced
    other = tmp_path / "other"
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_directory(other) as tmp:
            (tmp / "new.txt").write_text("new")
            other.mkdir()
            (other / "keep.txt").write_text("theirs")
    assert os.listdir(other) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["other", "out"]
    assert (target / "keep.txt").read_text() == "old"


def test_atomic_directory_overwrite_replaces_whole(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    with atomic_directory(target, overwrite=True) as tmp:
        assert (target / "stale.txt").read_text() == "old"  # old kept until the new one is complete
        (tmp / "new.txt").write_text("new")
    assert os.listdir(target) == ["new.txt"]
    assert os.listdir(tmp_path) == ["out"]
    # overwrite=True with no existing target just creates it
    with atomic_directory(tmp_path / "fresh", overwrite=True) as tmp:
        (tmp / "a").write_text("a")
    assert sorted(os.listdir(tmp_path)) == ["fresh", "out"]


def test_atomic_directory_overwrite_failure_keeps_previous(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(Boom):  # failure while filling
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "keep.txt").write_text("half")
            raise Boom
    assert os.listdir(tmp_path) == ["out"] and (target / "keep.txt").read_text() == "old"

    real_rename = os.rename

    def failing_final_rename(src, dst):  # old moved aside, then the final rename fails
        if os.path.basename(src).startswith(".out.tmp-"):
            raise OSError("rename failed (simulated)")
        return real_rename(src, dst)

    monkeypatch.setattr(aio.os, "rename", failing_final_rename)
    with pytest.raises(OSError, match="simulated"):
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert os.listdir(tmp_path) == ["out"]
    assert os.listdir(target) == ["keep.txt"] and (target / "keep.txt").read_text() == "old"
