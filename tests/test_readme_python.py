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
    """`pip install splitspec` alone must run every command: no module imports an extra's package."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower().replace("_", "-") for r in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    imported: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "splitspec" and top not in sys.stdlib_module_names:
                    imported.setdefault(top, path)
    missing = {
        top: str(path.relative_to(REPO))
        for top, path in imported.items()
        if not {d.lower().replace("_", "-") for d in distributions.get(top, [top])} & declared
    }
    assert not missing, f"imported but not in [project] dependencies: {missing}"
