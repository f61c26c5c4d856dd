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

Used by the slow tests and by ``benchmarks/federation.py``.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from deploy.launch import base_env, flower_executable, free_port, kill_processes_with_env, write_run_config

APP = Path(__file__).resolve().parents[1]  # the Flower app: this repository


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


def flwr_run_simulation(env: dict[str, str], workdir: Path, run_config: dict, num_supernodes: int,
                        timeout: float, app: Path = APP) -> subprocess.CompletedProcess:
    """``flwr run <app> --stream`` on a local simulated federation; returns the finished process."""
    config_file = write_run_config(Path(workdir) / "run_config.toml", run_config)
    return subprocess.run(
        [flower_executable("flwr"), "run", str(app), "--stream",
         "--federation-config", f"num-supernodes={num_supernodes}", "--run-config", str(config_file)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )
