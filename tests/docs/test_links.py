"""Every relative link in README.md and docs/*.md leads to a file, and every #anchor to a
heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", without_fences(text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", without_fences(page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: — not checked offline
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, broken


def test_the_pages_are_found():
    assert {p.name for p in PAGES} >= {"README.md", "architecture.md", "metrics.md", "alerts.md"}
