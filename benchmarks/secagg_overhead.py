"""SecAgg+ cost and precision, measured through real Flower runs.

    python benchmarks/secagg_overhead.py [--out benchmarks/results/secagg_overhead.json]
                                         [--sizes 100000,1000000,10000000] [--rounds 5]

For each adapter size (about 100k, 1M and 10M parameters) one Flower simulation
(``flwr.simulation.run_simulation``, Ray backend, 3 supernodes) runs, side by side:

- ``plain``: ``DefaultWorkflow`` with Flower's default fit workflow, ``FedProxAdapters`` with
  ``secure_aggregation=None``, clients returning float32 updates (what ``VerlClient`` sends);
- ``secagg``: ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(**derive_parameters(...)))``,
  the same clients behind ``secaggplus_mod``;
- ``secagg_f64``: the same, with float64 updates (see "precision" below).

Each configuration runs one warm-up round and then ``--rounds`` timed rounds; the figure is the
median fit-round time (the whole fit workflow: configure_fit, every message stage, unmasking,
aggregate_fit). Clients return fixed random updates of the given size (cached per process), so
the benchmark measures the aggregation protocol, not RL: with real local training, which takes
seconds to minutes per round, the same absolute overhead is a far smaller fraction. Peak memory is
sampled (RSS, every 50 ms) for the server process and for all processes of the run (server, Ray,
client actors), as the rise over the level before each configuration.

Reading the figures: SecAgg+ takes four message exchanges per round where plain FedAvg takes
one. Flower 1.42 delivers messages by polling (simulation: every 0.1 s on both sides, not
configurable for the node side; deployment: ``HttpGrid`` and idle SuperNodes every 3 s), so the
two small key-exchange stages cost about 0.1 s each in simulation whatever the size; the rest is
mask generation and quantization (numpy, per client). ``--diagnose-sizes`` reruns sizes with both
polls patched down to 5 ms to separate the two. ``training_seconds_for_1.1x`` is the local
training time per round at which the measured extra time would be 10% of the round.

Then the precision part (``precision_report``): the same client updates of a LoRA-sized adapter
(29k parameters, |update| < 0.5, 96/256/480 examples, max-weight 500) go through plain
aggregation and through real SecAgg+ as deltas and as full weights, in float32 and float64, at the
derived parameters (clipping range 1) and at a clipping range fitted to the deltas (0.5). Errors
are max and rms |.| against the exact float64 FedAvg of the clients' new weights.

Every Flower run happens in a child process with its own FLWR_HOME and Ray temp dir, with Ray on
127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, ``_node_ip_address``); the listening
sockets of all its processes are recorded, and every process that carries the run's marker in
its environment is killed afterwards. ``tests/test_secagg.py`` uses the same machinery.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.client import Client, ClientApp, NumPyClient

from flwr_verl.mods import secaggplus_when_requested
from flwr_verl.secagg import check_update, exact_update

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from deploy.launch import kill_processes, processes_with_env  # noqa: E402
DEFAULT_OUT = REPO / "benchmarks" / "results" / "secagg_overhead.json"
MARKER = "FLWR_VERL_SECAGG_RUN"  # env var naming the processes of one run, for cleanup
SPEC_ENV = "FLWR_VERL_SECAGG_SPEC"  # env var: path of the run's spec (JSON)

# A LoRA adapter (rank 8) on every linear layer of a 2-layer Llama of hidden size 96 and MLP 256:
# per layer q/k/v/o (96 -> 96), gate/up (96 -> 256), down (256 -> 96); A is (r, in), B is (out, r).
LORA_SHAPES = [shape for _ in range(2)
               for fan_in, fan_out in [(96, 96)] * 4 + [(96, 256)] * 2 + [(256, 96)]
               for shape in ((8, fan_in), (fan_out, 8))]
NUM_EXAMPLES = (96, 256, 480)  # per partition; auto max-weight 2 * train_size = 500 covers them
# Not a power of two on purpose: with max-weight 2**k the weights n / max-weight land on SecAgg+'s
# quantization grid, and so do many float32-derived updates, which hides most rounding error.
TRAIN_SIZE = 250


def shapes_for(num_params: int) -> list[list[int]]:
    """LoRA-like (r=16) A/B pairs on square layers of width 1024, about ``num_params`` in all."""
    pair = 2 * 16 * 1024
    layers = max(1, round(num_params / pair))
    return [list(shape) for _ in range(layers) for shape in ((16, 1024), (1024, 16))]


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
      in float64 it is ``flwr_verl.secagg.exact_update``: exact, and finely quantized by SecAgg+.
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
        update = client_output(spec, self.partition_id, parameters, str(config["update_format"]),
                               str(config["update_dtype"]))
        if "secagg_clipping_range" in config:
            check_update(update, num_examples, float(config["secagg_clipping_range"]),
                         float(config["secagg_max_weight"]))
        return update, num_examples, {"partition_id": self.partition_id, "probe": 1000 + self.partition_id,
                                      "loss_like": 0.1 * (self.partition_id + 1)}


def client_fn(context: Context) -> Client:
    return FixedUpdateClient(int(context.node_config["partition-id"])).to_client()


# Module level, so Ray pickles it by reference and each actor keeps its own update cache.
# The project's mod: secaggplus_mod on SecAgg+ messages, so one ClientApp serves plain and
# secure rounds (flwr_verl.mods imports Flower only, which keeps the Ray actors light).
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

    from flwr_verl.config import FederationConfig, SecAggConfig
    from flwr_verl.strategy import FedProxAdapters

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
                fit_ins.config.update(update_format=phase["format"], update_dtype=phase["dtype"])
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
    initial = initial_arrays(spec) if phase["format"] != "fixed" else [np.zeros(s, np.float32) for s in spec["shapes"]]
    strategy = MeasuredStrategy(
        federation, initial, local_iterations=1,
        secure_aggregation=({"secagg_clipping_range": secagg["clipping_range"],
                             "secagg_max_weight": secagg["max_weight"]} if secagg else None),
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
        "failures": strategy.failures_seen, "fit_metrics": strategy.round_record.get("fit", {}),
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
    import secagg_overhead

    logging.getLogger("flwr").setLevel(logging.INFO if spec.get("verbose") else logging.WARNING)
    if spec.get("vce_poll_interval") is not None:
        patch_vce_polling(spec["vce_poll_interval"])
    results: dict = {"phases": []}
    start = time.perf_counter()
    run_simulation(
        server_app=make_server_app(spec, results), client_app=secagg_overhead.client_app,
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
    pass


def run_flower(spec: dict, timeout: float = 600, workdir: Path | None = None) -> dict:
    """Run ``spec`` in an isolated child process; return its results (and the leftover check)."""
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="secagg-")) if own_dir else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    ray_tmp = Path("/tmp") / f"rs{marker[:8]}"  # short: Ray's socket paths are length-limited
    env = {
        **os.environ,
        MARKER: marker,
        SPEC_ENV: str(workdir / "spec.json"),
        "FLWR_HOME": str(workdir / "flwr_home"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray binds to 127.0.0.1 only
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
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
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log_text = log_path.read_text(errors="replace")
    if code != 0 or not result_path.exists():
        raise FlowerRunError(f"Flower run {'timed out' if code is None else f'exited with {code}'}; "
                             f"log {log_path}:\n{log_text[-6000:]}")
    with open(result_path, "rb") as handle:
        results = pickle.load(handle)
    results.update(wall_seconds=time.perf_counter() - started, killed_after=killed, leftover_pids=leftover,
                   log=log_text)
    if own_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------- precision
def secagg_kwargs(clipping_range: float | None = None) -> dict:
    """SecAgg+ workflow settings from ``derive_parameters`` for this benchmark's data (3 clients)."""
    from flwr_verl.config import DataConfig, SecAggConfig
    from flwr_verl.secagg import derive_parameters

    config = SecAggConfig() if clipping_range is None else SecAggConfig(clipping_range=clipping_range)
    return derive_parameters(config, DataConfig(train_size=TRAIN_SIZE), num_clients=3).workflow_kwargs()


