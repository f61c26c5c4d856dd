"""Server checkpoints without pickle: tensors in safetensors, everything else in JSON, and a hash.

``save_state(directory, state)`` writes a strategy's ``state_dict()`` (nested dicts and lists of
tensors, numbers, strings) as two files::

    server_state.safetensors   every tensor, keyed by its path in the state ("optimizer.state.0.exp_avg")
    server_state.json          the rest, with each tensor replaced by {"__tensor__": path}, and the
                               sha256 of the safetensors file

``load_state(directory)`` verifies the hash and rebuilds the state exactly (dtypes, integer dict
keys, nested lists), or raises ``CheckpointError``. Loading never runs code: a checkpoint is data
only, unlike ``torch.load(weights_only=False)``, which runs whatever a planted pickle holds.
Both files are written to disk (fsync) before the caller renames the directory into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flwr_verl.config import FlwrVerlError

TENSORS = "server_state.safetensors"
MANIFEST = "server_state.json"
FORMAT = 1


class CheckpointError(FlwrVerlError, ValueError):
    """A checkpoint is missing, truncated, or does not match its recorded hash."""


def save_state(directory: Path, state: dict[str, Any]) -> None:
    """Write ``state`` into ``directory`` (which must exist)."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors, "")
    tensor_file = Path(directory) / TENSORS
    save_file(tensors, str(tensor_file))
    _fsync(tensor_file)
    manifest = Path(directory) / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT, "sha256": _sha256(tensor_file), "state": encoded}))
    _fsync(manifest)


def load_state(directory: Path) -> dict[str, Any]:
    """The state saved in ``directory``, verified against its hash."""
    manifest, tensor_file = Path(directory) / MANIFEST, Path(directory) / TENSORS
    try:
        document = json.loads(manifest.read_text())
        expected = document["sha256"]
        if document.get("format") != FORMAT:
            raise CheckpointError(f"{manifest}: unknown checkpoint format {document.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest}: unreadable checkpoint manifest: {error}") from error
    try:
        actual = _sha256(tensor_file)
    except OSError as error:
        raise CheckpointError(f"{tensor_file}: {error}") from error
    if actual != expected:
        raise CheckpointError(f"{tensor_file}: sha256 {actual[:12]}... does not match the recorded {expected[:12]}...")
    try:
        tensors = load_file(str(tensor_file))
        return _decode(document["state"], tensors)
    except Exception as error:  # safetensors raises its own types for a damaged file
        raise CheckpointError(f"{directory}: damaged checkpoint: {error}") from error


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: _encode(item, tensors, f"{path}.{key}".lstrip(".")) for key, item in value.items()}
        # torch optimizers key their per-parameter state by int: keep the keys' types
        return {"__items__": [[key, _encode(item, tensors, f"{path}.{key}".lstrip("."))] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_encode(item, tensors, f"{path}.{index}".lstrip(".")) for index, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint {path}: {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__items__"}:
            return {key: _decode(item, tensors) for key, item in value["__items__"]}
        return {key: _decode(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    return value


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
