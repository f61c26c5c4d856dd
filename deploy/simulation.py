"""Run the app as a local Flower simulation (``flwr run <app> --stream``), isolated and cleaned up.

``flwr run`` on a simulated federation starts a local SuperLink that outlives it, reuses any
healthy SuperLink on its default ports whatever its FLWR_HOME, and starts Ray, which listens on
every interface unless told otherwise. So each run gets its own FLWR_HOME, SuperLink ports and
Ray temp dir, keeps Ray on 127.0.0.1, starts from its own working directory, and everything that
carries its FLWR_HOME in the environment (SuperLink, SuperExec, Ray workers) is killed after it::

    env = isolated_env(root)
    try:
        done = flwr_run_simulation(env, root, {"num-server-rounds": 2}, num_supernodes=3, timeout=600)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])

``flwr run`` gives the SuperLink it starts 15 s to answer, which a loaded machine overran
("Failed to start local SuperLink within 15s"). So ``flwr_run_simulation`` starts that SuperLink
itself, with Flower's own command line (``flwr/cli/local_superlink.py``), waits for its
``/health`` with a generous deadline, and stops it afterwards. ``flwr run`` reaches it by its
address (``write_cli_config``), not by Flower's ``:local:`` connection: that one probes
``/health`` with a 0.4 s timeout, which a loaded machine also overran, and then starts a second
SuperLink on the same ports.

Used by the slow tests and by ``benchmarks/``.
"""

from __future__ import annotations

import contextlib
import http.client
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

from deploy.launch import (
    HOST,
    _spawn,
    _tail,
    base_env,
    flower_executable,
    free_port,
    kill_processes,
    kill_processes_with_env,
    write_run_config,
)

APP = Path(__file__).resolve().parents[1]  # the Flower app: this repository
# The SuperLink took over 15 s to answer at load average 6-11 on 2 cores; this bounds a real hang.
SUPERLINK_STARTUP_TIMEOUT = 180.0


def ray_env() -> dict[str, str]:
    """Ray on loopback only, with a temp dir of its own (short: Ray's socket paths are length-limited)."""
    return {"RAY_TMPDIR": f"/tmp/ray-{uuid.uuid4().hex[:8]}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def isolated_env(root: Path) -> dict[str, str]:
    """The environment of one simulation run under ``root``: its own FLWR_HOME and ports."""
    flwr_home = Path(root).resolve() / "flwr_home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    return {
        **base_env(flwr_home, str(flwr_home.parent)),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        **ray_env(),
    }


def kill_tree_with_env(flwr_home: str) -> None:
    """Kill every process whose environment names this FLWR_HOME (they outlive ``flwr run``)."""
    kill_processes_with_env("FLWR_HOME", flwr_home)


def local_superlink_command(env: dict[str, str]) -> list[str]:
    """The command ``flwr run`` uses to start a local simulation SuperLink (Flower 1.42's
    ``_start_local_superlink``), on this environment's FLWR_HOME and ports."""
    runtime = Path(env["FLWR_HOME"]) / "local-superlink"
    return [flower_executable("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
            "--control-api-address", f"{HOST}:{env['FLWR_LOCAL_CONTROL_API_PORT']}",
            "--host", HOST, "--port", env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"],
            "--log-file", str(runtime / "superlink.log"), "--log-rotation-interval-hours", "24",
            "--log-rotation-backup-count", "7", "--database", str(runtime / "state.db")]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    """Poll ``url`` until it answers 2xx; ``RuntimeError`` naming ``what``, the deadline and the end
    of ``log`` when ``process`` exits first or ``timeout`` seconds pass."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    deadline = time.monotonic() + timeout
    while True:
        exited = process.poll() is not None  # before probing: an answer just before exit counts
        with contextlib.suppress(OSError, http.client.HTTPException):  # refused, reset, timed out: not up yet
            with opener.open(url, timeout=2) as response:
                if 200 <= response.status < 300:
                    return
        if exited:
            problem = f"it exited with code {process.returncode}"
        elif time.monotonic() > deadline:
            problem = f"{url} did not answer within {timeout:g} s"
        else:
            time.sleep(0.2)
            continue
        raise RuntimeError(f"waiting for {what}: {problem}; see {log}:\n{_tail(log)}")


@contextlib.contextmanager
def local_superlink(env: dict[str, str], workdir: Path, timeout: float = SUPERLINK_STARTUP_TIMEOUT):
    """A healthy local simulation SuperLink for ``env`` (the one ``flwr run`` would start), started
    from ``workdir``; it and everything it spawned are killed afterwards."""
    command = local_superlink_command(env)
    log = Path(env["FLWR_HOME"]) / "local-superlink" / "stdout.log"  # what it prints before its --log-file
    log.parent.mkdir(parents=True, exist_ok=True)
    process = _spawn(command, env, log, Path(workdir))
    try:
        wait_healthy(f"http://{HOST}:{env['FLWR_LOCAL_SUPERLINK_HTTP_API_PORT']}/health", process, timeout,
                     "the local SuperLink (" + " ".join(command) + ")", log)
        yield process
    finally:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(process.pid)
            kill_processes([*parent.children(recursive=True), parent])
        process.wait(timeout=30)


def write_cli_config(env: dict[str, str]) -> Path:
    """``FLWR_HOME/config.toml`` whose default connection, ``local``, is this environment's local
    SuperLink by address: what Flower's ``:local:`` connection resolves to once it finds that
    SuperLink healthy (``flwr/cli/local_superlink.py``), but without the probe."""
    import tomli_w  # Flower's own TOML writer (a dependency of flwr)
    from flwr.cli.flower_config import serialize_superlink_connection
    from flwr.cli.typing import SuperLinkConnection

    local = SuperLinkConnection(name="local", address=f"{HOST}:{env['FLWR_LOCAL_SUPERLINK_HTTP_API_PORT']}",
                                insecure=True)
    path = Path(env["FLWR_HOME"]) / "config.toml"
    path.write_text(tomli_w.dumps({"superlink": {"default": "local", "local": serialize_superlink_connection(local)}}))
    return path


def flwr_run_simulation(env: dict[str, str], workdir: Path, run_config: dict, num_supernodes: int,
                        timeout: float, app: Path = APP, capture: bool = True) -> subprocess.CompletedProcess:
    """``flwr run <app> --stream`` on a local simulated federation, on a SuperLink started (and
    stopped) here; returns the finished process (its output captured, or with ``capture=False``
    on this process's terminal)."""
    config_file = write_run_config(Path(workdir) / "run_config.toml", run_config)
    write_cli_config(env)
    with local_superlink(env, workdir):
        return subprocess.run(
            [flower_executable("flwr"), "run", str(app), "--stream",
             "--federation-config", f"num-supernodes={num_supernodes}", "--run-config", str(config_file)],
            cwd=workdir, env=env, capture_output=capture, text=True, timeout=timeout,
        )
