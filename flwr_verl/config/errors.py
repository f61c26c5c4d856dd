"""The errors every room of flwr-verl raises for bad input, and ``require``, the one-line check
that names the key, the value and what is allowed. They live below everything else, so that
every module can raise them without importing another room."""

from __future__ import annotations

from typing import Any


class FlwrVerlError(Exception):
    """Base of the errors flwr-verl raises for bad input or a failed run. The message is written
    for users: it names what is wrong and what is allowed, so no traceback is needed."""


class ConfigError(FlwrVerlError, ValueError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")



class DataError(FlwrVerlError, ValueError):
    """Training or evaluation data is unusable; the message names the file, row and field."""
