"""Shared fixtures. One torch thread: on a shared 2-core machine it is the fastest for the tiny
embedded model. The embedded model ships with the package (flwr_verl/embedded/shipped)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

# A small engine: 8 prompts x 2 responses per iteration, two mini-batches, privacy off.
TINY = {
    "privacy": {"enabled": False},
    "data": {"train_size": 32, "val_size": 16, "train_batch_size": 8},
    "rollout": {"n": 2, "response_length": 6},
    "actor": {"ppo_mini_batch_size": 4},
}


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config(actor={"lr": 1e-2}, ...)``: the tiny engine config with sections merged in."""
    from flwr_verl.config import engine_config

    def make(**overrides):
        sections = {name: dict(values) for name, values in TINY.items()}
        for name, values in overrides.items():
            sections.setdefault(name, {}).update(values)
        return engine_config(**sections)

    return make


@pytest.fixture(scope="session")
def model_path():
    """The embedded model directory (the shipped one, checked against its manifest)."""
    from flwr_verl.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(autouse=True)
def node_state_outside_home(tmp_path_factory, monkeypatch):
    """Flower's state directory (where a node's default privacy ledger lives) is a fresh folder per
    test, never the user's ~/.flwr: a ledger left by one test would spend another's budget."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.mktemp("flwr_home")))


@pytest.fixture(scope="session")
def reward_model_dirs(tmp_path_factory):
    """Tiny reward models: ``same`` shares the embedded policy's tokenizer (Llama), ``other`` has
    its own tokenizer with a chat template (GPT-2)."""
    from flwr_verl.embedded import build_tokenizer
    from tests.reward_models import other_tokenizer, save_classifier

    root = tmp_path_factory.mktemp("reward_models")
    return {
        "same": save_classifier(root / "same", build_tokenizer(), arch="llama"),
        "other": save_classifier(root / "other", other_tokenizer(), arch="gpt2", seed=1),
    }


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Scheduling for the README's ``-n 4 --dist loadgroup --no-loadscope-reorder``. A test file is
    one xdist group, so a module fixture (a shared deployment or simulation) runs once; a test that
    starts its own real processes, and each engine's half of a module parametrized over engines,
    name a group of their own (``pytest.mark.xdist_group``) and run beside the rest of their file.
    Four workers: while one waits on Flower's polls, others compute. Groups with real Flower
    processes run first (each keeps its own order): a long group starting last would run alone at
    the end."""
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    slow_groups = {group_of(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: group_of(item) not in slow_groups)


def group_of(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs["name"]
