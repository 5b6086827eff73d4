"""One reader per JSON file format, read from the source with `ast`: every ``json.load``/``json.loads``
call (or ``json.JSONDecoder``) in the library, and every call of `interop.json_io.read_json_object` (the helper that reads a JSON
object from a file or raises a named error), stands in a function of :data:`JSON_PARSERS` or
:data:`FILE_READERS`. A second reader of ``config.json``, ``state.json``, ``tokenizer_config.json``
or ``adapter_config.json`` written beside the one that exists fails here. Each check is shown to
fail on a planted second reader.

`tests/cli/test_reads_once.py` checks the same at run time: which function opens each file during
a ``jqlora train`` run, and how often.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jqlora", "interop", "pallas_kernels")

# (file, function) -> what it parses with json.load(s): each one the only parser of its format.
JSON_PARSERS = {
    ("interop/json_io.py", "read_json_object"): "a JSON object in a file (the helper below)",
    ("interop/safetensors_io.py", "_parse_header"): "a safetensors file's header",
    ("interop/bnb_load.py", "_parse_quant_state"): "a bitsandbytes quant_state tensor's bytes",
    ("jqlora/train/sources.py", "_jsonl_rows"): "a JSONL data file's lines",
    ("jqlora/train/sources.py", "_json_array_rows"): "a JSON array data file's items (json.JSONDecoder)",
    ("jqlora/train/sources.py", "json_cell"): "a data cell holding JSON (a conversation in a CSV/Parquet column)",
    ("jqlora/runs/config_file.py", "load_config_file"): "a run's config file (JSON or TOML)",
    ("jqlora/models/cache.py", "_register_export_serialization"): "a KVCache's static fields inside a stored jax.export program",
}
# (file, function) -> the file it reads through read_json_object: the one reader of that file.
FILE_READERS = {
    ("interop/bnb_common.py", "read_config"): "config.json",
    ("interop/peft_adapter.py", "_read_config"): "adapter_config.json",
    ("interop/safetensors_io.py", "open_checkpoint"): "model.safetensors.index.json",
    ("jqlora/tokenizer.py", "_read_json"): "tokenizer_config.json (read_tokenizer_config), generation_config.json",
    ("jqlora/train/checkpoint.py", "read_state"): "a training checkpoint's state.json",
}


def calls(sources: dict[str, str], match) -> dict[tuple[str, str], list[int]]:
    """(file, innermost enclosing function) -> lines, for every call in `sources` (file -> text)
    whose function node satisfies `match`."""
    out: dict[tuple[str, str], list[int]] = {}
    for file, text in sources.items():
        stack: list[str] = []

        class Visitor(ast.NodeVisitor):
            def visit_FunctionDef(self, node):
                stack.append(node.name)
                self.generic_visit(node)
                stack.pop()

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_Call(self, node):
                if match(node.func):
                    out.setdefault((file, stack[-1] if stack else "<module>"), []).append(node.lineno)
                self.generic_visit(node)

        Visitor().visit(ast.parse(text))
    return out


def is_json_parse(func) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr in ("load", "loads", "JSONDecoder")
            and isinstance(func.value, ast.Name) and func.value.id == "json")


def is_read_json_object(func) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "read_json_object"


def library_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in LIBRARY for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_json_is_parsed_only_by_the_known_parsers():
    found = calls(library_sources(), is_json_parse)
    extra = {k: v for k, v in found.items() if k not in JSON_PARSERS}
    assert not extra, f"json.load(s) outside the one parser of each format (use interop.json_io): {extra}"
    assert set(found) == set(JSON_PARSERS), f"a listed parser no longer parses JSON: {set(JSON_PARSERS) - set(found)}"


def test_json_files_are_read_only_by_their_one_reader():
    found = calls(library_sources(), is_read_json_object)
    extra = {k: v for k, v in found.items() if k not in FILE_READERS}
    assert not extra, f"a second reader of a JSON file (call its one reader instead): {extra}"
    assert set(found) == set(FILE_READERS), f"a listed reader no longer reads: {set(FILE_READERS) - set(found)}"
    assert all(len(lines) == 1 for lines in found.values()), found


def test_planted_second_readers_are_found():
    """Both checks fail on a second reader: config.json parsed again in train/data.py, and
    state.json read again through the helper in the training loop."""
    sources = library_sources()
    planted = dict(sources)
    planted["jqlora/train/data.py"] += (
        "\n\ndef _vocab(d):\n    import json\n    return json.loads((d / 'config.json').read_text())['vocab_size']\n")
    planted["jqlora/train/loop.py"] += (
        "\n\ndef _skips(c):\n    from interop.json_io import read_json_object\n"
        "    return read_json_object(c / STATE_FILE, ValueError)['extra']\n")
    parsers = calls(planted, is_json_parse)
    assert ("jqlora/train/data.py", "_vocab") in set(parsers) - set(JSON_PARSERS)
    readers = calls(planted, is_read_json_object)
    assert ("jqlora/train/loop.py", "_skips") in set(readers) - set(FILE_READERS)
