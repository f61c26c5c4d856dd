"""The README and docs/ say what the code does: every relative link (and its #anchor) resolves,
the README stays a short front page, and the figures the docs quote from the code are the code's."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import warnings
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


def documented_keys() -> dict[str, tuple[str, str | None]]:
    """Every run-config key a docs table documents (its first cell, where ``.name`` or a bare
    ``name`` continues the section of the key before it): key -> (page, its default cell, when
    that cell has one value per key)."""
    defaults = app_defaults(REPO)
    found: dict[str, tuple[str, str | None]] = {}
    for page in PAGES[1:]:
        lines = page.read_text().splitlines()
        for line, below in zip(lines, lines[1:] + [""]):
            row = None if below.startswith("|---") else re.match(r"\| ((?:`[^`]+`(?:, )?)+) \| ([^|]*) \|", line)
            if not row:
                continue
            keys = re.findall(r"`([^`]+)`", row[1])
            if keys[0] not in defaults:
                continue  # a table of something else (stages, benchmarks)
            section, full = "", []
            for key in keys:
                if key in defaults:
                    section = key.rpartition(".")[0]
                    full.append(key)
                else:
                    full.append(f"{section}.{key.lstrip('.')}" if section else key)
            cells = [v.strip() for v in row[2].split(", ")]
            for index, key in enumerate(full):
                found[key] = (page.name, cells[index] if len(cells) == len(full) else None)
    return found


def test_every_run_config_key_is_documented_with_its_default():
    """The docs' tables cover every key of the app's defaults, and name no key that does not exist:
    a key added, renamed or re-defaulted in the typed config and ``pyproject.toml`` fails here until
    the docs say so."""
    defaults, documented = app_defaults(REPO), documented_keys()
    assert sorted(set(defaults) - set(documented)) == [], "undocumented run-config keys"
    assert sorted(set(documented) - set(defaults)) == [], "documented keys that do not exist"
    wrong = []
    for key, (page, cell) in documented.items():
        value = defaults[key]
        if cell is None or cell.startswith("~") or cell in ("auto",) and value == "auto":
            continue
        text = cell.strip('"`')
        if isinstance(value, bool):
            same = text == str(value).lower()
        elif isinstance(value, (int, float)):
            try:
                same = float(text) == float(value)
            except ValueError:
                same = False
        else:
            same = text == value or (value == "" and cell == '""')
        if not same:
            wrong.append(f"{page}: {key} documented as {cell}, defaults to {value!r}")
    assert not wrong


TESTED = re.compile(r"<!-- tested -->\n```bash\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_shell_blocks_marked_tested_run_and_print_what_they_show(page):
    """A fenced bash block right after ``<!-- tested -->`` runs from the repository root, with this
    checkout's flwr_verl first on the path, command by command: each exits 0, and a ``# ok: ...``
    comment below a command is what it prints."""
    for block in TESTED.findall(page.read_text()):
        command = None
        for line in block.splitlines():
            if not line.startswith("#"):
                command = line
                done = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300,
                                      env={**os.environ, "PYTHONPATH": str(REPO)})  # this checkout's flwr_verl
                assert done.returncode == 0, f"{page.name}: {command}: {done.stdout}{done.stderr}"
            elif line.startswith("# ok: ") and command:
                shown = line.removeprefix("# ").split("  ")[0].strip()
                assert shown in done.stdout, f"{page.name}: {command} printed {done.stdout!r}, the page shows {shown!r}"


PYTHON = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_python_blocks_compile_and_their_flwr_verl_imports_resolve_without_deprecation(page):
    """Every fenced python block compiles, and its imports of flwr_verl name what exists, at the
    current (not deprecated) paths: the README's own-app snippet is user code."""
    for block in PYTHON.findall(page.read_text()):
        tree = ast.parse(block)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flwr_verl"):
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message="flwr_verl", category=DeprecationWarning)
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), f"{page.name}: {node.module} has no {alias.name}"
