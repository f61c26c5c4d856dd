"""A node's warm engine: one process per node that keeps the engine (torch, transformers, PEFT,
verl, the base model, tokenizer and data) loaded across messages and runs, and answers the
ClientApp's fit, evaluate and preflight calls (``engine_client`` forwards them; the bytes are
``engine_wire``'s). Started by the first ClientApp that needs it, or by ``flwr-verl engine start``::

    python -m flwr_verl.federation.engine_server --dir DIR [--idle-timeout-s 3600]

**Who may call it.** It listens on the Unix socket ``DIR/engine.sock`` only (never on a network
interface). ``DIR`` is the owner's alone (mode 0700, checked: a directory that group or others
can enter is refused), the socket is mode 0600, so the kernel refuses other users' processes
before this code runs; the engine also checks each peer's user id (``SO_PEERCRED``). Each start
writes a new random token to ``DIR/token`` (0600); a request whose token is wrong is refused
before any of its arrays is read (``hmac.compare_digest``), so a local process that can reach
the socket but cannot read the node's files gets nothing.

**One run's state never reaches another.** Each call builds a fresh ``VerlClient`` from the call's
own run config, node config and ``Context.state`` (as a cold ClientApp does): a fresh optimizer
and RNG seeded per fit, the adapter set from the message's parameters, the privacy account read
from the node's ledger file. What stays is what a cold process would rebuild identically: the
imports, the base model with its LoRA wrapping (one set, keyed by the model config), tokenizer and
data. Calls run one at a time, in arrival order.

**Bound to one base model.** The first call (or ``flwr-verl engine start --run-config``) binds
the engine to its base model: the resolved ``model.path``, ``model.dtype`` and the size and
modification time of every file there. A call for another base is refused (``EngineBaseMismatch``)
naming both: load another base by stopping the engine (``flwr-verl engine stop``) or by setting
``engine = "cold"`` on the node.

**Lifecycle.** A lock file (``DIR/engine.lock``) keeps one engine per directory. It exits after
``--idle-timeout-s`` without a call, on ``flwr-verl engine stop``, or on SIGTERM. When it dies,
the ClientApp that finds it gone starts another (``engine_client``). Its log is ``DIR/engine.log``;
each call's log lines also go back to the ClientApp, so they appear in the SuperNode's log as a
cold client's would.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from flwr_verl.config import ConfigError, FlwrVerlError
from flwr_verl.federation.engine_wire import (
    PROTOCOL_VERSION,
    EngineProtocolError,
    decode_values,
    encode_values,
    recv_arrays,
    recv_header,
    send_message,
)

SOCKET, TOKEN, LOCK, LOG, INFO_FILE = "engine.sock", "token", "engine.lock", "engine.log", "engine.json"
READY = "flwr-verl engine: listening on"  # the log line a start waits for
REQUEST_TIMEOUT_S = 120.0  # a peer must send its whole request within this; a reply waits as long as it takes
METHODS = ("get_properties", "get_parameters", "fit", "evaluate")
log = logging.getLogger("flwr_verl.engine_server")


class EngineBaseMismatch(ConfigError):
    """The run asks for another base model than the one this node's engine holds."""


