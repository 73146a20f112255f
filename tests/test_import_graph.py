"""The import structure of the library: no cycles, not even hidden in function-local imports, and
``meta`` never imports the applications next to it (``gram_world``, ``gram_tools``).

The static pass reads every module's ``import`` statements with ``ast`` (``if TYPE_CHECKING:`` blocks
left out), resolves relative imports, and adds an edge to each package a dotted import runs
(``import meta.a.b`` runs ``meta/a/__init__.py`` first).  Importing each module of ``meta`` in a process that
has imported no module of ``meta`` (slow tier) catches what a static pass cannot: a module that fails on its own.
A module whose imports reach torch, open_clip or learn2learn is imported in a child forked from an interpreter
that imported those third-party modules first, in the order the module's own import statements reach them
(:func:`third_party_prefix`); the others, in a fresh interpreter each.
"""

from __future__ import annotations

import ast
import json
import os
import select
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


# ------------------------------------------------------------------ each module alone
HEAVY = ("torch", "torchvision", "open_clip", "learn2learn")  # seconds to import each; the rest, milliseconds


def third_party_prefix(module: str, known: dict) -> tuple:
    """The third-party modules that ``import module`` reaches through module-level import statements, in the
    order a fresh interpreter runs those statements (packages before their submodules, statements in source
    order, each ``meta`` module once), cut after the last one of :data:`HEAVY`; ``()`` when none is reached."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    seen: set = set()
    order: list = []

    def visit(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in seen or mod not in known:
                continue
            seen.add(mod)
            path, is_package = known[mod]
            statements: list = []
            _imports(ast.parse(path.read_text(), filename=str(path)).body, True, statements)
            for node, module_level in statements:
                if not module_level:
                    continue
                for target in _targets(mod, is_package, node, known):
                    top = target.split(".")[0]
                    if top == LIBRARY:
                        visit(target)
                    elif top not in stdlib and target not in order:
                        order.append(target)

    visit(module)
    heavy = [i for i, name in enumerate(order) if name.split(".")[0] in HEAVY]
    return tuple(order[: heavy[-1] + 1]) if heavy else ()


# A preloaded interpreter: imports the modules of argv[1] (JSON list; ImportError left to the module's own
# import), prints "ready", then per stdin line [module, log file] forks a child that checks that no module of
# meta is loaded yet and imports the module, its stdout and stderr in the log file; answers the exit status.
_FORK_SERVER = """
import importlib, json, os, sys, traceback
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
print("ready", flush=True)
for line in sys.stdin:
    module, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            early = sorted(m for m in sys.modules if m == "meta" or m.startswith("meta."))
            assert not early, f"imported before {module}: {early}"
            importlib.import_module(module)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
os._exit(0)  # stdin closed: nothing to finalise (torch's shutdown alone takes seconds)
"""


@pytest.fixture(scope="session")
def import_alone(tmp_path_factory):
    """``import_alone(module) -> (exit status, output)``: ``import module`` in a process that has imported no
    module of ``meta``.

    With :func:`third_party_prefix` ``()``, a fresh ``python -c "import module"``; otherwise a child forked from
    a server that imported that prefix (one server per prefix, shared by the modules that reach the same
    third-party modules first: 17 CHC modules import torch, open_clip and learn2learn once instead of 17 times).
    A server that does not start leaves its modules to the fresh interpreter."""
    known = _modules(LIBRARY)
    logs = tmp_path_factory.mktemp("import_alone")
    servers: dict = {}

    def fresh(module: str) -> tuple:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        return proc.returncode, proc.stderr

    def output(log) -> str:
        return log.read_text(errors="replace") if log.is_file() else f"no output ({log} not written)"

    def run(module: str, prefix: tuple | None = None) -> tuple:
        prefix = third_party_prefix(module, known) if prefix is None else prefix
        if not prefix:
            return fresh(module)
        if prefix not in servers:
            server = subprocess.Popen(
                [sys.executable, "-c", _FORK_SERVER, json.dumps(prefix)],
                cwd=REPO,
                # torch's start-up hook imports meta.infra.numerics / .products (the pinned products); the
                # preloaded server must hold no meta module, so it starts torch without the hook
                env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            servers[prefix] = server if server.stdout.readline().strip() == "ready" else None
        server = servers[prefix]
        if server is None:
            return fresh(module)
        log = logs / f"{module}.log"
        server.stdin.write(json.dumps([module, str(log)]) + "\n")
        server.stdin.flush()
        if not select.select([server.stdout], [], [], 300)[0]:  # the fresh interpreter's timeout
            server.kill()
            servers[prefix] = None
            return -9, f"import {module}: no answer in 300 s\n" + output(log)
        return int(server.stdout.readline()), output(log)

    yield run
    for server in servers.values():
        if server is not None:
            server.stdin.close()
            server.wait(timeout=60)


def test_third_party_prefix_follows_the_import_statements():
    known = _modules(LIBRARY)
    assert third_party_prefix("meta.infra.hashing", known) == ()  # the standard library only
    assert third_party_prefix("meta.method.regulator", known) == ("torch",)
    prefix = third_party_prefix("meta.metatrain.cli", known)  # meta/__init__, meta.metatrain, then meta.config
    assert prefix[:3] == ("yaml", "yacs.config", "torch") and {"learn2learn", "open_clip"} <= set(prefix)
    assert prefix.index("torch") < prefix.index("open_clip")  # open_clip imports torch: it comes after it


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(m for m in _modules(LIBRARY) if not m.endswith("__main__")))
def test_every_library_module_imports_alone(module, import_alone):
    code, output = import_alone(module)
    assert code == 0, output[-2000:]


@pytest.mark.slow
def test_the_forked_import_reports_a_failure(import_alone):
    """A module that fails to import fails in the forked child too, with its traceback."""
    code, output = import_alone("meta.no_such_module", prefix=("torch",))
    assert code == 1 and "ModuleNotFoundError: No module named 'meta.no_such_module'" in output
