"""Every data file and figure the documentation names ships with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
# docs/data/x.json from the repository root, or data/x.json and figures/x.png from docs/;
# a * stands for a family of files, of which at least one must exist.
REFERENCE = re.compile(r"(?<![\w/.-])((?:docs/)?(?:data|figures)/[\w.*-]+\.(?:json|png|csv))")


def references(text: str) -> set[str]:
    """The data files and figures ``text`` names, as paths from the repository root."""
    return {ref if ref.startswith("docs/") else f"docs/{ref}" for ref in REFERENCE.findall(text)}


def test_references_are_read_from_either_root() -> None:
    text = "see `docs/data/a.json`, [b](data/b-*.json) and ![c](figures/c.png); not x/data/d.json"
    assert references(text) == {"docs/data/a.json", "docs/data/b-*.json", "docs/figures/c.png"}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_data_file_and_figure_a_page_names_exists(page: Path) -> None:
    missing = sorted(ref for ref in references(page.read_text()) if not list(REPO.glob(ref)))
    assert not missing, f"{page.name} names files that do not ship: {missing}"
