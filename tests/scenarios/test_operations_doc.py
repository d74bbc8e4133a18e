"""Docs an outsider can follow.

* docs/operations.md's walk-through (install, verify, watch, upgrade, remove) shows what
  the commands print: it is run again here, on the simulated node and the API-server
  double, and compared with the page (times, generations and random names aside);
* no page sends the reader to a document they cannot see (an internal brief, the
  issue tracker, "reference documents");
* the mode guide and the enforcement table exist and are linked from the README.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from gpushare.ops.mdsection import markers
from gpushare.sim import walkthrough

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

VOLATILE = [
    (re.compile(r"updated \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "updated <time>"),
    (re.compile(r"generation \d+"), "generation <n>"),
    (re.compile(r"gpushare-verify-[0-9a-f]{6}"), "gpushare-verify-<id>"),
]


def normalise(text: str) -> str:
    for pattern, stand_in in VOLATILE:
        text = pattern.sub(stand_in, text)
    return text.strip()


def section(path: Path, name: str) -> str:
    start, end = markers(name)
    text = path.read_text()
    return text.split(start, 1)[1].split(end, 1)[0]


def test_the_walkthrough_on_the_page_is_what_the_commands_print() -> None:
    page = normalise(section(ROOT / "docs" / "operations.md", walkthrough.SECTION))
    now = normalise(walkthrough.generate())
    diff = difflib.unified_diff(page.splitlines(), now.splitlines(), "page", "now", lineterm="")
    assert now == page, "\n".join(diff)


#: What a reader outside the project cannot open.
UNSEEN = re.compile(
    r"reference documents?|project brief|\bthe brief\b|BRIEF\.md|\bissue \d+|\bitem \d+"
    r"|(?<![-/\w])reference/",
    re.IGNORECASE,
)


def test_no_page_names_a_document_the_reader_cannot_see() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if UNSEEN.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_guide_and_the_enforcement_table_are_there_and_linked() -> None:
    guide = (ROOT / "docs" / "choosing.md").read_text()
    assert "## Which mode do I want" in guide
    assert "## What is enforced, what is advisory, and by whom" in guide
    for mode in ("shared units", "whole cards", "MIG", "DRA"):
        assert mode in guide
    readme = (ROOT / "README.md").read_text()
    assert "docs/choosing.md" in readme and "kubectl gpushare verify --node" in readme
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "### Verify on your node" in operations
