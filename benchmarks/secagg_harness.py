"""The machinery behind the SecAgg+ benchmarks and tests: real Flower runs, isolated, in-process.

A run is a *spec* (JSON): the number of supernodes, each client's ``num_examples``, the update's
shapes and scales, and a list of *phases*. One phase is one configuration of the fit workflow:

- ``secagg``: ``None`` for Flower's default fit workflow, else the keyword arguments of
  ``SecAggPlusWorkflow`` (``secagg_kwargs``: what ``derive_parameters`` derives);
- ``format``: what clients return, ``delta`` (new - global), ``weights`` or ``fixed`` (a fixed
  random update, the same every round: the protocol is measured, not RL), or ``client_level``
  (the fixed update encoded for client-level DP, ``client_level_output``; the phase then names
  its ``client_level`` config, a ``ClientLevelConfig`` as a dict); ``dtype``;
- ``rounds``; ``capture``: keep what the strategy received and its new (float64) weights.

``run_flower(spec)`` runs every phase in one ``flwr.simulation.run_simulation`` (Ray backend) in a
child process, each phase with a fresh ``FedProxAdapters`` strategy, and returns per phase the
fit-round times, the SecAgg+ stage times, the failures, peak memory (``RssSampler``) and what was
captured. Clients are ``FixedUpdateClient`` behind the project's ``secaggplus_when_requested``.

Isolation: the child has its own FLWR_HOME and Ray temp dir (``deploy.launch.base_env``,
``deploy.simulation.ray_env``), Ray binds to 127.0.0.1 (``_node_ip_address``), the listening
sockets of all its processes are recorded, and every process that carries the run's marker in
its environment is killed afterwards. Used by ``secagg_overhead.py``, ``secagg_precision.py`` and
``tests/federation/test_secagg.py``.

The benchmark scripts import this file as the top-level module ``secagg_harness`` (their folder
is on ``sys.path``), not as ``benchmarks.secagg_harness``: Opacus installs a top-level package
named ``benchmarks`` that would shadow this folder.
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
import threading
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's flwr_verl and deploy, before any installed copy

from flwr.app import Context  # noqa: E402
from flwr.client import Client, ClientApp, NumPyClient  # noqa: E402

from deploy.launch import MARKER, base_env, kill_processes, processes_with_env  # noqa: E402
from deploy.simulation import ray_env  # noqa: E402
from flwr_verl.federation.mods import secaggplus_when_requested  # noqa: E402
from flwr_verl.federation.protocol import STATUS_OK, FitConfig, FitReport  # noqa: E402
from flwr_verl.federation.secagg import check_update, exact_update  # noqa: E402

SPEC_ENV = "FLWR_VERL_SECAGG_SPEC"  # env var: path of the run's spec (JSON)
NUM_EXAMPLES = (96, 256, 480)  # per partition, unequal; max-weight 2 * train_size = 500 covers them
# Not a power of two on purpose: with max-weight 2**k the weights n / max-weight land on SecAgg+'s
# quantization grid, and so do many float32-derived updates, which hides most rounding error.
TRAIN_SIZE = 250


# ----------------------------------------------------------------------------- client side
_CACHE: dict = {}


def initial_arrays(spec: dict) -> list[np.ndarray]:
    """The global adapter before the round: |w| <= weight_scale, float32 as the server sends it."""
    rng = np.random.default_rng([spec["seed"], 1_000_003])
    return [rng.uniform(-spec["weight_scale"], spec["weight_scale"], size=s).astype(np.float32)
            for s in spec["shapes"]]


def client_new_weights(spec: dict, partition_id: int) -> list[np.ndarray]:
    """A client's locally trained adapter (float32): the initial one plus |delta| <= delta_scale."""
    key = ("new", partition_id, json.dumps(spec["shapes"]), spec["seed"], spec["delta_scale"], spec["weight_scale"])
    if key not in _CACHE:
        rng = np.random.default_rng([spec["seed"], partition_id])
        _CACHE[key] = [(w + rng.uniform(-spec["delta_scale"], spec["delta_scale"], size=w.shape)
                        .astype(np.float32)).astype(np.float32) for w in initial_arrays(spec)]
    return _CACHE[key]


