"""The modules of ``integrations/`` import one another without a cycle, checked on every file's imports.

Read from the source: every ``import`` statement, those inside functions included, relative ones resolved. A lazy
import inside a function closes a cycle as surely as one at the top: the two modules still cannot be read, or
changed, one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file of ``package`` imports, relative imports made absolute; a name imported from a module is
    listed too, as it may be a submodule."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """Per module of ``folder`` (the package ``package``, no subpackages), the other modules of it that it imports."""
    modules = {f"{package}.{path.stem}": path for path in folder.glob("*.py") if path.stem != "__init__"}
    return {name: {other for other in imported_modules(path, package) if other in modules and other != name}
            for name, path in modules.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph``, as the modules along it back to the first, or [] where there is none."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return []
        for imported in sorted(graph[module]):
            if found := walk(imported, [*path, module]):
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        if found := walk(module, []):
            return found
    return []


@pytest.mark.unit
def test_no_integration_module_imports_one_that_imports_it_back():
    cycle = cycle_in(import_graph(ROOT / "integrations", "hbmd.integrations"))
    assert cycle == [], f"integrations/ imports round: {' -> '.join(cycle)}"


@pytest.mark.unit
def test_the_check_sees_a_cycle_closed_by_an_import_inside_a_function(tmp_path):
    (tmp_path / "plugin.py").write_text("from .keeper import keep\n")
    (tmp_path / "keeper.py").write_text("def keep():\n    from . import plugin\n")
    (tmp_path / "index.py").write_text("import hbmd.pkg.keeper\n")
    assert cycle_in(import_graph(tmp_path, "hbmd.pkg")) == ["hbmd.pkg.keeper", "hbmd.pkg.plugin", "hbmd.pkg.keeper"]
