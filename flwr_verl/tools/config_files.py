"""A run config as the command lines read it: a TOML file (a profile, or a ``pyproject.toml`` whose
``[tool.flwr.app.config]`` is used) and ``--set key=value`` overrides, each value parsed as ``flwr
run --run-config`` parses it. The result is Flower's flat run config, for ``parse_run_config``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import click
from flwr.common.config import flatten_dict, parse_config_args

from flwr_verl.config import ConfigError


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` items, each parsed as ``flwr run --run-config`` parses it (so a value means
    the same here as in the federation): a TOML literal, ``3``, ``1e-3``, ``true``, ``"gae"``."""
    values: dict[str, Any] = {}
    for item in items:
        if "=" not in item:  # Flower would read a lone "x.toml" as a file and ignore anything else
            raise ConfigError(f"--set {item!r} is invalid: expected key=value")
        try:
            parsed = parse_config_args([item])
        except (click.ClickException, OSError) as error:
            raise ConfigError(f"--set {item!r} is invalid: the value must be a TOML literal "
                              f"(a number, true/false, or a quoted string: key='text')") from error
        if not parsed:  # Flower's pattern found no key=value pair, e.g. spaces around "="
            raise ConfigError(f"--set {item!r} is invalid: expected key=value, no spaces around '='")
        values.update(parsed)
    return values


def app_section(document: dict[str, Any]) -> dict[str, Any] | None:
    """A pyproject document's ``[tool.flwr.app.config]``, or None without one."""
    return document.get("tool", {}).get("flwr", {}).get("app", {}).get("config")


def read_run_config(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """Flat run config from a TOML file (if any) and ``key=value`` overrides."""
    values: dict[str, Any] = {}
    if path:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
        section = app_section(document)
        values = flatten_dict(document if section is None else section)
    return {**values, **parse_overrides(overrides)}


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The flat ``[tool.flwr.app.config]`` of the Flower app in ``app_dir``."""
    manifest = app_dir / "pyproject.toml"
    try:
        document = tomllib.loads(manifest.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--app={str(app_dir)!r} is invalid: no pyproject.toml there "
                          "(pass the directory of the Flower app)") from None
    config = app_section(document)
    if config is None:
        raise ConfigError(f"--app={str(app_dir)!r} is invalid: {manifest} has no [tool.flwr.app.config]")
    return flatten_dict(config)
