"""What a node's operator chooses about where its engine runs (node config, never run config):
``engine`` (``warm``: a node-local engine process that outlives messages and runs; ``cold``: a
fresh engine in every ClientApp process), ``engine-dir`` (the engine's socket, token and log)
and ``engine-idle-timeout-s`` (the engine exits after that long without a message, freeing
its memory). Checked once, when a ClientApp or ``flwr-verl engine`` reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_verl.config.errors import require

ENGINE_KINDS = ("warm", "cold")
NODE_ENGINE = "engine"  # node-config keys
NODE_ENGINE_DIR = "engine-dir"
NODE_ENGINE_IDLE_TIMEOUT = "engine-idle-timeout-s"
DEFAULT_IDLE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class NodeEngineConfig:
    kind: str = "warm"
    directory: Path = Path()
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        require(self.kind in ENGINE_KINDS, f"node config {NODE_ENGINE}", self.kind,
                f"must be one of {', '.join(ENGINE_KINDS)}")
        require(isinstance(self.idle_timeout_s, (int, float)) and not isinstance(self.idle_timeout_s, bool)
                and math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0,
                f"node config {NODE_ENGINE_IDLE_TIMEOUT}", self.idle_timeout_s, "must be a number of seconds > 0")

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any], default_dir: Path) -> NodeEngineConfig:
        """The node's engine settings; ``default_dir`` (under the node's Flower home) when
        ``engine-dir`` is not set."""
        directory = node_config.get(NODE_ENGINE_DIR, str(default_dir))
        require(isinstance(directory, str) and bool(directory.strip()), f"node config {NODE_ENGINE_DIR}", directory,
                "must be a directory path")
        return cls(kind=node_config.get(NODE_ENGINE, "warm"), directory=Path(directory).expanduser().absolute(),
                   idle_timeout_s=node_config.get(NODE_ENGINE_IDLE_TIMEOUT, DEFAULT_IDLE_TIMEOUT_S))
