"""The import structure of the library: no cycles, not even hidden in function-local imports, and
``meta`` never imports the applications next to it (``gram_world``, ``gram_tools``).

The static pass reads every module's ``import`` statements with ``ast`` (``if TYPE_CHECKING:`` blocks
left out), resolves relative imports, and adds an edge to each package a dotted import runs
(``import meta.a.b`` runs ``meta/a/__init__.py`` first).  Importing a module of ``meta`` in a fresh
interpreter each (slow tier) catches what a static pass cannot: a module that fails on its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = "meta"
APPLICATIONS = ("gram_world", "gram_tools")


def _modules(package: str) -> dict:
    """``{dotted name: (file, is package)}`` for every ``.py`` file under ``package``."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list, module_level: bool, out: list) -> None:
    """``(node, module_level)`` for every import statement in ``body``; function bodies are local."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, module_level))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            continue
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _imports(node.body, False, out)
        else:
            for name in ("body", "orelse", "finalbody", "handlers"):
                _imports(getattr(node, name, None) or [], module_level, out)


def _targets(module: str, is_package: bool, node: ast.stmt, known: dict) -> list:
    """Dotted names an import statement runs (the module, and ``from X import sub`` submodules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [name] + [f"{name}.{alias.name}" for alias in node.names if f"{name}.{alias.name}" in known]


def import_graph(packages: tuple, include_local: bool) -> dict:
    """``{module: {imported module of the same packages}}``; ``include_local`` adds function-local imports."""
    known = {}
    for package in packages:
        known.update(_modules(package))
    graph = {}
    for module, (path, is_package) in known.items():
        statements: list = []
        _imports(ast.parse(path.read_text(), filename=str(path)).body, True, statements)
        parts = module.split(".")
        own_packages = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # already being imported
        edges = set()
        for node, module_level in statements:
            if not (module_level or include_local):
                continue
            for target in _targets(module, is_package, node, known):
                pieces = target.split(".")
                for i in range(1, len(pieces) + 1):
                    prefix = ".".join(pieces[:i])
                    if prefix in known and prefix not in own_packages:
                        edges.add(prefix)
        graph[module] = edges
    return graph


def find_cycle(graph: dict) -> list:
    """One cycle as ``[a, b, ..., a]``, or ``[]`` when the graph is acyclic (iterative DFS)."""
    state = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for root in sorted(graph):
        if state[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif state.get(child) == 0:
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return []


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_static_pass_sees_package_and_relative_edges():
    graph = import_graph((LIBRARY,), include_local=True)
    # `from .checkpoint import ...` in meta/metatrain/trainer.py and the package a dotted import runs
    assert "meta.metatrain.checkpoint" in graph["meta.metatrain.trainer"]
    assert "meta.chc" in graph["meta.metatrain.data"]
    assert len(graph) > 50


@pytest.mark.parametrize("include_local", [False, True], ids=["module_level", "with_function_local"])
def test_import_graph_is_acyclic(include_local):
    """The library and the applications; with function-local imports included too, no local import exists
    to hide a cycle."""
    cycle = find_cycle(import_graph((LIBRARY,) + APPLICATIONS, include_local))
    assert not cycle, " -> ".join(cycle)


def test_library_does_not_import_the_applications():
    graph = import_graph((LIBRARY,) + APPLICATIONS, include_local=True)
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == LIBRARY
        for t in targets
        if t.split(".")[0] in APPLICATIONS
    )
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(m for m in _modules(LIBRARY) if not m.endswith("__main__")))
def test_every_library_module_imports_alone(module):
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
