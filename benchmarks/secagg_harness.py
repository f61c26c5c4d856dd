"""The machinery behind the SecAgg+ benchmarks and tests: real Flower runs, isolated, and SecAgg+'s
arithmetic in process.

A run is a *spec* (JSON): the number of supernodes, each client's ``num_examples``, the update's
shapes and scales, and a list of *phases*. One phase is one configuration of the fit workflow:

- ``secagg``: ``None`` for Flower's default fit workflow, else the keyword arguments of
  ``SecAggPlusWorkflow`` (``secagg_clients.secagg_kwargs``: what ``derive_parameters`` derives);
- ``format``: what clients return, ``delta`` (new - global), ``weights`` or ``fixed`` (a fixed
  random update, the same every round: the protocol is measured, not RL), or ``client_level``
  (the fixed update encoded for client-level DP, ``client_level_output``; the phase then names
  its ``client_level`` config, a ``ClientLevelConfig`` as a dict); ``dtype``;
- ``rounds``; ``capture``: keep what the strategy received and its new (float64) weights.

``run_flower(spec)`` runs every phase in one ``flwr.simulation.run_simulation`` (Ray backend) in a
child process, each phase with a fresh ``FedProxAdapters`` strategy, and returns per phase the
fit-round times, the SecAgg+ stage times, the failures, peak memory (``harness.RssSampler``) and
what was captured. Clients are ``secagg_clients.FixedUpdateClient`` behind the project's
``secaggplus_when_requested``. ``secure_mean_in_process`` computes what SecAgg+ hands the
strategy for the same updates, with Flower's own SecAgg+ functions, without a run.

Isolation: the child has its own FLWR_HOME and Ray temp dir (``deploy.launch.base_env``,
``deploy.simulation.ray_env``), Ray binds to 127.0.0.1 (``_node_ip_address``), the listening
sockets of all its processes are recorded, and every process that carries the run's marker in
its environment is killed afterwards. Used by ``secagg_overhead.py``, ``secagg_precision.py`` and
``tests/federation/test_secagg.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import harness  # first: puts this checkout on sys.path
import numpy as np
# The ClientApp comes from an importable module, not __main__, for Ray to pickle it by reference;
# Flower passes the driver's sys.path (this folder on it) to the workers.
from secagg_clients import SPEC_ENV, client_app, initial_arrays

from deploy.launch import MARKER, base_env, kill_processes, processes_with_env
from deploy.simulation import ray_env


# ----------------------------------------------------------------------------- isolation check
def listening_sockets() -> list[dict]:
    """Every listening TCP and bound UDP socket of this run's processes: this one, its
    descendants, and any process that carries the run's marker (should Ray re-parent one)."""
    import socket

    import psutil

    me = psutil.Process()
    procs = {p.pid: p for p in [me, *me.children(recursive=True)]}
    marker = os.environ.get(MARKER)
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if marker and proc.pid not in procs and proc.environ().get(MARKER) == marker:
                procs[proc.pid] = proc
    found = []
    for proc in procs.values():
        with contextlib.suppress(psutil.Error):
            name = proc.name()
            for conn in proc.net_connections(kind="inet"):
                if conn.laddr and (conn.status == psutil.CONN_LISTEN or conn.type == socket.SOCK_DGRAM):
                    found.append({"process": name, "pid": proc.pid, "ip": conn.laddr.ip, "port": conn.laddr.port})
    return found


