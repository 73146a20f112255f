"""The documentation is reachable: README stays short and links the index, the index links every page under
``docs/``, and every relative link in README and ``docs/`` points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """Link targets of ``page`` that are neither URLs nor in-page anchors, without their ``#anchor``."""
    targets = [t.split("#", 1)[0] for t in LINK.findall(page.read_text(encoding="utf-8"))]
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def test_readme_is_short_and_starts_with_the_fork_quickstart() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; tables and numbers go to docs/"
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert lines[headings[0]].startswith("## In a CoOp / Dassl fork"), lines[headings[0]]
    assert headings[0] < 30, "the fork quickstart must be on README's first screen"
    assert "docs/README.md" in "\n".join(lines)


def test_every_docs_page_is_linked_from_the_index() -> None:
    index = DOCS / "README.md"
    linked = {(DOCS / t).resolve() for t in relative_links(index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md") if p != index}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs/README.md does not link {missing}"


def test_every_relative_link_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)} -> {target}"
        for page in pages
        for target in relative_links(page)
        if not (page.parent / target).exists()
    ]
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[a](a.md) [b](https://example.org/x) [c](#here) [d](sub/d.md#part)\n", encoding="utf-8")
    assert relative_links(page) == ["a.md", "sub/d.md"]