def fixed_update(spec: dict, partition_id: int) -> list[np.ndarray]:
    """Random float32 update of the given shapes, the same every round (benchmark: no training)."""
    key = ("fixed", partition_id, json.dumps(spec["shapes"]), spec["seed"], spec["delta_scale"])
    if key not in _CACHE:
        rng = np.random.default_rng([spec["seed"], partition_id])
        _CACHE[key] = [rng.uniform(-spec["delta_scale"], spec["delta_scale"], size=s).astype(np.float32)
                       for s in spec["shapes"]]
    return _CACHE[key]


def client_output(spec: dict, partition_id: int, parameters: list[np.ndarray], update_format: str,
                  dtype: str) -> list[np.ndarray]:
    """What a client returns from ``fit``.

    - ``delta``: new - global. In float32 this is ``VerlClient``'s arithmetic (float32 arrays);
      in float64 it is ``flwr_verl.federation.secagg.exact_update``: exact, and finely quantized by SecAgg+.
    - ``weights``: the new weights themselves.
    - ``fixed``: a fixed random update (benchmark).
    """
    if update_format == "fixed":
        return [a.astype(dtype, copy=False) for a in fixed_update(spec, partition_id)]
    new = client_new_weights(spec, partition_id)
    if update_format == "weights":
        return [a.astype(dtype) for a in new]
    if dtype == "float32":
        return [n - np.asarray(p, dtype=np.float32) for n, p in zip(new, parameters)]
    return exact_update(new, parameters)


def client_level_output(spec: dict, phase_config: dict, partition_id: int, server_round: int, num_clients: int,
                        threshold: int) -> list[np.ndarray]:
    """The fixed update encoded for client-level DP (``distributed_dp.encode_update``), with noise
    seeded by (seed, round, partition): a test recomputes exactly what each client handed SecAgg+."""
    from flwr_verl.config import ClientLevelConfig
    from flwr_verl.privacy.distributed_dp import encode_update, plan_round

    update = fixed_update(spec, partition_id)
    plan = plan_round(ClientLevelConfig(**phase_config), sum(a.size for a in update), num_clients, threshold)
    return encode_update(update, plan, server_round, np.random.default_rng([spec["seed"], server_round, partition_id]))


def run_spec() -> dict:
    """The spec of the current run (the child and its Ray workers find it through ``SPEC_ENV``)."""
    path = os.environ[SPEC_ENV]
    if _CACHE.get("spec_path") != path:
        _CACHE.clear()
        _CACHE.update(spec_path=path, spec=json.loads(Path(path).read_text()))
    return _CACHE["spec"]


class FixedUpdateClient(NumPyClient):
    """Returns deterministic updates seeded by its partition id; checks them like ``VerlClient``."""

    def __init__(self, partition_id: int) -> None:
        self.partition_id = partition_id

    def fit(self, parameters, config):
        spec = run_spec()
        num_examples = int(spec["num_examples"][self.partition_id])
        instructions = FitConfig.from_config(config)
        secagg = instructions.secagg
        if config["update_format"] == "client_level":
            num_examples = 1  # the weight SecAgg+ is set up for (distributed_dp.integer_secagg_parameters)
            update = client_level_output(spec, json.loads(str(config["client_level_config"])), self.partition_id,
                                         instructions.server_round, instructions.client_level.num_clients,
                                         instructions.client_level.threshold)
        else:
            update = client_output(spec, self.partition_id, parameters, str(config["update_format"]),
                                   str(config["update_dtype"]))
        if secagg and config["update_format"] != "client_level":
            check_update(update, num_examples, secagg.clipping_range, secagg.max_weight)
        report = FitReport(status=STATUS_OK, partition_id=self.partition_id, client_id=str(self.partition_id),
                           bytes_received=0, bytes_sent=0)
        return update, num_examples, {**report.to_metrics(), "probe": 1000 + self.partition_id,
                                      "loss_like": 0.1 * (self.partition_id + 1)}


def client_fn(context: Context) -> Client:
    return FixedUpdateClient(int(context.node_config["partition-id"])).to_client()


