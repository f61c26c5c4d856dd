"""The house's rules, read from the source: rooms import only the rooms below them, no import
circles, no module over about 450 lines, the stage registry matches the config, and the flat
module paths of 0.1 still import (with a ``DeprecationWarning``) as the same modules."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import flwr_verl
from flwr_verl.config import STAGES
from flwr_verl.stages import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flwr_verl"
# Each room may import itself and the rooms before it; "" is the package's own __init__ and _lazy.
ROOMS = ["", "config", "embedded", "privacy", "engine", "stages", "federation", "tools"]
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every flwr_verl module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flwr_verl"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).exists()
                         or (PACKAGE.parent / (f"{node.module}.{a.name}".replace(".", "/") + ".py")).exists())
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flwr_verl"))
    return found


def third_party(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
    return tops


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {i for i in imports(path) if i in MODULES and i != name} for name, path in MODULES.items()}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else ""


def test_every_import_points_down_the_house():
    wrong = [f"{m} -> {i}" for m, targets in GRAPH.items() for i in targets
             if ROOMS.index(room(i)) > ROOMS.index(room(m))]
    assert not wrong, "imports that point up the house:\n" + "\n".join(sorted(wrong))


def test_there_is_no_import_circle():
    # Tarjan's strongly connected components; a package's __init__ importing its own submodule is
    # not an edge that can close a circle at import time unless that submodule imports it back.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_config_imports_nothing_else_of_the_project():
    outside = {f"{m} -> {i}" for m in GRAPH if room(m) == "config" for i in GRAPH[m] if room(i) != "config"}
    assert not outside


@pytest.mark.parametrize("name", ["config", "embedded", "privacy", "engine", "stages"])
def test_rooms_below_the_federation_import_no_flower(name):
    users = [m for m, path in MODULES.items() if room(m) == name and "flwr" in third_party(path)
             and m != "flwr_verl.privacy.ledger"]  # the ledger's default path is under Flower's home
    assert not users


def test_no_module_is_over_450_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long


def test_the_library_imports_neither_apps_benchmarks_deploy_nor_tests():
    for path in MODULES.values():
        assert not third_party(path) & {"apps", "benchmarks", "deploy", "tests"}, path


def test_the_stage_registry_is_the_configs_list_of_stages():
    assert sorted(REGISTRY) == sorted(STAGES)


@pytest.mark.parametrize("old", sorted(flwr_verl.MOVED_MODULES))
def test_a_flat_path_of_0_1_imports_the_moved_module_with_a_warning(old):
    for name in [f"flwr_verl.{old}"]:
        sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"flwr_verl.{old}")
    new = f"flwr_verl.{flwr_verl.MOVED_MODULES[old]}"
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and f"flwr_verl.{old} moved to {new}" in str(w.message)
               for w in caught)
