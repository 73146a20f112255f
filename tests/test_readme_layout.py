"""The layout page (``docs/layout.md``, linked from README) names every module of the installed packages, at every
depth, names nothing that does not exist, and names every Dassl trainer.

A row of the page is ``| `path` | what it holds |``.  Every ``*.py`` under :data:`PACKAGES` needs its own row
(``__init__.py`` aside: the folder's own row, ``meta/chc/``, stands for it), every row's path must exist (a
folder when it ends in ``/``), no path has two rows and no row is left without its text.  A module added without
a row, or a row left behind by a module that moved, fails here, so the map of the code does not fall behind it.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from meta.method.methods import load_methods

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
PACKAGES = ("meta", "gram_world", "gram_tools", "trainers", "datasets")
ROW = re.compile(r"^\| `([^`]+)` \|(.*)\|[ \t]*$", flags=re.M)


def layout_rows(text: str) -> list[tuple[str, str]]:
    """``(path, what)`` of every table row whose first cell is one backticked path, in page order."""
    return [(path, what.strip()) for path, what in ROW.findall(text)]


def modules_to_name(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Paths (relative to ``root``, posix) that need a row: each ``*.py`` but ``__init__.py`` under ``packages``
    at any depth, and ``<folder>/`` for each folder holding an ``__init__.py``; caches and hidden files aside."""
    names: set[str] = set()
    for package in packages:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root)
            if any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
                continue
            names.add(f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix())
    return sorted(names)


@dataclass(frozen=True)
class LayoutProblems:
    """What a layout page gets wrong about a tree, each list sorted."""

    unnamed: list[str]  # a module or package with no row
    stale: list[str]  # a row whose path does not exist
    repeated: list[str]  # a path with more than one row
    blank: list[str]  # a row that says nothing

    def __bool__(self) -> bool:
        return bool(self.unnamed or self.stale or self.repeated or self.blank)

    def message(self) -> str:
        """One line per kind of problem, saying what to do."""
        lines = []
        if self.unnamed:
            lines.append(f"no row for {self.unnamed}: add '| `<path>` | what it holds |' to its folder's table")
        if self.stale:
            lines.append(f"rows for paths that do not exist {self.stale}: remove them or mend the path")
        if self.repeated:
            lines.append(f"paths with more than one row {self.repeated}: keep one")
        if self.blank:
            lines.append(f"rows that say nothing {self.blank}: say what the module holds")
        return "docs/layout.md: " + "; ".join(lines)


def layout_problems(text: str, root: Path, packages: tuple[str, ...] = PACKAGES) -> LayoutProblems:
    """Compare the rows of the page ``text`` with the tree under ``root``."""
    rows = layout_rows(text)
    counts = Counter(path for path, _ in rows)

    def exists(path: str) -> bool:
        return (root / path).is_dir() if path.endswith("/") else (root / path).is_file()

    return LayoutProblems(
        unnamed=sorted(set(modules_to_name(root, packages)) - set(counts)),
        stale=sorted(path for path in counts if not exists(path)),
        repeated=sorted(path for path, n in counts.items() if n > 1),
        blank=sorted({path for path, what in rows if not what}),
    )


def test_the_layout_names_every_module_at_every_depth_and_nothing_else() -> None:
    problems = layout_problems(LAYOUT.read_text(encoding="utf-8"), ROOT)
    assert not problems, problems.message()


def test_every_dassl_trainer_is_named_in_the_layout() -> None:
    text = LAYOUT.read_text(encoding="utf-8")
    trainers = sorted({m.trainer for m in load_methods().values() if m.trainer})
    assert len(trainers) >= 5, trainers
    missing = [t for t in trainers if f"`{t}`" not in text]
    assert not missing, f"docs/layout.md does not name the trainers {missing}"


def _write(root: Path, *paths: str) -> None:
    for rel in paths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("", encoding="utf-8")


def test_the_layout_check_reports_exactly_what_a_page_gets_wrong(tmp_path: Path) -> None:
    """The check is not vacuous: on a tree two packages deep, a page missing one deep module, naming one module that
    does not exist, repeating one and leaving one row blank is reported exactly; the mended page passes."""
    _write(tmp_path, "pkg/__init__.py", "pkg/top.py", "pkg/sub/__init__.py", "pkg/sub/deep/__init__.py")
    _write(tmp_path, "pkg/sub/deep/leaf.py", "pkg/sub/deep/__main__.py", "pkg/sub/table.yaml")
    _write(tmp_path, "pkg/__pycache__/top.py", "pkg/.hidden.py", "other/ignored.py")
    expected = [
        "pkg/",
        "pkg/sub/",
        "pkg/sub/deep/",
        "pkg/sub/deep/__main__.py",
        "pkg/sub/deep/leaf.py",
        "pkg/top.py",
    ]
    assert modules_to_name(tmp_path, ("pkg",)) == expected

    page = "\n".join(f"| `{path}` | holds {path} |" for path in [*expected, "pkg/sub/table.yaml"])
    assert not layout_problems(page, tmp_path, ("pkg",))
    broken = (
        page.replace("| `pkg/sub/deep/leaf.py` | holds pkg/sub/deep/leaf.py |\n", "")
        .replace("| `pkg/sub/` | holds pkg/sub/ |", "| `pkg/sub/` |  |")
        .replace("`pkg/sub/table.yaml`", "`pkg/sub/gone.py`")
        + "\n| `pkg/top.py` | again |\n| `pkg/top.py/` | a folder that is a file |"
    )
    problems = layout_problems(broken, tmp_path, ("pkg",))
    assert problems == LayoutProblems(
        unnamed=["pkg/sub/deep/leaf.py"],
        stale=["pkg/sub/gone.py", "pkg/top.py/"],
        repeated=["pkg/top.py"],
        blank=["pkg/sub/"],
    )
    assert "pkg/sub/deep/leaf.py" in problems.message() and "pkg/sub/gone.py" in problems.message()


def test_the_real_page_less_one_deep_row_is_reported_exactly() -> None:
    """On the repository itself: dropping the row of a sub-package's module and naming a module that does not
    exist adds those two paths to what the page already gets wrong (nothing, when the test above passes)."""
    text = LAYOUT.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `meta/chc/topics.py` |"))
    broken = text.replace(row + "\n", "") + "\n| `meta/chc/no_such_stage.py` | a stage that was never written |\n"
    before = layout_problems(text, ROOT)
    assert layout_problems(broken, ROOT) == LayoutProblems(
        unnamed=sorted({*before.unnamed, "meta/chc/topics.py"}),
        stale=sorted({*before.stale, "meta/chc/no_such_stage.py"}),
        repeated=before.repeated,
        blank=before.blank,
    )


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
