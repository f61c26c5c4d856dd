"""The README and docs/ say what the code does: every relative link (and its #anchor) resolves,
the README stays a short front page, and the figures the docs quote from the code are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flwr_verl.tools.cli import app_defaults

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if heading := re.match(r"#{1,6} (.+)", line):
            text = re.sub(r"[^\w\- ]", "", heading[1].strip().lower().replace("`", ""))
            out.add(text.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_readme_is_a_short_front_page_that_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme)}
    assert {p.name for p in PAGES[1:]} <= linked, sorted({p.name for p in PAGES[1:]} - linked)


def test_the_check_config_example_prints_the_apps_real_key_count():
    text = (REPO / "docs" / "configuration.md").read_text()
    (shown,) = re.findall(r"# ok: (\d+) keys valid", text)
    assert int(shown) == len(app_defaults(REPO))
