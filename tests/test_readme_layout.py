"""The layout page (``docs/layout.md``, linked from README) names every module of the installed packages and
every Dassl trainer.

A module added without a line in its table (or a trainer added to the method table without being named there)
fails here, so the map of the code does not fall behind the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from meta.method.methods import load_methods

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "meta",
    "meta/model",
    "meta/method",
    "meta/finetune",
    "meta/data",
    "meta/infra",
    "meta/fingerprint",
    "gram_world",
    "gram_tools",
)


def _layout_section() -> str:
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    match = re.search(r"^\| path \| what \|\n(.*)", text, flags=re.S | re.M)
    assert match, "docs/layout.md has no '| path | what |' table"
    return match.group(1)


def _top_level_names(package: str) -> list[str]:
    """``name.py`` of each top-level module and ``name/`` of each sub-package (private and dunder files aside)."""
    root = ROOT / package
    names = [p.name for p in sorted(root.glob("*.py")) if not p.name.startswith("_")]
    names += [f"{p.name}/" for p in sorted(root.iterdir()) if p.is_dir() and (p / "__init__.py").exists()]
    return names


def _unnamed(row: str, package: str) -> list[str]:
    """Top-level modules of ``package`` that the layout ``row`` does not name (as `name.py` or `name`)."""
    return [
        name
        for name in _top_level_names(package)
        if f"`{name}`" not in row and f"`{name.removesuffix('.py')}`" not in row
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_top_level_module_is_named_in_the_layout_table(package: str) -> None:
    section = _layout_section()
    rows = [line for line in section.splitlines() if line.startswith(f"| `{package}/`")]
    assert len(rows) == 1, f"docs/layout.md table: expected one row for `{package}/`, found {len(rows)}"
    missing = _unnamed(rows[0], package)
    assert not missing, f"docs/layout.md row of `{package}/` does not name: {missing}"


def test_every_dassl_trainer_is_named_in_the_layout_table() -> None:
    section = _layout_section()
    trainers = sorted({m.trainer for m in load_methods().values() if m.trainer})
    assert len(trainers) >= 5, trainers
    missing = [t for t in trainers if f"`{t}`" not in section]
    assert not missing, f"docs/layout.md does not name the trainers {missing}"


def test_the_layout_check_sees_a_missing_module() -> None:
    """The check is not vacuous: a row naming every module but one reports exactly that one."""
    names = _top_level_names("meta/method")
    assert "gram.py" in names and "regulator.py" in names
    full = "| `meta/method/` | " + ", ".join(f"`{n}`" for n in names) + " |"
    assert _unnamed(full, "meta/method") == []
    assert _unnamed(full.replace("`gram.py`", "`x.py`"), "meta/method") == ["gram.py"]
    assert "method/" in _top_level_names("meta") and "chc/" in _top_level_names("meta")


def _imported_test_modules(source: str) -> list[str]:
    """Names of ``test_*`` modules that ``source`` imports (top level or inside a function)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[-1].startswith("test_")]


def test_no_test_file_imports_another() -> None:
    """Shared set-ups live in ``tests/helpers*.py`` and ``tests/conftest.py`` (docs/testing.md), not in a test file
    that another one imports (which runs the imported file's tests' module code and hides where a helper lives)."""
    assert _imported_test_modules("def f():\n    from test_tasks import toy_hierarchy\n") == ["test_tasks"]
    offenders = {
        path.name: found
        for path in sorted((ROOT / "tests").glob("*.py"))
        if (found := _imported_test_modules(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"test files import other test files: {offenders}"
