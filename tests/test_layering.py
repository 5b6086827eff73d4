"""The library does not import the CLI: `jqlora.cli` sits on top of everything and nothing below it
reaches up (an import of it from the library would make `jqlora.cli` a dependency of the library
and its command modules a place for library code)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jqlora", "interop", "pallas_kernels")


def cli_imports(source: str, module: str) -> list[str]:
    """`line: name` for each import of jqlora.cli (absolute, or relative from inside jqlora) in `source`,
    the text of the module named `module` (dotted)."""
    found = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        hits = [n for n in names if n == "jqlora.cli" or n.startswith("jqlora.cli.")]
        if hits:
            found.append(f"{node.lineno}: {hits[0]}")
    return found


def library_modules():
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("jqlora", "cli"):
                continue
            yield path, ".".join(rel.with_suffix("").parts)


def test_library_does_not_import_the_cli():
    modules = list(library_modules())
    assert len(modules) > 30 and any(m == "jqlora.runs" for _, m in modules)
    bad = {str(p.relative_to(ROOT)): hits for p, m in modules if (hits := cli_imports(p.read_text(), m))}
    assert not bad, f"library modules import jqlora.cli: {bad}"


def test_cli_import_detector_finds_every_form():
    """The check above can fail: each way of writing the import is caught (and lookalikes are not)."""
    mod = "jqlora.demo.pipeline"
    for src in ("import jqlora.cli", "import jqlora.cli._common as c", "from jqlora.cli import main",
                "from jqlora.cli._common import CLIError", "from jqlora import cli",
                "from .. import cli", "from ..cli.peft_cmd import export", "def f():\n    from jqlora.cli import x\n"):
        assert cli_imports(src, mod), src
    for src in ("import jqlora.client", "from jqlora import crosscheck", "from . import cli", "import cli"):
        assert not cli_imports(src, mod), src
