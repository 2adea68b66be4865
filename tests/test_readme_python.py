"""The README's Python API example runs exactly as written, and what it depends on is what the install gives."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import io
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "splitspec"


def test_the_readme_python_example_runs_as_written() -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- python-api-example[^\n]*\n```python\n(.*?)```", text, re.S)
    assert block is not None, "the README lost its python-api-example block"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block[1], "README.md", "exec"), {"__name__": "__main__"})
    *reply, summary = printed.getvalue().rstrip("\n").split("\n")
    assert "\n".join(reply).strip()  # the decoded generation
    figures = ast.literal_eval(summary)  # the printed summary dict
    assert figures["new_tokens"] == 24
    assert figures["steps"] >= 1


def test_every_third_party_import_is_a_core_dependency() -> None:
    """`pip install splitspec` alone must run every command: no module imports an extra's package,
    except the ``cluster`` extra's (Ray), and that only inside the functions that need it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {Requirement(r).name.lower().replace("_", "-") for r in requirements}

    declared = names(project["dependencies"])
    lazy_only = names(project["optional-dependencies"]["cluster"])
    distributions = importlib.metadata.packages_distributions()
    imported: dict[str, Path] = {}
    at_module_level: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names_ = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names_ = [node.module]
            for name in names_:
                top = name.split(".")[0]
                if top != "splitspec" and top not in sys.stdlib_module_names:
                    imported.setdefault(top, path)
                    if node in tree.body:
                        at_module_level.setdefault(top, path)

    def providers(top: str) -> set[str]:
        return {d.lower().replace("_", "-") for d in distributions.get(top, [top])}

    missing = {
        top: str(path.relative_to(REPO))
        for top, path in imported.items()
        if not providers(top) & declared and not (providers(top) & lazy_only and top not in at_module_level)
    }
    assert not missing, f"imported but not in [project] dependencies (nor lazily, from the cluster extra): {missing}"
