"""The ClientApp's side of a node's warm engine (``engine_server``): a thin ``NumPyClient`` that
forwards preflight, fit and evaluate to the engine process, and starts or restarts it.

Flower 1.42 runs every message in a fresh ClientApp process. With node config ``engine = "warm"``
(the default) that process imports Flower and this module only; the engine, which holds torch,
transformers, PEFT, verl, the base model and the data, stays up across messages and runs. With
``engine = "cold"`` the ClientApp builds the engine itself for every message, as before. Only a
``flwr-clientapp`` process forwards: a simulation's Ray actors and a ClientApp called in-process
already stay up across messages, and build the engine in place (``fresh_process_per_message``).

- **Start on first use.** A call that finds no engine (no socket, or a socket nobody serves)
  starts one (``python -m flwr_verl.federation.engine_server``, detached, its own session, this
  interpreter, the same ``flwr_verl`` sources first on its path) under a lock in the engine
  directory, so two ClientApps never start two, and waits ``START_TIMEOUT_S`` for its socket.
- **Restart after a crash.** An engine that dies mid-call fails that call (one line naming its log,
  the ledger has recorded any spend before training, as for a cold ClientApp that is killed) and a
  new one is started at once for the next message; nothing is retried, so nothing runs twice.
  An engine that runs other ``flwr_verl`` code than the ClientApp (a new app version) is stopped
  and replaced.
- **Deadlines.** A reply is awaited at most the run's ``fit-timeout`` (fit; under SecAgg+
  ``secagg.timeout``) or ``evaluate-timeout`` (preflight, evaluation): past those the server has
  given up on the message anyway.
- What the engine logs during a call comes back and is logged here, so the SuperNode's log reads
  as with a cold client; each message adds one line with its timings (``MESSAGE_LINE``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.client import NumPyClient
from flwr.common import log

from flwr_verl.config.node import NodeEngineConfig
from flwr_verl.federation.engine_server import INFO_FILE, LOCK, LOG, SOCKET, TOKEN, code_digest, private_dir
from flwr_verl.federation.engine_wire import (
    PROTOCOL_VERSION,
    EngineProtocolError,
    EngineRefused,
    EngineUnavailable,
    decode_values,
    encode_values,
    recv_arrays,
    recv_header,
    remote_error,
    send_message,
)

START_TIMEOUT_S = 180.0  # for a new engine's socket (a Python start); its imports count against the call's deadline
STOP_TIMEOUT_S = 120.0
MESSAGE_LINE = ("flwr-verl: %s message, %s engine: %.2f s compute, %.2f s since the ClientApp process started "
                "(%.2f s of them before Flower called the app)")
STATE_KEY = "flwr_verl.error_feedback"  # compression.StateErrorFeedback.KEY (not imported: it pulls no torch, but
# keeps this module's imports to Flower's)
_CODE: list[str] = []


def default_engine_dir() -> Path:
    from flwr.supercore.utils import get_flwr_home

    return get_flwr_home() / "flwr-verl" / "engine"


LEDGER_KEY = "privacy-ledger"  # privacy.ledger's NODE_PRIVACY_LEDGER; that module imports torch (its accountant)


def default_ledger_path() -> Path:
    """``privacy.ledger.default_path()``, without importing torch (a test keeps the two equal)."""
    from flwr.supercore.utils import get_flwr_home

    return get_flwr_home() / "flwr-verl" / "privacy-ledger.sqlite"


def node_engine(node_config: dict[str, Any]) -> NodeEngineConfig:
    """The node's ``engine``, ``engine-dir`` and ``engine-idle-timeout-s``, checked."""
    return NodeEngineConfig.from_node_config(node_config, default_engine_dir())


def fresh_process_per_message() -> bool:
    """Whether this ClientApp runs in a process of its own for this message, ``flwr-clientapp``
    (a deployment's SuperNode starts one per message). Elsewhere (a simulation's Ray actors, a
    ClientApp called in a process that keeps running) the caller already stays up across
    messages, and the engine runs in it whatever node config ``engine`` says."""
    return Path(sys.argv[0]).name == "flwr-clientapp"


def this_code() -> str:
    if not _CODE:
        _CODE.append(code_digest())
    return _CODE[0]


def process_age_s() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class NoEngine(EngineUnavailable):
    """No engine serves the directory (and none was to be started)."""


