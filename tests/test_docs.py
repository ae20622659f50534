"""The README stays a short user guide; README, ARCHITECTURE.md and docs/ link only to what exists;
docs/ holds user guides only (no run JSON, no dated log entries) within the size budget."""

import re

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:actors|buffer|configs|docs|lab|learner|models|scripts|tasks|tests|transport)"
                  r"/[\w./-]*\.(?:json|md|png|py|sbatch|sh|toml|txt|yaml))(?![\w/])")


def _id(page):
    return str(page.relative_to(ROOT))


def anchors(page) -> set[str]:
    """GitHub's ids for the page's headings: lower case, punctuation but - and _ dropped, spaces
    to -, a repeated id suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_readme_is_at_most_8_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 8 * 1024, f"README.md is {size} bytes; move detail into docs/<topic>.md"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_relative_links_and_their_anchors_resolve(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in set(anchors(file)):
            bad.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not bad, f"{_id(page)} links to what does not exist: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_file_paths_named_in_the_text_exist(page):
    """A module, script or preset named by its repository path must exist (a file moved without
    its docs fails here)."""
    missing = sorted({p for p in PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{_id(page)} names files that do not exist: {missing}"


def test_readme_and_docs_stay_within_120_kb():
    pages = [ROOT / "README.md", *DOCS.rglob("*.md")]
    size = sum(len(p.read_bytes()) for p in pages)
    assert size <= 120_000, (f"README.md + docs/ are {size} bytes, over 120 KB: move measurements to "
                             "lab/notes/ and design detail out of the guides")


def test_docs_hold_guides_only_no_run_data():
    other = sorted(_id(p) for p in DOCS.rglob("*") if p.is_file() and p.suffix != ".md")
    assert not other, f"docs/ holds user guides only; run JSON, plots and studies go to lab/: {other}"


DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w/-])")


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=_id)
def test_no_dated_log_entries(page):
    """Dates and commit hashes belong to lab/notes/; only docs/performance.md stamps each figure
    with the commit that measured it."""
    text = page.read_text()
    found = DATE.findall(text) + ([] if page.name == "performance.md" else COMMIT.findall(text))
    assert not found, f"{_id(page)} holds dated log entries {found}: move them to lab/notes/"