def precision_spec() -> dict:
    derived = secagg_kwargs()
    tight = secagg_kwargs(clipping_range=0.5)  # fits |delta| <= 0.5, not the weights (|w| <= 0.9)
    phases = [
        {"name": "plain_delta_f32", "secagg": None, "format": "delta", "dtype": "float32"},
        {"name": "plain_delta_f64", "secagg": None, "format": "delta", "dtype": "float64"},
        {"name": "secagg_delta_f32", "secagg": derived, "format": "delta", "dtype": "float32"},
        {"name": "secagg_delta_f64", "secagg": derived, "format": "delta", "dtype": "float64"},
        {"name": "secagg_weights_f32", "secagg": derived, "format": "weights", "dtype": "float32"},
        {"name": "secagg_weights_f64", "secagg": derived, "format": "weights", "dtype": "float64"},
        {"name": "secagg_delta_f64_c0.5", "secagg": tight, "format": "delta", "dtype": "float64"},
        {"name": "secagg_delta_f32_c0.5", "secagg": tight, "format": "delta", "dtype": "float32"},
    ]
    return {"num_supernodes": 3, "num_examples": list(NUM_EXAMPLES), "shapes": [list(s) for s in LORA_SHAPES],
            "seed": 7, "delta_scale": 0.5, "weight_scale": 0.4, "client_cpus": 1, "verbose": True,
            "phases": [{**p, "rounds": 1, "capture": True} for p in phases]}


