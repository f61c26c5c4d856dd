"""Runs real Flower processes for the slow tests, isolated and cleaned up.

Each run gets its own FLWR_HOME, SuperLink ports and Ray temp dir, binds to 127.0.0.1 only,
starts from a neutral working directory, and every process that carries its FLWR_HOME in its
environment (SuperLink, SuperExec, SuperNodes, Ray workers) is killed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
FLWR = str(Path(sys.executable).with_name("flwr"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def isolated_env(root: Path) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path("/tmp") / f"ray-{os.getpid()}-{free_port()}"  # short: Ray's socket paths are length-limited
    env = {
        **os.environ,
        "FLWR_HOME": str(root / "flwr_home"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONUNBUFFERED": "1",
    }
    Path(env["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def kill_tree_with_env(flwr_home: str) -> None:
    """Kill every process whose environment names this FLWR_HOME (they outlive `flwr run`)."""
    victims = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get("FLWR_HOME") == flwr_home:
                victims.append(process)
    for process in victims:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(victims, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def write_run_config(path: Path, values: dict) -> Path:
    def literal(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(value)

    path.write_text("".join(f'"{key}" = {literal(value)}\n' for key, value in values.items()))
    return path


def flwr_run_simulation(env: dict[str, str], workdir: Path, run_config: dict, num_supernodes: int,
                        timeout: float) -> subprocess.CompletedProcess:
    """`flwr run <repo> --stream` on a local simulated federation; returns the finished process."""
    config_file = write_run_config(workdir / "run_config.toml", run_config)
    return subprocess.run(
        [FLWR, "run", str(REPO), "--stream", "--federation-config", f"num-supernodes={num_supernodes}",
         "--run-config", str(config_file)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )


def wait_for(predicate, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
