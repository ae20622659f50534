"""The README stays a short user guide, and every relative link in it and in docs/ resolves."""

import re

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_at_most_8_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 8 * 1024, f"README.md is {size} bytes; move detail into docs/<topic>.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    missing = [t for t in local if not (page.parent / t).exists()]
    assert not missing, f"{page.name}: links to missing files {missing}"