def exact_fedavg(spec: dict) -> list[np.ndarray]:
    """The exact (float64) num_examples-weighted mean of the clients' new weights."""
    news = [client_new_weights(spec, pid) for pid in range(spec["num_supernodes"])]
    total = float(sum(spec["num_examples"]))
    return [sum(n * news[pid][i].astype(np.float64) for pid, n in enumerate(spec["num_examples"])) / total
            for i in range(len(spec["shapes"]))]


def _gaps(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).ravel()
                           for x, y in zip(a, b, strict=True)])


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.max(_gaps(a, b)))


def rms_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.sqrt(np.mean(_gaps(a, b) ** 2)))


def precision_report(results: dict, spec: dict) -> dict:
    """Max abs error of each phase's new global adapter (float64 server state) vs exact FedAvg."""
    exact = exact_fedavg(spec)
    phases = {p["name"]: p for p in results["phases"]}
    report = {}
    for name, phase in phases.items():
        setting = next(p for p in spec["phases"] if p["name"] == name)
        kwargs = setting["secagg"]
        if setting["format"] == "weights":  # the aggregate is the new global adapter itself
            estimate = phase["received"][0][2] if kwargs else phase["weights"]
        else:  # FedProxAdapters (sgd, lr 1): global + mean update, in float64
            estimate = phase["weights"]
        entry = {"format": setting["format"], "dtype": setting["dtype"],
                 "error_vs_exact_fedavg": max_abs_diff(estimate, exact),
                 "rms_error_vs_exact_fedavg": rms_diff(estimate, exact),
                 "clipping_range": kwargs["clipping_range"] if kwargs else None}
        if kwargs:
            # the same update format without SecAgg+: isolates the protocol's own error
            plain = phases.get(name.replace("secagg_", "plain_").replace("_c0.5", ""))
            if plain:
                entry["error_vs_plain"] = max_abs_diff(phase["weights"], plain["weights"])
            entry["bound_quantization_step"] = 2 * kwargs["clipping_range"] / kwargs["quantization_range"]
        report[name] = entry
    return report


# ----------------------------------------------------------------------------- overhead benchmark
def overhead_spec(num_params: int, rounds: int, pull_interval: float | None = None,
                  vce_poll_interval: float | None = None) -> dict:
    shapes = shapes_for(num_params)
    derived = secagg_kwargs()
    phases = [
        {"name": "warmup_plain", "secagg": None, "format": "fixed", "dtype": "float32", "rounds": 1},
        {"name": "warmup_secagg", "secagg": derived, "format": "fixed", "dtype": "float32", "rounds": 1},
        {"name": "plain", "secagg": None, "format": "fixed", "dtype": "float32", "rounds": rounds},
        {"name": "secagg", "secagg": derived, "format": "fixed", "dtype": "float32", "rounds": rounds},
        {"name": "secagg_f64", "secagg": derived, "format": "fixed", "dtype": "float64", "rounds": rounds},
    ]
    return {"num_supernodes": 3, "num_examples": list(NUM_EXAMPLES), "shapes": shapes, "seed": 11,
            "delta_scale": 0.5, "weight_scale": 0.0, "client_cpus": 1, "memory": True, "phases": phases,
            "pull_interval": pull_interval, "vce_poll_interval": vce_poll_interval}


def overhead(num_params: int, rounds: int, timeout: float, pull_interval: float | None = None,
             vce_poll_interval: float | None = None) -> dict:
    spec = overhead_spec(num_params, rounds, pull_interval, vce_poll_interval)
    results = run_flower(spec, timeout=timeout)
    phases = {p["name"]: p for p in results["phases"]}
    for phase in phases.values():
        if phase["aggregated_rounds"] != len(phase["round_seconds"]):
            raise FlowerRunError(f"{phase['name']}: {phase['aggregated_rounds']} of {len(phase['round_seconds'])} "
                                 f"rounds aggregated; failures {phase['failures']}\n{results['log'][-4000:]}")
    median = {name: statistics.median(p["round_seconds"]) for name, p in phases.items()}
    return {
        "num_params": int(sum(int(np.prod(s)) for s in spec["shapes"])),
        "clients": spec["num_supernodes"], "rounds": rounds, "pull_interval": pull_interval,
        "vce_poll_interval": vce_poll_interval,
        "median_round_seconds": {k: median[k] for k in ("plain", "secagg", "secagg_f64")},
        "round_seconds": {k: phases[k]["round_seconds"] for k in ("plain", "secagg", "secagg_f64")},
        "ratio_secagg_over_plain": median["secagg"] / median["plain"],
        "ratio_secagg_f64_over_plain": median["secagg_f64"] / median["plain"],
        "extra_seconds_per_round": median["secagg"] - median["plain"],
        # local training time per round at which SecAgg+ would cost 10%: (T + secagg) / (T + plain) = 1.1
        "training_seconds_for_1.1x": max(0.0, (median["secagg"] - 1.1 * median["plain"]) / 0.1),
        "memory": {k: phases[k]["memory"] for k in ("plain", "secagg", "secagg_f64")},
        "secagg_stage_median_seconds": {stage: statistics.median(values)
                                        for stage, values in phases["secagg"]["stage_seconds"].items()},
        "listeners": sorted({s["ip"] for s in results.get("listeners", [])}),
        "leftover_processes": results["leftover_pids"],
        "simulation_seconds": results["simulation_seconds"],
    }


