"""Imports run one way: no cycles, and the package-level directions of docs/architecture.md.

The graph is read from the source (every ``import splitspec...`` and ``from splitspec... import``,
function-level ones included, since a lazy import is still a dependency), then every module is
imported on its own in a fresh set of ``splitspec`` modules, so a module that only loads after
another one was imported first fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import splitspec
from tests.forkserver import Run, run_forked

SRC = Path(splitspec.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
NODES = {name: list(ast.walk(ast.parse(path.read_text()))) for name, path in MODULES.items()}  # each parsed once


def _imports(name: str) -> set[str]:
    """The splitspec modules module ``name`` imports (``from pkg import module`` counts as the module)."""
    found = set()
    for node in NODES[name]:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "splitspec"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "splitspec":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _package(module: str) -> str:
    """``splitspec.cloud.server`` -> ``cloud``; top-level modules are their own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "splitspec"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node, or with a self-loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports() -> None:
    """The reader must not miss function-level imports (the CLI wires its subcommands lazily)."""
    assert "splitspec.bench.cli" in GRAPH["splitspec.cli"]
    assert "splitspec.protocol.messages" in GRAPH["splitspec.protocol.fed"]


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_package(module), set()).update(_package(t) for t in targets)
    for name, targets in packages.items():
        targets.discard(name)
    assert _cycles(packages) == []


def test_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("protocol", {"protocol", "exceptions"}),  # sans-I/O and free of everything else of ours
        ("exceptions", {"exceptions"}),
    ],
)
def test_leaf_packages(package: str, allowed: set[str]) -> None:
    for module, targets in GRAPH.items():
        if _package(module) == package:
            assert {_package(t) for t in targets} <= allowed, f"{module} imports {sorted(targets)}"


def test_cloud_and_edge_never_import_each_other() -> None:
    for module, targets in GRAPH.items():
        side = _package(module)
        if side in ("cloud", "edge"):
            other = "edge" if side == "cloud" else "cloud"
            assert not [t for t in targets if _package(t) == other], f"{module} imports the {other}"


def test_nothing_imports_the_command() -> None:
    """``splitspec.cli`` is the entry point; no module imports it (its helpers live in splitspec.arguments)."""
    importers = sorted(m for m, targets in GRAPH.items() if "splitspec.cli" in targets)
    assert importers == []


@pytest.mark.slow  # one interpreter importing every module afresh: seconds on a quiet machine, minutes on a busy one
def test_every_module_imports_on_its_own(tmp_path: Path) -> None:
    """Each module imported first, in a fresh set of splitspec modules (one process for speed, forked from the test
    worker's fork server, tests/forkserver.py: torch, transformers and matplotlib are imported already, as they are
    for every module but the first in one interpreter)."""
    code = "\n".join(
        [
            "import importlib, sys",
            "failed = []",
            f"for name in {sorted(MODULES)!r}:",
            "    for loaded in [m for m in sys.modules if m == 'splitspec' or m.startswith('splitspec.')]:",
            "        del sys.modules[loaded]",
            "    try:",
            "        importlib.import_module(name)",
            "    except Exception as exc:",
            "        failed.append(f'{name}: {type(exc).__name__}: {exc}')",
            "print('\\n'.join(failed))",
        ]
    )
    script = tmp_path / "import_each.py"
    script.write_text(code + "\n")
    (out,) = run_forked([Run([], script=script)], timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == ""


def test_only_the_transport_imports_websockets() -> None:
    """DESIGN: ``transport/`` is the only place that imports websockets (the protocol core stays sans-I/O, and a
    connection's state is read through ``Channel``)."""
    outside = []
    for name in MODULES:
        if name == "splitspec.transport" or name.startswith("splitspec.transport."):
            continue
        for node in NODES[name]:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "websockets" or n.startswith("websockets.") for n in names):
                outside.append(name)
    assert outside == []