# ----------------------------------------------------------------------------- server side
def run_phase(grid, context, spec: dict, phase: dict, sampler: harness.RssSampler | None) -> dict:
    """One configuration: a fresh strategy at ``initial_arrays``, ``phase['rounds']`` fit rounds."""
    from flwr.common import parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.default_workflows import default_fit_workflow

    from flwr_verl.config import ClientLevelConfig, FederationConfig, SecAggConfig
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    secagg = phase.get("secagg")
    capture = phase.get("capture", False)

    class MeasuredStrategy(FedProxAdapters):
        """FedProxAdapters that tells clients the update format and records what it receives."""

        received: list = []
        failures_seen: list = []
        aggregated_rounds = 0

        def configure_fit(self, server_round, parameters, client_manager):
            instructions = super().configure_fit(server_round, parameters, client_manager)
            for _, fit_ins in instructions:
                fit_ins.config.update(update_format=phase["format"], update_dtype=phase["dtype"],
                                      client_level_config=json.dumps(phase.get("client_level") or {}))
            return instructions

        def aggregate_fit(self, server_round, results, failures):
            if capture:
                self.received = [(res.num_examples, dict(res.metrics), parameters_to_ndarrays(res.parameters))
                                 for _, res in results]
            self.failures_seen = [str(f) for f in failures]
            out = super().aggregate_fit(server_round, results, failures)
            self.aggregated_rounds += 1
            return out

    federation = FederationConfig(
        num_server_rounds=phase["rounds"], min_fit_clients=spec["num_supernodes"],
        min_available_clients=spec["num_supernodes"], min_evaluate_clients=spec["num_supernodes"],
        evaluate_every=0, fraction_evaluate=0.0, proximal_mu=0.0,
        secagg=SecAggConfig(enabled=bool(secagg)),
    )
    initial = initial_arrays(spec) if phase["format"] not in ("fixed", "client_level") else [np.zeros(s, np.float32) for s in spec["shapes"]]
    strategy = MeasuredStrategy(
        federation, initial, local_iterations=1,
        secure_aggregation=SecAggBounds(secagg["clipping_range"], secagg["max_weight"]) if secagg else None,
        client_level=ClientLevelConfig(**phase["client_level"]) if phase.get("client_level") else None,
    )
    stage_seconds: dict[str, list[float]] = {}

    class TimedSecAggPlusWorkflow(SecAggPlusWorkflow):
        """Flower's workflow, with the time of each of its four stages recorded."""

        def _timed(self, name, stage, *args):
            start = time.perf_counter()
            ok = stage(*args)
            stage_seconds.setdefault(name, []).append(time.perf_counter() - start)
            return ok

        def setup_stage(self, *args):
            return self._timed("setup", super().setup_stage, *args)

        def share_keys_stage(self, *args):
            return self._timed("share_keys", super().share_keys_stage, *args)

        def collect_masked_vectors_stage(self, *args):
            return self._timed("collect_masked_vectors", super().collect_masked_vectors_stage, *args)

        def unmask_stage(self, *args):
            return self._timed("unmask", super().unmask_stage, *args)

    inner = TimedSecAggPlusWorkflow(**secagg) if secagg else default_fit_workflow
    times: list[float] = []

    def timed_fit(grid_, legacy_) -> None:
        start = time.perf_counter()
        inner(grid_, legacy_)
        times.append(time.perf_counter() - start)

    before = sampler.begin() if sampler else None
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=phase["rounds"]), strategy=strategy)
    DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)
    result = {
        "name": phase["name"], "round_seconds": times, "aggregated_rounds": strategy.aggregated_rounds,
        "failures": strategy.failures_seen, "fit_metrics": strategy.state_dict()["last_round"].get("fit", {}),
        "client_level_account": strategy.client_level_account.to_json(),
        "memory": sampler.end(before) if sampler else None, "stage_seconds": stage_seconds,
    }
    if capture:
        result["received"] = strategy.received
        result["weights"] = [w.detach().numpy().copy() for w in strategy.weights]  # float64 server state
    return result


def make_server_app(spec: dict, results: dict):
    from flwr.server import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        if spec.get("pull_interval") is not None and hasattr(grid, "pull_interval"):
            grid.pull_interval = spec["pull_interval"]
        sampler = harness.RssSampler().start() if spec.get("memory") else None
        try:
            for phase in spec["phases"]:
                results["phases"].append(run_phase(grid, context, spec, phase, sampler))
                if "listeners" not in results:  # Ray and the client actors are up now
                    results["listeners"] = listening_sockets()
        finally:
            if sampler:
                sampler.stop()

    return app


def patch_vce_polling(interval: float) -> None:
    """Diagnosis only: shorten the simulation runtime's hard-coded 0.1 s wait for new messages.

    Flower 1.42's ``vce_api.add_messages_to_queue`` looks for messages to deliver to the
    simulated nodes every 0.1 s (not configurable). Patching it shows how much of SecAgg+'s
    overhead is this fixed per-stage latency rather than computation.
    """
    from flwr.server.superlink.fleet.vce import vce_api

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop) -> None:
        while not f_stop.is_set():
            for node_id in nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(interval)

    vce_api.add_messages_to_queue = add_messages_to_queue


def start_ray(init_args: dict, attempts: int = 3) -> None:
    """Start Ray as Flower's ``RayBackend.init_ray`` would, before ``run_simulation`` (which then
    reuses it). Ray gives a new node a fixed 30 s to register its raylet; a loaded 2-core machine
    can miss that, and Flower's simulation then hangs instead of exiting. Here a start that timed
    out is shut down and tried again, and the last failure is raised, so the child exits at once."""
    import ray

    # Ray's workers import the ClientApp: they need this process's sys.path, as Flower gives them.
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PYTHONPATH"] = pythonpath
    for attempt in range(1, attempts + 1):
        try:
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
            return
        except Exception as error:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(error) or attempt == attempts:
                raise
            print(f"secagg_harness: Ray did not start within its 30 s (attempt {attempt} of {attempts}); "
                  "trying again", flush=True)
            ray.shutdown()


