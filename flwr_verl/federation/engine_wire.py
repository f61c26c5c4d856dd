"""The bytes between a ClientApp and its node's warm engine (``engine_client`` and ``engine_server``),
over a Unix socket. Nothing read from the socket is unpickled or evaluated.

One connection carries one request and one reply. Each is a *message*: the magic ``FVE1``, the
header's length (4 bytes, big-endian, at most ``MAX_HEADER`` bytes), the header as UTF-8 JSON,
then the raw C-order bytes of each array that the header lists as ``[dtype, shape]`` (dtypes from
``DTYPES`` only; at most ``MAX_ARRAY_BYTES`` in all). A request's header carries the engine's
token first of all: the engine reads no array of a message whose token is wrong.

Flower's config and metrics values (bool, int, float, str, bytes, and lists of them) travel as
JSON; bytes as ``{"$bytes": base64}``; NaN and infinity as Python's JSON writes them.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import struct
from typing import Any

import numpy as np

from flwr_verl.config import FlwrVerlError

MAGIC = b"FVE1"
MAX_HEADER = 16 * 2**20
MAX_ARRAY_BYTES = 2**36
DTYPES = frozenset({"<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"})
PROTOCOL_VERSION = 1


class EngineProtocolError(FlwrVerlError, ValueError):
    """A message to or from the engine is malformed (wrong magic, size, dtype or entry)."""


class EngineUnavailable(FlwrVerlError, RuntimeError):
    """The node's engine could not be reached, started, or did not answer in time."""


class EngineRefused(FlwrVerlError, PermissionError):
    """The engine refused a connection: wrong token, or a process of another user."""


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    raise EngineProtocolError(f"a value of type {type(value).__name__} cannot travel to the engine: {value!r}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"$bytes"} or not isinstance(value["$bytes"], str):
            raise EngineProtocolError(f"unexpected object in a message: {sorted(value)}")
        return base64.b64decode(value["$bytes"], validate=True)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def encode_values(values: dict[str, Any]) -> dict[str, Any]:
    """A Flower config or metrics dict, for the header."""
    return {str(k): _encode(v) for k, v in values.items()}


def decode_values(values: Any, what: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise EngineProtocolError(f"message entry {what!r} must be an object")
    return {k: _decode(v) for k, v in values.items()}


def send_message(sock: socket.socket, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.str not in DTYPES:
            raise EngineProtocolError(f"an array of dtype {a.dtype} cannot travel to the engine")
    body = json.dumps({**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    if len(body) > MAX_HEADER:
        raise EngineProtocolError(f"message header of {len(body)} bytes exceeds {MAX_HEADER}")
    sock.sendall(MAGIC + struct.pack(">I", len(body)) + body)
    for a in arrays:
        if a.nbytes:
            sock.sendall(memoryview(a).cast("B"))


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the peer closed the connection mid-message")
        view = view[got:]


def recv_header(sock: socket.socket, max_header: int = MAX_HEADER, allow_eof: bool = False) -> dict[str, Any] | None:
    """The next message's header (its arrays still unread: ``recv_arrays``); None when the peer
    closed the connection before sending anything and ``allow_eof``."""
    prefix = bytearray(8)
    first = sock.recv_into(prefix)
    if not first and allow_eof:
        return None
    if not first:
        raise ConnectionError("the peer closed the connection before sending a message")
    _recv_into(sock, memoryview(prefix)[first:])
    if bytes(prefix[:4]) != MAGIC:
        raise EngineProtocolError("not an flwr-verl engine message (bad magic)")
    (size,) = struct.unpack(">I", prefix[4:])
    if size > max_header:
        raise EngineProtocolError(f"message header of {size} bytes exceeds {max_header}")
    body = bytearray(size)
    _recv_into(sock, memoryview(body))
    try:
        header = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EngineProtocolError(f"message header is not JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise EngineProtocolError("message header must be an object with an 'arrays' list")
    return header


def recv_arrays(sock: socket.socket, header: dict[str, Any]) -> list[np.ndarray]:
    specs, total, arrays = header["arrays"], 0, []
    for spec in specs:
        if (not isinstance(spec, list) or len(spec) != 2 or spec[0] not in DTYPES or not isinstance(spec[1], list)
                or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40 for n in spec[1])):
            raise EngineProtocolError(f"bad array entry {spec!r} (allowed dtypes: {sorted(DTYPES)})")
        total += np.dtype(spec[0]).itemsize * math.prod(spec[1])
        if total > MAX_ARRAY_BYTES:
            raise EngineProtocolError(f"a message's arrays exceed {MAX_ARRAY_BYTES} bytes")
    for dtype, shape in specs:
        array = np.empty(shape, dtype=np.dtype(dtype))
        if array.nbytes:
            _recv_into(sock, memoryview(array).cast("B"))
        arrays.append(array)
    return arrays


class RemoteError(Exception):
    """An exception raised in the engine, re-raised in the ClientApp under its own class name, so
    the server's one-line error reads as it would from a cold ClientApp."""


class RemoteUserError(RemoteError, FlwrVerlError):
    """A ``FlwrVerlError`` raised in the engine (logged as one line, no traceback)."""


def remote_error(kind: str, message: str, user_error: bool) -> RemoteError:
    """An exception whose ``type(e).__name__`` is ``kind`` (the engine's class name)."""
    name = kind if isinstance(kind, str) and kind.isidentifier() else "EngineError"
    return type(name, (RemoteUserError if user_error else RemoteError,), {})(str(message))
