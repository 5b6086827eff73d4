"""The import structure of the three packages: no import circles, and imports only point down.

The graph is read from the source with `ast`, every import statement counted wherever it stands
(inside functions too, since a lazy import is still a dependency), and the names a package hands
out lazily (a PEP 562 ``_LAZY`` table in its ``__init__``) resolved to the submodule that defines
them. Inside ``jqlora`` each top-level module or subpackage sits on one layer of :data:`LAYERS`
and may import only from its own layer or lower ones; ``interop`` may import ``jqlora.quant`` (the
weight types it produces) and ``jqlora.errors`` (the error base) and nothing else of jqlora;
``pallas_kernels`` imports nothing of ours. Each check is shown to fail on a planted import.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jqlora", "interop", "pallas_kernels")

# jqlora's layers, lowest first: a unit (the first name under jqlora) imports only units of its own
# layer or a lower one. `jqlora.cli` is above everything, and nothing in the library imports it.
LAYERS = (
    ("errors", "_util", "hub"),
    ("quant",),
    ("ops",),
    ("lora",),
    ("parallel", "compile_cache", "lowered_cache", "tokenizer"),
    ("models",),
    ("train", "adapters"),
    ("runs", "merge", "gguf_export", "crosscheck"),
    ("demo",),
    ("cli",),
)
INTEROP_MAY_IMPORT = ("jqlora.quant", "jqlora.errors")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages (a package is its
    ``__init__``)."""
    out = {}
    for pkg in LIBRARY:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _lazy_table(source: str) -> dict[str, str]:
    """A package ``__init__``'s ``_LAZY = {name: submodule}`` (names it imports on first use)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            try:
                return dict(ast.literal_eval(node.value))
            except ValueError:
                return {}
    return {}


def _reexports(source: str, package: str) -> dict[str, str]:
    """Names a package ``__init__`` imports from one of its own submodules: name -> submodule."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if mod.startswith(package + "."):
                for a in node.names:
                    out[a.asname or a.name] = mod
    return out


def imports_of(source: str, module: str, modules, is_package: bool = False, packages=None) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``source`` (the text of ``module``) that names
    one of ``modules``. ``from P import N`` is P.N when that is a module, else the submodule that
    package P hands N out from (its ``_LAZY`` table or an import in its ``__init__``), else P."""
    packages = packages or {}
    pkg_parts = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg_parts[: len(pkg_parts) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = []
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in modules:
                    targets.append(sub)
                elif a.name in packages.get(mod, {}):
                    targets.append(packages[mod][a.name])
                else:
                    targets.append(mod)
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c.name`-like forms: the longest module
                t = t.rpartition(".")[0]
            if t and t != module:
                found.append((node.lineno, t))
    return found


def import_graph(sources: dict[str, str], package_names: set[str]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, over ``sources`` (module -> text)."""
    modules = set(sources)
    packages = {}
    for p in package_names:
        table = {**_reexports(sources[p], p), **{k: f"{p}.{v}" for k, v in _lazy_table(sources[p]).items()}}
        packages[p] = {k: v for k, v in table.items() if v in modules}
    graph = {}
    for m, text in sources.items():
        edges = {}
        for line, t in imports_of(text, m, modules, m in package_names, packages):
            edges.setdefault(t, line)
        graph[m] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "jqlora" and len(parts) > 1 else None


def layer_violations(graph: dict[str, dict[str, int]], files: dict[str, Path] | None = None) -> list[str]:
    """`file:line: importer -> imported (why)` for each import that points up or out of bounds."""
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad = []
    for m, edges in graph.items():
        where = str(files[m].relative_to(ROOT)) if files and m in files else m
        for t, line in edges.items():
            if m.startswith("pallas_kernels") and not t.startswith("pallas_kernels"):
                bad.append(f"{where}:{line}: {m} -> {t} (pallas_kernels imports nothing of ours)")
            elif m.startswith("interop") and t.startswith("jqlora") and not t.startswith(INTEROP_MAY_IMPORT):
                bad.append(f"{where}:{line}: {m} -> {t} (interop may import only {', '.join(INTEROP_MAY_IMPORT)})")
            elif (a := _unit(m)) and (b := _unit(t)):
                if a not in rank or b not in rank:
                    bad.append(f"{where}:{line}: {m} -> {t} (unit not in LAYERS: add it to its layer)")
                elif rank[b] > rank[a]:
                    bad.append(f"{where}:{line}: {m} -> {t} (layer {rank[a]} imports layer {rank[b]})")
    return bad