def child_main(spec_path: str, result_path: str) -> None:
    """Runs in the child process: one ``run_simulation`` through all phases of ``spec``."""
    import logging

    from flwr.simulation import run_simulation

    os.environ[SPEC_ENV] = str(Path(spec_path).resolve())  # before Ray starts: its workers inherit it
    spec = json.loads(Path(spec_path).read_text())
    logging.getLogger("flwr").setLevel(logging.INFO if spec.get("verbose") else logging.WARNING)
    if spec.get("vce_poll_interval") is not None:
        patch_vce_polling(spec["vce_poll_interval"])
    results: dict = {"phases": []}
    start = time.perf_counter()
    start_ray({"num_cpus": spec.get("ray_cpus", 2), "num_gpus": 0, "_node_ip_address": "127.0.0.1",
               "include_dashboard": False, "logging_level": "ERROR", "log_to_driver": True,
               "object_store_memory": spec.get("object_store_bytes", 2 * 2**30)})
    run_simulation(
        server_app=make_server_app(spec, results), client_app=client_app,
        num_supernodes=spec["num_supernodes"],
        backend_config={"client_resources": {"num_cpus": spec.get("client_cpus", 1), "num_gpus": 0.0}},
    )
    results["simulation_seconds"] = time.perf_counter() - start
    with open(result_path, "wb") as handle:
        pickle.dump(results, handle)


# ----------------------------------------------------------------------------- parent side
class FlowerRunError(RuntimeError):
    """The child process failed, timed out, or a phase did not aggregate every round."""


def run_flower(spec: dict, timeout: float = 600, workdir: Path | None = None) -> dict:
    """Run ``spec`` in an isolated child process; return its results (and the leftover check)."""
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="secagg-")) if own_dir else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = {
        **base_env(workdir / "flwr_home", marker),
        **ray_env(),
        SPEC_ENV: str(workdir / "spec.json"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONPATH": os.pathsep.join([str(harness.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
    }
    spec_path, result_path, log_path = workdir / "spec.json", workdir / "result.pkl", workdir / "child.log"
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path),
                                     "--result", str(result_path)], cwd=workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
    finally:
        victims = processes_with_env(MARKER, marker)
        kill_processes(victims)
        killed, leftover = len(victims), [p.pid for p in processes_with_env(MARKER, marker)]
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    log_text = log_path.read_text(errors="replace")
    if code != 0 or not result_path.exists():
        what = f"timed out after {timeout:.0f} s" if code is None else f"exited with {code}"
        raise FlowerRunError(f"Flower run {what}; log {log_path}:\n{log_text[-6000:]}")
    with open(result_path, "rb") as handle:
        results = pickle.load(handle)
    results.update(wall_seconds=time.perf_counter() - started, killed_after=killed, leftover_pids=leftover,
                   log=log_text)
    if own_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------- SecAgg+ in process
def secure_mean_in_process(updates: list[list[np.ndarray]], num_examples: list[int], workflow: dict,
                           seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """What ``SecAggPlusWorkflow`` hands the strategy for these clients' updates, computed in this
    process with Flower's own SecAgg+ functions: each client's weighting, quantization, private
    and pairwise masks and reduction as ``secaggplus_mod``'s fit stage does them, then the
    server's sum modulo the modulus, the private masks' removal (pairwise ones cancel) and its
    dequantization, as ``SecAggPlusWorkflow``'s unmask stage does them. Keys and secret shares
    are left out: they decide which masks are drawn, never an integer of the result. Returns the
    mean and each client's masked integer arrays (what it uploads)."""
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_combine,
        factor_extract,
        parameters_addition,
        parameters_mod,
        parameters_multiply,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize, quantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    q, c, m, w = (workflow[k] for k in ("quantization_range", "clipping_range", "modulus_range", "max_weight"))
    rng = np.random.default_rng(seed)
    k = len(updates)
    private = [rng.bytes(32) for _ in range(k)]
    pairwise = {(i, j): rng.bytes(32) for i in range(k) for j in range(i + 1, k)}
    uploads = []
    for i, (update, n) in enumerate(zip(updates, num_examples, strict=True)):
        q_ratio = round(n / w * q)
        vector = factor_combine(q_ratio, quantize(parameters_multiply(update, q_ratio / q), c, q))
        shapes = [a.shape for a in vector]
        vector = parameters_addition(vector, pseudo_rand_gen(private[i], m, shapes))
        for j in range(k):
            if j != i:
                mask = pseudo_rand_gen(pairwise[min(i, j), max(i, j)], m, shapes)
                vector = parameters_addition(vector, mask) if i > j else parameters_subtraction(vector, mask)
        uploads.append(parameters_mod(vector, m))
    total = uploads[0]
    for vector in uploads[1:]:
        total = parameters_addition(total, vector)
    for i in range(k):
        total = parameters_subtraction(parameters_mod(total, m), pseudo_rand_gen(private[i], m, shapes))
    q_total, total = factor_extract(parameters_mod(total, m))
    mean = [(a - (k - 1) * c) * (q / q_total) for a in dequantize(total, c, q)]
    return mean, uploads


def main() -> None:
    """``--child SPEC --result FILE``: what ``run_flower`` starts in the child process."""
    import argparse

    parser = argparse.ArgumentParser(description="child process of run_flower (not for direct use)")
    parser.add_argument("--child", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    child_main(args.child, args.result)


if __name__ == "__main__":
    main()
