"""Lazy re-exports for the subpackages' ``__init__``: ``from flwr_verl.federation import
VerlClient`` imports ``federation.client`` only when that name is asked for, so that importing
a light module of a room (``federation.protocol``, say) never pays for torch, transformers or
verl through its package."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for ``package``, whose public names are
    ``exports`` (name -> the submodule that defines it)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__, sorted(exports)
