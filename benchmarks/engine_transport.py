"""How a fresh ClientApp process should reach its node's warm engine: a node-local Ray instance
with a detached named actor (verl's own design), or the project's Unix socket
(``flwr_verl/federation/engine_wire.py``). Only the transport is measured: both ends echo a 1 MB
array, no model behind them.

Goal: no target set; it decided the design (docs/deployment.md, "A warm engine per node").

    python benchmarks/engine_transport.py [--repeats 5]

Per transport: the start (Ray: ``ray start --head`` with token authentication on 127.0.0.1, then
creating the detached actor; socket: a Python process that imports ``engine_wire`` and listens),
and, in fresh processes as Flower starts one per message, the whole process's wall time and its
parts: the import, connecting, and the first call; then the per-call cost in a warm process (20
calls); and the resident memory of what stays up between messages (Ray's processes; the socket
server). Without the token, Ray refuses the caller (checked). Writes
``benchmarks/results/engine_transport.json``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import psutil

PAYLOAD = 1_000_000
RAY_PROBE = """
import json, time; t0 = time.perf_counter()
import ray; t1 = time.perf_counter()
ray.init(address="127.0.0.1:{port}", namespace="flwr-verl", log_to_driver=False); t2 = time.perf_counter()
actor = ray.get_actor("engine"); ray.get(actor.echo.remote(b"x" * {payload})); t3 = time.perf_counter()
for _ in range(20): ray.get(actor.echo.remote(b"x" * {payload}))
print(json.dumps({{"import_s": t1 - t0, "connect_s": t2 - t1, "first_call_s": t3 - t2,
                  "call_s": (time.perf_counter() - t3) / 20}}))
"""
RAY_ACTOR = """
import ray
ray.init(address="127.0.0.1:{port}", namespace="flwr-verl", log_to_driver=False)
@ray.remote
class Engine:
    def echo(self, data): return data
ray.get(Engine.options(name="engine", lifetime="detached").remote().echo.remote(b"x"))
"""
SOCKET_SERVER = """
import socket, sys
from flwr_verl.federation.engine_wire import recv_arrays, recv_header, send_message
listener = socket.socket(socket.AF_UNIX); listener.bind(sys.argv[1]); listener.listen(8)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    with conn:
        header = recv_header(conn); send_message(conn, {{}}, recv_arrays(conn, header))
"""
SOCKET_PROBE = """
import json, time; t0 = time.perf_counter()
import socket, numpy as np
from flwr_verl.federation.engine_wire import recv_arrays, recv_header, send_message
t1 = time.perf_counter()
def call():
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect({path!r}); send_message(sock, {{}}, [np.zeros({payload}, np.uint8)])
        return recv_arrays(sock, recv_header(sock))
call(); t2 = time.perf_counter()
for _ in range(20): call()
print(json.dumps({{"import_s": t1 - t0, "connect_s": 0.0, "first_call_s": t2 - t1,
                  "call_s": (time.perf_counter() - t2) / 20}}))
"""


def fresh(code: str, env: dict) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return {"process_s": time.perf_counter() - start, **json.loads(done.stdout.strip().splitlines()[-1])}


def tree_rss_mib(processes: list[psutil.Process]) -> float:
    total = 0
    for process in processes:
        for member in [process, *process.children(recursive=True)]:
            try:
                total += member.memory_info().rss
            except psutil.Error:
                pass
    return total / harness.MIB


def measure_ray(root: Path, repeats: int) -> dict:
    token = root / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    ray = str(Path(sys.executable).with_name("ray"))
    start = time.perf_counter()
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
                    "--include-dashboard", "false", "--temp-dir", str(root / "ray"), "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=300)
    cluster_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", RAY_ACTOR.format(port=port)], env=env, check=True, capture_output=True,
                       timeout=300)
        actor_s = time.perf_counter() - start
        probes = [fresh(RAY_PROBE.format(port=port, payload=PAYLOAD), env) for _ in range(repeats)]
        no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN_PATH"} | {"HOME": str(root)}
        refused = subprocess.run([sys.executable, "-c", RAY_PROBE.format(port=port, payload=1)], env=no_token,
                                 capture_output=True, text=True, timeout=300)
        ray_processes = [p for p in psutil.process_iter() if _environ(p).get("RAY_AUTH_TOKEN_PATH") == str(token)]
        rss = tree_rss_mib(ray_processes)
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=300)
    return {"start_s": cluster_s + actor_s, "cluster_start_s": cluster_s, "actor_create_s": actor_s,
            **summarize(probes), "resident_mib": rss,
            "refused_without_token": refused.returncode != 0 and "authentication" in refused.stderr.lower()}


def _environ(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except psutil.Error:
        return {}


def measure_socket(root: Path, repeats: int) -> dict:
    path = str(root / "s.sock")
    env = {**os.environ, "PYTHONPATH": str(harness.REPO)}
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-c", SOCKET_SERVER.format(), path], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        start_s = time.perf_counter() - start
        probes = [fresh(SOCKET_PROBE.format(path=path, payload=PAYLOAD), env) for _ in range(repeats)]
        rss = tree_rss_mib([psutil.Process(server.pid)])
    finally:
        server.kill()
        server.wait()
    return {"start_s": start_s, **summarize(probes), "resident_mib": rss}


def summarize(probes: list[dict]) -> dict:
    return {key: harness.spread([p[key] for p in probes]) for key in probes[0]}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "engine_transport.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fvt", dir="/tmp") as scratch:  # short: socket paths
        results = {"socket": measure_socket(Path(scratch), args.repeats),
                   "ray": measure_ray(Path(scratch), args.repeats)}
    for name, figures in results.items():
        print(f"{name}: start {figures['start_s']:.2f} s; fresh process {harness.format_spread(figures['process_s'], '.2f')} s "
              f"(import {figures['import_s']['median']:.2f}, connect {figures['connect_s']['median']:.2f}, first call "
              f"{figures['first_call_s']['median']:.3f}); warm call {1000 * figures['call_s']['median']:.1f} ms; "
              f"resident {figures['resident_mib']:.0f} MiB")
    harness.write_json(args.out, {"command": harness.command_line(), "payload_bytes": PAYLOAD, **results})


if __name__ == "__main__":
    main()
