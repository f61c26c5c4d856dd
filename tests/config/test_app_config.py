"""The app manifest's defaults, the annotated profile and the dataclass defaults agree."""

import dataclasses
import tomllib
from pathlib import Path

from flwr.common.config import flatten_dict

from flwr_verl.config import RunConfig, parse_run_config

ROOT = Path(__file__).resolve().parents[2]


def _manifest_defaults() -> dict:
    return flatten_dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


def test_profile_lists_every_key_with_the_manifest_default():
    profile = flatten_dict(tomllib.loads((ROOT / "pyproject-flwr.toml").read_text()))
    assert profile == _manifest_defaults()


def test_manifest_defaults_are_the_dataclass_defaults():
    assert dataclasses.asdict(parse_run_config(_manifest_defaults())) == dataclasses.asdict(RunConfig())


def test_manifest_has_no_federations_section():
    assert "federations" not in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]
