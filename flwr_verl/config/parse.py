"""Flower's flat run config (``{"actor.clip_ratio": 0.2, "num-server-rounds": 8, ...}``) into
the typed configuration: unknown keys and wrong types fail here, naming the key."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from flwr_verl.config.engine import EngineConfig
from flwr_verl.config.errors import ConfigError, require
from flwr_verl.config.federation import FederationConfig, RunConfig

# Keys whose spelling differs from the dataclass field that holds them.
_ALIASES = {
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl_type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.horizon",
}


def _fields(cls) -> dict[str, tuple[type, Any]]:
    hints = get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        require(isinstance(value, bool), key, value, "must be true or false")
    elif kind is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer")
    elif kind is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number")
        value = float(value)
    elif kind is str:
        require(isinstance(value, str), key, value, "must be a string")
    return value


def _build(cls, values: dict[str, Any], prefix: str, kebab: bool):
    """Instantiate ``cls`` from ``values`` (keys relative to ``prefix``), rejecting unknown keys."""
    fields = _fields(cls)
    nested = {name for name, (kind, _) in fields.items() if dataclasses.is_dataclass(kind)}
    kwargs: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {name: {} for name in nested}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        name = head.replace("-", "_") if kebab else head
        if name in nested and rest:
            grouped[name][rest] = value
        elif name in fields and name not in nested and not rest:
            kwargs[name] = _coerce(prefix + key, value, fields[name][0])
        else:
            allowed = sorted((n.replace("_", "-") if kebab else n) for n in fields)
            raise ConfigError(f"unknown config key {prefix + key!r}; allowed under {prefix or 'the top level'!r}: "
                              f"{', '.join(allowed)}")
    for name in nested:
        kind = fields[name][0]
        sub_prefix = f"{prefix}{name.replace('_', '-') if kebab else name}."
        kwargs[name] = _build(kind, grouped[name], sub_prefix, kebab)
    return cls(**kwargs)


def parse_run_config(run_config: dict[str, Any]) -> RunConfig:
    """Validate Flower's flat run config. Engine keys are verl-style, federation keys Flower-style."""
    engine_sections = {f.name for f in dataclasses.fields(EngineConfig)}
    engine_values: dict[str, Any] = {}
    federation_values: dict[str, Any] = {}
    for key, value in run_config.items():
        key = _ALIASES.get(key, key)
        (engine_values if key.partition(".")[0] in engine_sections else federation_values)[key] = value
    return RunConfig(
        engine=_build(EngineConfig, engine_values, "", kebab=False),
        federation=_build(FederationConfig, federation_values, "", kebab=True),
    )


def engine_config(**sections: dict[str, Any]) -> EngineConfig:
    """Convenience for Python users: ``engine_config(actor={"lr": 1e-3}, rollout={"n": 4})``."""
    flat = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    return parse_run_config(flat).engine

