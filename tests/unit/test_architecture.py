"""The import graph stays a tree of layers: no two modules of the project import each
other, directly or through others (imports inside functions count: hiding one there does
not remove the cycle). `make lint` checks the layer contracts of pyproject.toml
(`lint-imports`); this checks the whole graph for cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("teamdesk", "ledger", "tasks", "dispatcher", "worker", "api", "cli")


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert len(graph.modules) > 50  # the whole project was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    assert cycles(graph) == [["a", "b", "c"]]


def _imports_inside_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    found.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    return found


def test_imports_inside_functions_only_in_the_command_line() -> None:
    """A function-local import hides an edge of the graph from the reader; only the front
    door may defer its heavy imports, for the reason cli/commands/__init__.py gives."""
    found = [
        where
        for package in PACKAGES
        if package != "cli"
        for path in sorted((ROOT / package).rglob("*.py"))
        for where in _imports_inside_functions(path)
    ]
    assert found == []
    assert _imports_inside_functions(ROOT / "cli" / "main.py")  # the check reads bodies