def _tree_graph():
    files = module_files()
    sources = {m: p.read_text() for m, p in files.items()}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    return files, sources, packages, import_graph(sources, packages)


def test_no_import_circles():
    files, _, _, graph = _tree_graph()
    assert len(graph) > 60 and "jqlora.train.loop" in graph
    assert "jqlora.train.lock" in graph["jqlora.train.loop"], "the graph misses lazy imports inside functions"
    assert not (cycles := find_cycles(graph)), f"import circles: {cycles}"


def test_imports_point_down():
    files, _, _, graph = _tree_graph()
    units = {_unit(m) for m in graph if _unit(m)}
    assert not (missing := units - {u for layer in LAYERS for u in layer}), f"not in LAYERS: {missing}"
    assert not (bad := layer_violations(graph, files)), "imports against the layers:\n" + "\n".join(bad)


def test_library_does_not_import_the_cli():
    _, _, _, graph = _tree_graph()
    bad = [f"{m} -> {t}" for m, e in graph.items() for t in e
           if t.startswith("jqlora.cli") and not m.startswith("jqlora.cli")]
    assert not bad, f"library modules import jqlora.cli: {bad}"


def _planted(extra: dict[str, str]):
    """The real tree's graph with some modules' source text extended by ``extra``."""
    files, sources, packages, _ = _tree_graph()
    sources = {m: s + "\n" + extra.get(m, "") for m, s in sources.items()}
    return files, import_graph(sources, packages)


def test_planted_circle_is_found():
    """The circle check can fail: a lazy import of the loop from the lowest layer closes a circle."""
    _, graph = _planted({"jqlora.train.lock": "def f():\n    from jqlora.train import train\n"})
    cycles = find_cycles(graph)
    assert any({"jqlora.train.lock", "jqlora.train.loop"} <= set(c) for c in cycles), cycles
    # a name handed out through the package's lazy table resolves to its submodule
    assert "jqlora.train.loop" in graph["jqlora.train.lock"]


def test_planted_upward_imports_are_found():
    _, graph = _planted({
        "jqlora.ops.qmatmul": "def f():\n    from jqlora import parallel\n",
        "interop.bnb_load": "from jqlora.models import config\n",
        "pallas_kernels.registry": "import jqlora.quant\n",
        "jqlora.quant.tables": "from ..lora import linear\n",
    })
    bad = "\n".join(layer_violations(graph))
    for needle in ("jqlora.ops.qmatmul -> jqlora.parallel", "interop.bnb_load -> jqlora.models.config",
                   "pallas_kernels.registry -> jqlora.quant", "jqlora.quant.tables -> jqlora.lora.linear"):
        assert needle in bad, needle


def test_import_reader_finds_every_form():
    """Each way of writing an import is read (and lookalikes are not)."""
    modules = {"jqlora.cli", "jqlora.cli._common", "jqlora.demo.pipeline", "jqlora.crosscheck", "jqlora"}
    mod = "jqlora.demo.pipeline"
    for src in ("import jqlora.cli", "import jqlora.cli._common as c", "from jqlora.cli import main",
                "from jqlora.cli._common import CLIError", "from jqlora import cli",
                "from .. import cli", "from ..cli._common import export", "def f():\n    from jqlora.cli import x\n"):
        assert any(t.startswith("jqlora.cli") for _, t in imports_of(src, mod, modules)), src
    for src in ("import jqlora.client", "from jqlora import crosscheck", "from . import cli", "import cli"):
        assert not any(t.startswith("jqlora.cli") for _, t in imports_of(src, mod, modules)), src