HEADER = (f"{'params':>10} {'plain s':>8} {'secagg s':>9} {'ratio':>6} {'f64 s':>7} {'ratio':>6} "
          f"{'1.1x at T s':>11} {'stages setup/keys/collect/unmask s':>35} {'all-proc rise MiB plain/secagg':>31}")


def format_row(row: dict) -> str:
    m, mem, st = row["median_round_seconds"], row["memory"], row["secagg_stage_median_seconds"]
    stages = "/".join(f"{st.get(k, float('nan')):.2f}" for k in ("setup", "share_keys", "collect_masked_vectors",
                                                                   "unmask"))
    return (f"{row['num_params']:>10} {m['plain']:>8.3f} {m['secagg']:>9.3f} {row['ratio_secagg_over_plain']:>6.2f} "
            f"{m['secagg_f64']:>7.3f} {row['ratio_secagg_f64_over_plain']:>6.2f} "
            f"{row['training_seconds_for_1.1x']:>11.1f} {stages:>35} "
            f"{mem['plain']['all_rise_mib']:>15.0f}/{mem['secagg']['all_rise_mib']:<15.0f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--pull-interval", type=float, default=None,
                        help="InMemoryGrid pull interval in s (Flower's default 0.1); simulation only")
    parser.add_argument("--vce-poll-interval", type=float, default=None,
                        help="diagnosis: patch the simulation runtime's fixed 0.1 s message poll")
    parser.add_argument("--diagnose-sizes", default="1000000",
                        help="sizes to rerun with Flower's polling latency patched out ('' to skip)")
    parser.add_argument("--skip-precision", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, args.result)
        return {}

    import platform

    import psutil

    report: dict = {"machine": {"cpus": os.cpu_count(), "memory_gib": psutil.virtual_memory().total / 2**30,
                                "python": platform.python_version(), "load_avg_start": os.getloadavg()},
                    "overhead": [], "precision": None}
    try:
        import flwr

        report["machine"]["flwr"] = flwr.__version__
    except Exception:  # pragma: no cover
        pass
    print(HEADER)
    for size in (int(s) for s in args.sizes.split(",")):
        row = overhead(size, args.rounds, args.timeout, args.pull_interval, args.vce_poll_interval)
        report["overhead"].append(row)
        print(format_row(row), flush=True)
    if args.diagnose_sizes:
        # The same, with Flower's fixed 0.1 s polls (server pull, simulation delivery) cut to 5 ms:
        # what remains is SecAgg+'s computation (masks, quantization, serialization).
        report["diagnosis_without_polling_latency"] = []
        print("\ndiagnosis: Flower's 0.1 s message polls patched down to 5 ms")
        for size in (int(s) for s in args.diagnose_sizes.split(",")):
            row = overhead(size, args.rounds, args.timeout, pull_interval=0.005, vce_poll_interval=0.005)
            report["diagnosis_without_polling_latency"].append(row)
            print(format_row(row), flush=True)
    if not args.skip_precision:
        spec = precision_spec()
        spec["verbose"] = False
        results = run_flower(spec, timeout=args.timeout)
        report["precision"] = {"setup": {"num_params": int(sum(int(np.prod(s)) for s in spec["shapes"])),
                                         "num_examples": spec["num_examples"], "max_abs_delta": spec["delta_scale"],
                                         "max_abs_initial_weight": spec["weight_scale"],
                                         "max_weight": secagg_kwargs()["max_weight"],
                                         "quantization_range": secagg_kwargs()["quantization_range"]},
                               "errors": precision_report(results, spec)}
        print("\nprecision: |global - exact FedAvg| after one round (float64 server state), max and rms")
        for name, entry in report["precision"]["errors"].items():
            extra = f"  (max vs plain {entry['error_vs_plain']:.2e})" if "error_vs_plain" in entry else ""
            print(f"  {name:<24} C={entry['clipping_range']!s:<5} max {entry['error_vs_exact_fedavg']:.2e}  "
                  f"rms {entry['rms_error_vs_exact_fedavg']:.2e}{extra}")
    report["machine"]["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