class Engine:
    """The engine of one node (its directory), as seen by a ClientApp or ``flwr-verl engine``."""

    def __init__(self, settings: NodeEngineConfig) -> None:
        self.settings = settings
        self.directory = settings.directory
        self.log = self.directory / LOG

    # ------------------------------------------------------------------ connecting
    def connect(self) -> socket.socket | None:
        """A connection to the engine, or None when none serves the directory."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.directory / SOCKET
        try:
            if len(os.fsencode(path)) < 100:
                sock.connect(str(path))
            else:  # too long for sockaddr_un: reach it through an open descriptor of the directory
                fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    sock.connect(f"/proc/self/fd/{fd}/{SOCKET}")
                finally:
                    os.close(fd)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None

    def request(self, header: dict[str, Any], arrays: list[np.ndarray] = (), *, timeout: float,
                start: bool = True) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Send one request, return the reply; start the engine first when none runs (``start``)."""
        sock = self.connect() or (self.start() if start else None)
        if sock is None:
            raise NoEngine(f"no flwr-verl engine serves {self.directory}")
        with sock:
            token = (self.directory / TOKEN).read_text().strip()
            sock.settimeout(timeout)
            try:
                send_message(sock, {"token": token, "protocol": PROTOCOL_VERSION, "code": this_code(), **header},
                             arrays)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before it read everything: its reply says why
            try:
                reply = recv_header(sock)
                out = recv_arrays(sock, reply)
            except socket.timeout:
                raise EngineUnavailable(f"the node's engine sent no reply to {header.get('method', header['op'])} "
                                        f"within {timeout:g} s; its log: {self.log}") from None
            except (ConnectionError, EngineProtocolError) as error:
                raise self._died(header, error) from None
        if refused := reply.get("refused"):
            raise EngineRefused(f"the engine at {self.directory} refused this process: {refused}")
        return reply, out

    def _died(self, header: dict[str, Any], error: Exception) -> EngineUnavailable:
        what = header.get("method", header["op"])
        with contextlib.suppress(Exception):  # the next message tries again and reports why
            if sock := self.start(wait=False):  # warm again for the next message
                sock.close()
        return EngineUnavailable(f"the node's engine exited during {what} ({error}); a new one is starting for the "
                                 f"next message. End of {self.log}: {_tail(self.log)}")

    # ------------------------------------------------------------------ starting and stopping
    def start(self, wait: bool = True) -> socket.socket | None:
        """Start an engine unless one serves the directory (under a lock: one start at a time);
        return a connection to it (``wait``), else None at once."""
        private_dir(self.directory)
        with open(self.directory / "start.lock", "a") as lock:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:  # another ClientApp may be starting it: wait for the lock with a deadline
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EngineUnavailable(f"another process held {self.directory}/start.lock for "
                                                f"{START_TIMEOUT_S:g} s while starting the engine") from None
                    time.sleep(0.05)
            process = None
            while (sock := self.connect()) is None:
                # An engine that holds its lock but has no socket yet is starting: wait for it, start none.
                if not self._locked():
                    if process is None:
                        process = self._spawn()
                        if not wait:
                            return None
                    elif process.poll() is not None:
                        raise EngineUnavailable(f"the node's engine exited at start (code {process.returncode}): "
                                                f"{_tail(self.log)}")
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"the node's engine did not open {self.directory / SOCKET} within "
                                            f"{START_TIMEOUT_S:g} s; see {self.log}")
                time.sleep(0.05)
            return sock

    def _locked(self) -> bool:
        """Whether a live engine holds this directory's engine lock (it may still be starting)."""
        with open(self.directory / LOCK, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    def _spawn(self) -> subprocess.Popen:
        source = str(Path(__file__).resolve().parents[2])  # this flwr_verl's folder: the engine runs the same code
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])}
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # not its working directory on sys.path
        command = [sys.executable, *flags, "-m", "flwr_verl.federation.engine_server", "--dir", str(self.directory),
                   "--idle-timeout-s", f"{self.settings.idle_timeout_s:g}"]
        with open(self.log, "ab") as out:
            process = subprocess.Popen(command, env=env, cwd=self.directory, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        log(INFO, "flwr-verl: started the node's engine (pid %d; log %s)", process.pid, self.log)
        return process

    def status(self) -> dict[str, Any] | None:
        """The running engine's ping reply, or None."""
        try:
            return self.request({"op": "ping", "code": None}, timeout=STOP_TIMEOUT_S, start=False)[0]
        except NoEngine:
            return None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Ask the engine to exit after the call it is running; wait for it. False if none ran."""
        try:
            reply, _ = self.request({"op": "stop", "code": None}, timeout=timeout, start=False)
        except NoEngine:
            return False
        deadline = time.monotonic() + timeout
        while _alive(reply["pid"]):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the engine (pid {reply['pid']}) did not exit within {timeout:g} s")
            time.sleep(0.05)
        return True

    def call(self, op: str, header: dict[str, Any], arrays: list[np.ndarray], timeout: float):
        """One call; a call that changes nothing on the node (all but fit, whose ledger spend
        comes first) is sent once more when the engine died under it."""
        try:
            reply, out = self.request({"op": op, **header}, arrays, timeout=timeout)
        except EngineUnavailable as error:
            if header.get("method") == "fit" or "exited during" not in str(error):
                raise
            log(INFO, "flwr-verl: %s; sending the %s again", error, header.get("method", op))
            reply, out = self.request({"op": op, **header}, arrays, timeout=timeout)
        if reply.get("restart"):  # other code: replace it (after the call it is running) and ask the new one
            log(INFO, "flwr-verl: replacing the node's engine (pid %s): %s", reply.get("pid"), reply["restart"])
            self.stop(timeout)
            reply, out = self.request({"op": op, **header}, arrays, timeout=timeout)
        for level, line in reply.get("log", []):
            log(level, "%s", line)
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise remote_error(error.get("type", "EngineError"), error.get("message", str(reply)),
                               bool(error.get("user_error")))
        return reply, out



def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not; our own child is reaped)."""
    import psutil

    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class WarmClient(NumPyClient):
    """The ClientApp's client under ``engine = "warm"``: every call goes to the node's engine."""

    def __init__(self, context: Context, settings: NodeEngineConfig, called_at: float = 0.0) -> None:
        self.context, self.engine, self.called_at = context, Engine(settings), called_at
        run = context.run_config
        secagg = bool(run.get("secagg.enabled", True))
        self.fit_timeout = float(run.get("secagg.timeout", 300.0) if secagg else run.get("fit-timeout", 1800.0))
        self.evaluate_timeout = float(run.get("evaluate-timeout", 600.0))

    def _call(self, method: str, parameters: list[np.ndarray], config: dict[str, Any], timeout: float):
        state = self.context.state.array_records.get(STATE_KEY)
        residual = [] if state is None else state.to_numpy_ndarrays()
        header = {"method": method, "run_id": int(self.context.run_id), "node_id": int(self.context.node_id),
                  "run_config": encode_values(self.context.run_config),
                  "node_config": encode_values(self._node_config()), "config": encode_values(config),
                  "num_parameters": len(parameters)}
        reply, out = self.engine.call("call", header, [*parameters, *residual], timeout)
        results, kept = out[: reply["num_results"]], out[reply["num_results"]:]
        if reply.get("residual"):
            self.context.state.array_records[STATE_KEY] = ArrayRecord(kept)
        else:
            self.context.state.array_records.pop(STATE_KEY, None)
        # compute: the method alone, as for a cold client; the engine's config parsing and client
        # building count as overhead
        log(INFO, MESSAGE_LINE, method, "warm", reply["compute_seconds"], process_age_s(), self.called_at)
        return reply, results

    def _node_config(self) -> dict[str, Any]:
        """The node config, with the ledger's default path resolved here (the engine may have
        been started from another environment)."""
        node = dict(self.context.node_config)
        node.setdefault(LEDGER_KEY, str(default_ledger_path()))
        return node

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        reply, _ = self._call("get_properties", [], config, self.evaluate_timeout)
        return decode_values(reply["metrics"], "metrics")

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return self._call("get_parameters", [], config, self.evaluate_timeout)[1]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        reply, update = self._call("fit", parameters, config, self.fit_timeout)
        return update, reply["num_examples"], decode_values(reply["metrics"], "metrics")

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        reply, _ = self._call("evaluate", parameters, config, self.evaluate_timeout)
        return reply["loss"], reply["num_examples"], decode_values(reply["metrics"], "metrics")


class TimedClient(NumPyClient):
    """A cold client that logs each message's ``MESSAGE_LINE``, as ``WarmClient`` does."""

    def __init__(self, client: NumPyClient, called_at: float = 0.0) -> None:
        self.client, self.called_at = client, called_at

    def _timed(self, method: str, *args):
        start = time.perf_counter()
        result = getattr(self.client, method)(*args)
        log(INFO, MESSAGE_LINE, method, "cold", time.perf_counter() - start, process_age_s(), self.called_at)
        return result

    def get_properties(self, config):
        return self._timed("get_properties", config)

    def get_parameters(self, config):
        return self._timed("get_parameters", config)

    def fit(self, parameters, config):
        return self._timed("fit", parameters, config)

    def evaluate(self, parameters, config):
        return self._timed("evaluate", parameters, config)


def preload(settings: NodeEngineConfig, run_config: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """Start the engine (if needed) and load ``run_config``'s models into it, binding its base."""
    reply, _ = Engine(settings).call("preload", {"run_config": encode_values(run_config)}, [], timeout)
    return reply


def read_info(directory: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return json.loads((directory / INFO_FILE).read_text())
    return {}
