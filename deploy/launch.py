"""Start and stop a local Flower deployment: one SuperLink and N SuperNodes on 127.0.0.1.

One role: bring up (and tear down) the processes that ``flwr run . <connection>`` talks to on a
single machine, each SuperNode with its own data partition, optionally with TLS and SuperNode
authentication. Everything binds to 127.0.0.1 and lives under one directory::

    python deploy/launch.py up --dir /tmp/fl --supernodes 3 [--tls] [--auth]
    FLWR_HOME=/tmp/fl/flwr_home flwr run . local-deployment --stream --run-config my.toml
    python deploy/launch.py down --dir /tmp/fl

``up`` writes, under ``--dir``:

- ``flwr_home/config.toml``: the ``local-deployment`` connection for the ``flwr`` CLI
  (``FLWR_HOME`` must point here when running ``flwr run`` / ``flwr ls`` / ``flwr log``);
- ``commands.sh``: the exact ``flower-superlink``, ``flwr supernode register`` and
  ``flower-supernode`` command lines it ran, to copy onto real machines;
- ``certs/`` (``--tls``): a throwaway CA, the SuperLink's certificate and key;
- ``keys/`` (``--auth``): one OpenSSH ECDSA key pair per SuperNode, registered with the SuperLink;
- ``superlink.log``, ``supernode-<i>.log``, ``deployment.json`` (ports, process ids);
- ``supernode-<i>/flwr_home/flwr-verl/engine/``: each node's warm engine (socket, token, log), once
  its first ClientApp has started it (``--engine cold``: none).

Every process it starts carries ``FLWR_VERL_DEPLOYMENT=<dir>`` in its environment; ``down``
(and ``LocalDeployment.stop``) ends every process with that marker, including the SuperExec and
ServerApp/ClientApp processes Flower spawns. From Python (the tests do this)::

    with LocalDeployment(Path("/tmp/fl"), num_supernodes=3, tls=True, auth=True) as fed:
        fed.flwr_run(Path("."), {"num-server-rounds": 2})
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

if __package__ in (None, ""):  # run as a script: make `deploy` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.certs import NodeKey, TlsFiles, make_node_key, make_tls  # noqa: E402

MARKER = "FLWR_VERL_DEPLOYMENT"
CONNECTION = "local-deployment"
HOST = "127.0.0.1"
BIN = Path(sys.executable).parent


def flower_executable(name: str) -> str:
    """The Flower command ``name`` of this interpreter's environment (else from PATH)."""
    path = BIN / name
    return str(path) if path.exists() else name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def processes_with_env(key: str, value: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get(key) == value:
                found.append(process)
    return found


def kill_processes(processes: list[psutil.Process], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace)


def kill_processes_with_env(key: str, value: str, grace: float = 5.0) -> None:
    """End every process whose environment has ``key=value`` (they outlive their parents)."""
    kill_processes(processes_with_env(key, value), grace)


def base_env(flwr_home: Path, marker: str) -> dict[str, str]:
    """Offline, quiet, isolated: no dependency installs, update checks or telemetry."""
    return {
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        MARKER: marker,
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class SuperNode:
    index: int
    port: int
    log: Path
    flwr_home: Path
    key: NodeKey | None = None
    process: subprocess.Popen | None = None
    log_start: int = 0  # where this start's output begins in the (appended) log
    node_config: dict = field(default_factory=dict)


class LocalDeployment:
    """One SuperLink and ``num_supernodes`` SuperNodes on 127.0.0.1, under ``root``."""

    def __init__(self, root: Path, num_supernodes: int, *, tls: bool = False, auth: bool = False,
                 port: int | None = None, node_config: dict[int, dict] | None = None,
                 connection: str = CONNECTION, engine: str | None = None) -> None:
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS (Flower refuses --enable-supernode-auth with "
                             "--insecure)")
        self.root = Path(root).resolve()
        self.num_supernodes = num_supernodes
        self.tls, self.auth = tls, auth
        self.port = port or free_port()
        self.connection = connection
        self.flwr_home = self.root / "flwr_home"
        self.certs: TlsFiles | None = None
        self.superlink: subprocess.Popen | None = None
        self.superlink_log = self.root / "superlink.log"
        self.commands: list[str] = []
        self.supernodes = [
            SuperNode(i, free_port(), self.root / f"supernode-{i}.log", self.root / f"supernode-{i}" / "flwr_home",
                      node_config={"partition-id": i, "num-partitions": num_supernodes,
                                   **({"engine": engine} if engine else {}), **(node_config or {}).get(i, {})})
            for i in range(num_supernodes)
        ]

    # ------------------------------------------------------------------ environment
    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment for the ``flwr`` CLI (and the SuperLink): FLWR_HOME holds the connection."""
        return base_env(self.flwr_home, str(self.root))

    def _record(self, command: list[str], env_note: str = "") -> None:
        self.commands.append((env_note + " " if env_note else "") + " ".join(_quote(c) for c in command))

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.certs = make_tls(self.root / "certs")
        self.start_superlink()
        self.write_connection()
        for node in self.supernodes:
            if self.auth:
                node.key = make_node_key(self.root / "keys", f"supernode-{node.index}")
                self.register(node.key)
            self.start_supernode(node.index)
        for node in self.supernodes:
            self.wait_supernode(node.index)
        self.save_state()

    def start_superlink(self) -> None:
        command = [flower_executable("flower-superlink"), "--host", HOST, "--port", str(self.port),
                   "--database", str(self.root / "state.db"), "--disable-runtime-dependency-installation"]
        if self.tls:
            command += ["--ssl-ca-certfile", str(self.certs.ca_cert), "--ssl-certfile", str(self.certs.server_cert),
                        "--ssl-keyfile", str(self.certs.server_key)]
        else:
            command += ["--insecure"]
        if self.auth:
            command += ["--enable-supernode-auth"]
        self._record(command, f"FLWR_HOME={self.flwr_home}")
        start = self.superlink_log.stat().st_size if self.superlink_log.exists() else 0  # a restart appends
        self.superlink = _spawn(command, self.env, self.superlink_log, self.root, append=True)
        wait_for_line(self.superlink, self.superlink_log, "Uvicorn running on", 60, what="the SuperLink to start",
                      start=start)

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and everything it spawned (SuperExec, a running ServerApp), as a
        crash of the server's machine would. Its database (``state.db``) stays; the SuperNodes
        keep running and reconnect once ``start_superlink`` has brought it back."""
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(self.superlink.pid)
            victims = [parent, *parent.children(recursive=True)]
            for process in victims:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(victims, timeout=10)
        self.superlink.wait(timeout=10)

    def online_supernodes(self) -> int:
        """How many SuperNodes the SuperLink counts as online (``flwr supernode ls``)."""
        done = subprocess.run([flower_executable("flwr"), "supernode", "ls", self.connection, "--format", "json"],
                              env=self.env, cwd=self.root, capture_output=True, text=True, timeout=60)
        try:
            nodes = json.loads(done.stdout).get("nodes", [])
        except json.JSONDecodeError:
            return 0
        return sum(node.get("status") == "online" for node in nodes)

    def wait_online(self, count: int, timeout: float = 120) -> None:
        """Wait until exactly ``count`` SuperNodes are online (a SIGKILLed node stays online
        until its heartbeat lapses; a restarted SuperLink waits for the nodes to reconnect)."""
        deadline = time.monotonic() + timeout
        while (online := self.online_supernodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {count} SuperNodes online: {online} after {timeout:g} s; "
                                   f"see {self.root}/supernode-*.log and {self.superlink_log}")
            time.sleep(1)

    def write_connection(self) -> None:
        lines = ["[superlink]", f'default = "{self.connection}"', "", f"[superlink.{self.connection}]",
                 f'address = "{self.address}"']
        lines += [f'root-certificates = "{self.certs.ca_cert}"'] if self.tls else ["insecure = true"]
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n")

    def register(self, key: NodeKey) -> None:
        command = [flower_executable("flwr"), "supernode", "register", str(key.public_key), self.connection]
        self._record(command, f"FLWR_HOME={self.flwr_home}")
        done = subprocess.run(command, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode register failed:\n{done.stdout}\n{done.stderr}")

    def supernode_command(self, index: int, key: Path | None = None, *, port: int | None = None,
                          root_certificates: Path | None = None, insecure: bool | None = None) -> list[str]:
        """The ``flower-supernode`` command line of SuperNode ``index`` (overrides for tests of refusals)."""
        node = self.supernodes[index]
        node_config = " ".join(f"{k}={_toml_value(v)}" for k, v in node.node_config.items())
        insecure = (not self.tls) if insecure is None else insecure
        tls = ["--insecure"] if insecure else ["--root-certificates", str(root_certificates or self.certs.ca_cert)]
        command = [flower_executable("flower-supernode"), *tls, "--superlink", self.address,
                   "--node-config", node_config, "--host", HOST, "--port", str(port or node.port)]
        key = key or (node.key.private_key if node.key else None)
        if key:
            command += ["--auth-supernode-private-key", str(key)]
        return command

    def start_supernode(self, index: int, command: list[str] | None = None) -> subprocess.Popen:
        node = self.supernodes[index]
        node.flwr_home.mkdir(parents=True, exist_ok=True)
        command = command or self.supernode_command(index)
        self._record(command, f"FLWR_HOME={node.flwr_home}")
        node.log_start = node.log.stat().st_size if node.log.exists() else 0  # the log is appended to
        node.process = _spawn(command, base_env(node.flwr_home, str(self.root)), node.log, node.flwr_home.parent,
                              append=True)
        return node.process

    def wait_supernode(self, index: int, timeout: float = 60) -> None:
        node = self.supernodes[index]
        wait_for_line(node.process, node.log, "SuperNode ID:", timeout, what=f"SuperNode {index} to connect",
                      start=node.log_start)

    def kill_supernode(self, index: int, graceful: bool = True) -> None:
        """Kill a SuperNode and everything it spawned (SuperExec, a running ClientApp).

        The children get SIGKILL, so a ClientApp in the middle of a fit never answers. The
        SuperNode itself gets SIGTERM when ``graceful`` (it tells the SuperLink it is leaving, which
        then answers the node's pending messages with "node unavailable" at once), else SIGKILL
        (the SuperLink notices only when the node's heartbeat lapses: up to 60 s in Flower 1.42).
        """
        node = self.supernodes[index]
        if node.process is None or node.process.poll() is not None:
            return
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(node.process.pid)
            children = parent.children(recursive=True)
            for process in children:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(children, timeout=10)
            parent.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            node.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait(timeout=10)

    def stop(self) -> None:
        kill_processes_with_env(MARKER, str(self.root))
        for process in [self.superlink, *(n.process for n in self.supernodes)]:
            if process is not None:
                with contextlib.suppress(Exception):
                    process.wait(timeout=5)

    def save_state(self) -> None:
        script = "#!/bin/sh\n# what deploy/launch.py ran\n" + "\n".join(self.commands) + "\n"
        (self.root / "commands.sh").write_text(script)
        state = {"root": str(self.root), "address": self.address, "connection": self.connection, "tls": self.tls,
                 "auth": self.auth, "flwr_home": str(self.flwr_home),
                 "superlink_pid": self.superlink.pid if self.superlink else None,
                 "supernodes": [{"index": n.index, "port": n.port, "pid": n.process.pid if n.process else None,
                                 "node_config": n.node_config, "log": str(n.log)} for n in self.supernodes]}
        (self.root / "deployment.json").write_text(json.dumps(state, indent=1))

    # ------------------------------------------------------------------ running the app
    def flwr_run(self, app: Path, run_config: dict | None = None, *, timeout: float = 600,
                 extra_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """``flwr run <app> <connection> --stream [--run-config file]``; returns the finished CLI process."""
        return subprocess.run(self.flwr_run_command(app, run_config, extra_args), env=self.env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout)

    def flwr_verl_run(self, app: Path, run_config: dict | None = None, *,
                      timeout: float = 600) -> subprocess.CompletedProcess:
        """``flwr-verl run <app> <connection> --run-config FILE --timeout T``: ``flwr run --stream``
        whose exit code is the run's outcome (0 completed, 1 failed, 2 invalid config, 3 timed out)."""
        command = [sys.executable, "-m", "flwr_verl.tools.cli", "run", str(app), self.connection, "--timeout", f"{timeout:g}"]
        if run_config:
            command += ["--run-config", str(write_run_config(self.root / f"run_config_{time.time_ns()}.toml",
                                                             run_config))]
        return subprocess.run(command, env=self.env, cwd=self.root, capture_output=True, text=True,
                              timeout=timeout + 300)

    def flwr_run_background(self, app: Path, run_config: dict | None, log: Path) -> subprocess.Popen:
        """The same ``flwr run``, started with its output going to ``log``."""
        return _spawn(self.flwr_run_command(app, run_config), self.env, log, self.root)

    def flwr_run_command(self, app: Path, run_config: dict | None, extra_args: tuple[str, ...] = ()) -> list[str]:
        command = [flower_executable("flwr"), "run", str(app), self.connection, "--stream", *extra_args]
        if run_config:
            path = write_run_config(self.root / f"run_config_{time.time_ns()}.toml", run_config)
            command += ["--run-config", str(path)]
        return command

    def flwr_ls(self) -> list[dict]:
        """``flwr ls <connection> --format json``: the runs the SuperLink knows, oldest first."""
        done = subprocess.run([flower_executable("flwr"), "ls", self.connection, "--format", "json"], env=self.env,
                              cwd=self.root, capture_output=True, text=True, timeout=60)
        try:
            runs = json.loads(done.stdout).get("runs", [])
        except json.JSONDecodeError:
            return []
        return sorted(runs, key=lambda r: str(r.get("pending-at", "")))

    def run_status(self, flwr_run_output: str) -> str | None:
        """The SuperLink's status (``finished:completed``, ``finished:failed``, ...) of the run that a
        ``flwr run`` output names (``flwr run`` itself exits 0 either way)."""
        match = re.search(r"Successfully started run (\d+)", flwr_run_output)
        runs = {r.get("run-id"): r for r in self.flwr_ls()}
        return runs.get(match[1], {}).get("status") if match else None

    def serverapp_processes(self) -> list[psutil.Process]:
        return [p for p in processes_with_env(MARKER, str(self.root))
                if any("flwr-serverapp" in part for part in _cmdline(p))]


# ----------------------------------------------------------------------------- helpers
def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


def _quote(text: str) -> str:
    if text and all(c.isalnum() or c in "-_./:=@," for c in text):
        return text
    return "'" + text.replace("'", "'\\''") + "'"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def write_run_config(path: Path, values: dict) -> Path:
    """A TOML file of run-config overrides (what ``flwr run --run-config FILE`` reads)."""
    path.write_text("".join(f'"{key}" = {_toml_value(value)}\n' for key, value in values.items()))
    return path


def _spawn(command: list[str], env: dict[str, str], log: Path, cwd: Path, append: bool = False) -> subprocess.Popen:
    handle = open(log, "ab" if append else "wb")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        handle.close()


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def wait_for_line(process: subprocess.Popen, log: Path, needle: str, timeout: float, what: str,
                  start: int = 0) -> None:
    """Follow ``log`` from byte ``start`` as ``process`` writes it (``tail -f``) until ``needle`` appears.

    The processes write to files, not pipes, because they outlive ``deploy/launch.py up``; so this
    reads what is new every 50 ms. ``start`` skips what an earlier run of the same process wrote to
    an appended log. Raises ``RuntimeError`` naming ``what`` was awaited, with the end of the log,
    when the process exits first or ``timeout`` seconds pass.
    """
    deadline = time.monotonic() + timeout
    seen = ""
    with open(log, "rb") as handle:
        handle.seek(start)
        while True:
            exited = process.poll() is not None  # before reading: a line written just before exit counts
            seen += handle.read().decode(errors="replace")
            if needle in seen:
                return
            if exited:
                problem = f"the process exited with code {process.returncode}"
            elif time.monotonic() > deadline:
                problem = f"no {needle!r} after {timeout:.0f} s"
            else:
                time.sleep(0.05)
                continue
            raise RuntimeError(f"waiting for {what}: {problem}; see {log}:\n{_tail(log)}")


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a SuperLink and N SuperNodes (they keep running)")
    up.add_argument("--dir", type=Path, required=True, help="directory for keys, logs and FLWR_HOME")
    up.add_argument("--supernodes", type=int, default=3)
    up.add_argument("--port", type=int, default=9093, help="SuperLink port (Fleet, Control and Runtime APIs)")
    up.add_argument("--tls", action="store_true", help="generate a throwaway CA and serve over TLS")
    up.add_argument("--auth", action="store_true", help="register one key per SuperNode; implies --tls")
    up.add_argument("--engine", choices=("warm", "cold"), help="node config engine of every SuperNode (default: "
                    "the app's, warm: one engine process per node, kept across messages)")
    down = sub.add_parser("down", help="stop every process started under --dir")
    down.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "down":
        root = args.dir.resolve()
        victims = processes_with_env(MARKER, str(root))
        kill_processes(victims)
        print(f"stopped {len(victims)} processes under {root}")
        return

    deployment = LocalDeployment(args.dir, args.supernodes, tls=args.tls or args.auth, auth=args.auth, port=args.port,
                                 engine=args.engine)
    try:
        deployment.start()
    except BaseException:
        deployment.stop()
        raise
    print(f"SuperLink {deployment.address} ({'TLS' if deployment.tls else 'insecure'}"
          f"{', SuperNode auth' if deployment.auth else ''}), {args.supernodes} SuperNodes; logs in {deployment.root}")
    print(f"commands: {deployment.root / 'commands.sh'}")
    print(f"run:  FLWR_HOME={deployment.flwr_home} flwr run . {deployment.connection} --stream")
    print(f"stop: python {Path(__file__).as_posix()} down --dir {deployment.root}")


if __name__ == "__main__":
    main()