# Module level, so Ray pickles it by reference and each actor keeps its own update cache.
# The project's mod: secaggplus_mod on SecAgg+ messages, so one ClientApp serves plain and
# secure rounds (flwr_verl.federation.mods imports Flower only, which keeps the Ray actors light).
client_app = ClientApp(client_fn=client_fn, mods=[secaggplus_when_requested])


# ----------------------------------------------------------------------------- measurement helpers
class RssSampler:
    """Peak RSS of this process and of all its descendants, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.interval = interval
        self.procs: list = []
        self.peak_self = self.peak_all = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._refreshed = 0.0

    def _sample(self) -> tuple[int, int]:
        now = time.monotonic()
        if now - self._refreshed > 2.0:
            with contextlib.suppress(self._psutil.Error):
                self.procs = self.me.children(recursive=True)
            self._refreshed = now
        own = self.me.memory_info().rss
        total = own
        for proc in self.procs:
            with contextlib.suppress(self._psutil.Error):
                total += proc.memory_info().rss
        return own, total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            own, total = self._sample()
            with self._lock:
                self.peak_self, self.peak_all = max(self.peak_self, own), max(self.peak_all, total)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def begin(self) -> dict:
        self._refreshed = 0.0
        own, total = self._sample()
        with self._lock:
            self.peak_self, self.peak_all = own, total
        return {"self": own, "all": total}

    def end(self, before: dict) -> dict:
        with self._lock:
            peak_self, peak_all = self.peak_self, self.peak_all
        mib = 2**20
        return {"server_peak_mib": peak_self / mib, "server_rise_mib": (peak_self - before["self"]) / mib,
                "all_peak_mib": peak_all / mib, "all_rise_mib": (peak_all - before["all"]) / mib}

    def stop(self) -> None:
        self._stop.set()


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
def run_phase(grid, context, spec: dict, phase: dict, sampler: RssSampler | None) -> dict:
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
        sampler = RssSampler().start() if spec.get("memory") else None
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


def child_main(spec_path: str, result_path: str) -> None:
    """Runs in the child process: one ``run_simulation`` through all phases of ``spec``."""
    import logging

    from flwr.simulation import run_simulation

    os.environ[SPEC_ENV] = str(Path(spec_path).resolve())  # before Ray starts: its workers inherit it
    spec = json.loads(Path(spec_path).read_text())
    # The ClientApp must come from an importable module (not __main__) for Ray to pickle it by
    # reference; Flower passes the driver's sys.path (this file's folder first) to the workers.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import secagg_harness

    logging.getLogger("flwr").setLevel(logging.INFO if spec.get("verbose") else logging.WARNING)
    if spec.get("vce_poll_interval") is not None:
        patch_vce_polling(spec["vce_poll_interval"])
    results: dict = {"phases": []}
    start = time.perf_counter()
    run_simulation(
        server_app=make_server_app(spec, results), client_app=secagg_harness.client_app,
        num_supernodes=spec["num_supernodes"],
        backend_config={
            "client_resources": {"num_cpus": spec.get("client_cpus", 1), "num_gpus": 0.0},
            "init_args": {"num_cpus": spec.get("ray_cpus", 2), "num_gpus": 0, "_node_ip_address": "127.0.0.1",
                          "include_dashboard": False, "logging_level": "ERROR", "log_to_driver": True,
                          "object_store_memory": spec.get("object_store_bytes", 2 * 2**30)},
        },
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
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
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


# ----------------------------------------------------------------------------- SecAgg+ settings
def secagg_kwargs(clipping_range: float = 1.0, precision: float = 1e-7) -> dict:
    """SecAgg+ workflow settings from ``derive_parameters`` for this benchmark's data (3 clients;
    the smallest has ``min(NUM_EXAMPLES)`` prompts, the batch size that guarantees it). The
    clients' sizes differ, as with data files, so max-weight is explicit: the automatic one
    assumes iid task data, where every client has exactly ``train_size`` prompts."""
    from flwr_verl.config import DataConfig, SecAggConfig
    from flwr_verl.federation.secagg import derive_parameters

    data = DataConfig(train_size=TRAIN_SIZE, train_batch_size=min(NUM_EXAMPLES))
    config = SecAggConfig(clipping_range=clipping_range, precision=precision, max_weight=2 * TRAIN_SIZE)
    return derive_parameters(config, data, num_clients=3).workflow_kwargs()


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