def private_dir(path: Path) -> Path:
    """``path``, created mode 0700; refused when it is not this user's or others may enter it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(f"node config engine-dir={str(path)!r} is invalid: it must belong to this user "
                          f"(uid {os.getuid()}; it is {info.st_uid}) and be closed to group and others "
                          f"(mode {oct(info.st_mode & 0o777)}; run `chmod 700 {path}`)")
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(scratch, path)


def code_digest(package: Path | None = None) -> str:
    """sha256 of the flwr_verl sources this process runs (names and bytes of every ``*.py``): an
    engine that runs other code than the ClientApp that calls it is replaced."""
    package = package or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def base_identity(engine) -> dict[str, str]:
    """What binds an engine to its base model: path, dtype, and each file's name, size and mtime."""
    from flwr_verl.engine.models import resolve_model_path

    path = resolve_model_path(engine.model).resolve()
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        info = file.stat()
        digest.update(f"{file.relative_to(path)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return {"model.path": str(path), "model.dtype": engine.model.dtype, "files": digest.hexdigest()[:16]}


class CallLog(logging.Handler):
    """The log records of one call, sent back to the ClientApp."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[list] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append([record.levelno, record.getMessage()])


class EngineServer:
    def __init__(self, directory: Path, idle_timeout_s: float) -> None:
        self.directory = private_dir(Path(directory))
        self.idle_timeout_s = idle_timeout_s
        self.code = code_digest()
        self.base: dict[str, str] | None = None
        self.token = ""
        self.calls = 0
        self.started = time.time()
        self.stopping = False

    # ------------------------------------------------------------------ lifecycle
    def serve(self) -> int:
        lock = open(self.directory / LOCK, "a")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.error("flwr-verl engine: another engine already serves %s; exiting", self.directory)
            return 3
        self.token = secrets.token_hex(32)
        write_private(self.directory / TOKEN, self.token)  # before the socket exists: a connected peer reads this one
        listener = self._bind()
        write_private(self.directory / INFO_FILE, json.dumps({"pid": os.getpid(), "code": self.code,
                                                              "started": self.started}))
        signal.signal(signal.SIGTERM, lambda *_: self._stop("SIGTERM"))
        log.info("%s %s (pid %d); loading the engine", READY, self.directory / SOCKET, os.getpid())
        start = time.perf_counter()
        import flwr_verl.federation.client  # noqa: F401 - torch, transformers, PEFT, verl: once per engine

        log.info("flwr-verl engine: imports done in %.1f s", time.perf_counter() - start)
        listener.settimeout(self.idle_timeout_s)
        try:
            while not self.stopping:
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    log.info("flwr-verl engine: idle for %.0f s; exiting", self.idle_timeout_s)
                    break
                except InterruptedError:
                    continue
                with conn:
                    self._handle(conn)
        finally:
            with contextlib.suppress(OSError):
                (self.directory / SOCKET).unlink()
            listener.close()
        return 0

    def _bind(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        os.chdir(self.directory)  # a relative name: socket paths are limited to about 107 bytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET)  # left by an engine that died; the lock says none is running
        old = os.umask(0o177)
        try:
            listener.bind(SOCKET)
        finally:
            os.umask(old)
        os.chmod(SOCKET, 0o600)
        listener.listen(64)
        return listener

    def _stop(self, why: str) -> None:
        log.info("flwr-verl engine: stopping (%s)", why)
        self.stopping = True

    # ------------------------------------------------------------------ one connection
    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            if uid != os.getuid():
                log.warning("flwr-verl engine: refused pid %d of uid %d (not this node's user)", pid, uid)
                return send_message(conn, {"ok": False, "refused": "another user's process"})
            header = recv_header(conn, allow_eof=True)
            if header is None:  # connected and left without a word: a liveness probe
                return None
            token = header.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
                log.warning("flwr-verl engine: refused pid %d: wrong or missing token", pid)
                return send_message(conn, {"ok": False, "refused": "wrong or missing token"})
            reply, arrays = self._answer(header, conn)
            conn.settimeout(None)
            send_message(conn, reply, arrays)
        except EngineProtocolError as error:  # a malformed request: say so, if the peer still listens
            log.warning("flwr-verl engine: bad request: %s", error)
            with contextlib.suppress(OSError):
                send_message(conn, {"ok": False, "error": {"type": type(error).__name__, "message": str(error),
                                                           "user_error": True}})
        except OSError as error:  # the peer went away
            log.warning("flwr-verl engine: connection dropped: %s: %s", type(error).__name__, error)

    def _answer(self, header: dict[str, Any], conn: socket.socket) -> tuple[dict[str, Any], list]:
        op = header.get("op")
        status = {"ok": True, "pid": os.getpid(), "code": self.code, "base": self.base, "calls": self.calls,
                  "uptime_s": time.time() - self.started, "protocol": PROTOCOL_VERSION}
        if header.get("protocol") != PROTOCOL_VERSION or header.get("code") not in (None, self.code):
            return {"ok": False, "restart": "the engine runs other flwr_verl code than this ClientApp", **status}, []
        if op == "ping":
            return status, []
        if op == "stop":
            self._stop("flwr-verl engine stop")
            return status, []
        if op in ("call", "preload"):
            arrays = recv_arrays(conn, header)
            return self._call(op, header, arrays)
        raise EngineProtocolError(f"unknown op {op!r}")

    def _call(self, op: str, header: dict[str, Any], arrays: list) -> tuple[dict[str, Any], list]:
        handler = CallLog()
        logging.getLogger("flwr").addHandler(handler)
        start = time.perf_counter()
        try:
            reply, out = (self._preload if op == "preload" else self._run)(header, arrays)
            reply = {"ok": True, **reply}
        except Exception as error:  # noqa: BLE001 - every failure goes back to the ClientApp as its reply
            if not isinstance(error, FlwrVerlError):
                log.error("flwr-verl engine: %s failed:\n%s", header.get("method", op), traceback.format_exc())
            reply, out = {"ok": False, "error": {"type": type(error).__name__, "message": str(error),
                                                 "user_error": isinstance(error, FlwrVerlError)}}, []
        finally:
            logging.getLogger("flwr").removeHandler(handler)
        self.calls += 1
        return {**reply, "seconds": time.perf_counter() - start, "log": handler.lines}, out

    def _engine_config(self, run_config: dict[str, Any]):
        from flwr_verl.federation.node import keep_only_models
        from flwr_verl.federation.run_config import load_run_config

        engine = load_run_config(run_config).engine
        identity = base_identity(engine)
        if self.base is None:
            self.base = identity
        elif identity != self.base:
            raise EngineBaseMismatch(
                f"model.path={engine.model.path or '(embedded)'}: this node's warm engine holds another base model "
                f"({self.base}) than this run asks for ({identity}). Stop it (`flwr-verl engine stop --dir "
                f"{self.directory}`) to load the new one, or set node config engine=\"cold\"")
        keep_only_models(engine)  # one set of models at a time: a 7B base on a GPU is not loaded twice
        return engine

    def _preload(self, header: dict[str, Any], arrays: list) -> tuple[dict[str, Any], list]:
        from flwr_verl.federation.node import cached_models

        cached_models(self._engine_config(decode_values(header.get("run_config"), "run_config")))
        return {"base": self.base}, []

    def _run(self, header: dict[str, Any], arrays: list) -> tuple[dict[str, Any], list]:
        from flwr.app import ArrayRecord, Context, RecordDict

        from flwr_verl.federation.client import client_from_context
        from flwr_verl.federation.compression import StateErrorFeedback

        method = header.get("method")
        if method not in METHODS:
            raise EngineProtocolError(f"unknown method {method!r}")
        log.info("flwr-verl engine: %s for run %s, node %s", method, header.get("run_id"), header.get("node_id"))
        run_config = decode_values(header.get("run_config"), "run_config")
        count = header.get("num_parameters")
        if not isinstance(count, int) or not 0 <= count <= len(arrays):
            raise EngineProtocolError(f"bad num_parameters {count!r}")
        parameters, residual = arrays[:count], arrays[count:]
        state = RecordDict()
        if residual:
            state.array_records[StateErrorFeedback.KEY] = ArrayRecord(residual)
        context = Context(run_id=int(header.get("run_id", 0)), node_id=int(header.get("node_id", 0)),
                          node_config=decode_values(header.get("node_config"), "node_config"), state=state,
                          run_config=run_config)
        client = client_from_context(context, self._engine_config(run_config))
        config = decode_values(header.get("config"), "config")
        out: list = []
        start = time.perf_counter()
        if method == "get_properties":
            reply = {"metrics": encode_values(client.get_properties(config))}
        elif method == "get_parameters":
            out = client.get_parameters(config)
            reply = {}
        elif method == "fit":
            out, num_examples, metrics = client.fit(parameters, config)
            reply = {"num_examples": int(num_examples), "metrics": encode_values(metrics)}
        else:
            loss, num_examples, metrics = client.evaluate(parameters, config)
            reply = {"loss": float(loss), "num_examples": int(num_examples), "metrics": encode_values(metrics)}
        after = state.array_records.get(StateErrorFeedback.KEY)
        kept = [] if after is None else after.to_numpy_ndarrays()
        return {**reply, "num_results": len(out), "residual": after is not None,
                "compute_seconds": time.perf_counter() - start}, [*out, *kept]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a node's warm flwr-verl engine (see flwr-verl engine)")
    parser.add_argument("--dir", type=Path, required=True, help="the engine's directory (socket, token, log)")
    parser.add_argument("--idle-timeout-s", type=float, default=3600.0, help="exit after this long without a call")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("flwr").setLevel(logging.INFO)
    try:
        return EngineServer(args.dir, args.idle_timeout_s).serve()
    except FlwrVerlError as error:
        log.error("flwr-verl engine: %s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
