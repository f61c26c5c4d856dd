"""Fixtures and checks for the slow tests that run real Flower processes.

Launching lives in ``deploy/`` (``deploy.simulation``: an isolated ``flwr run`` simulation;
``deploy.launch``: a SuperLink and SuperNodes); this module re-exports what the tests use and
adds the runs they share, a deployment context that always cleans up, and offline replays.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from deploy.launch import MARKER, LocalDeployment, kill_processes_with_env
from deploy.simulation import APP, flwr_run_simulation, isolated_env, kill_tree_with_env  # noqa: F401 - for tests

REPO = APP


def engine_params(group: str, engines) -> list:
    """Module-fixture params, one per node engine, each its own xdist group (``tests/conftest.py``):
    the warm and the cold half of a module run side by side."""
    return [pytest.param(engine, marks=pytest.mark.xdist_group(f"{group}-{engine}")) for engine in engines]


# ----------------------------------------------------------------------------- deployment
# A SuperLink and SuperNodes as real processes (deploy/launch.py), for test_deployment,
# test_faults and test_bad_input. Every process carries FLWR_VERL_DEPLOYMENT=<root> and is
# killed by that marker when the context ends, whatever happened inside.

# The simulation test's run, for deployments: 2 rounds, DP and SecAgg+ on.
SMALL_RUN = {
    "num-server-rounds": 2,
    "data.train_size": 128,
    "data.val_size": 16,
    "data.train_batch_size": 16,
    "actor.ppo_mini_batch_size": 16,
    "trainer.local_iterations": 3,
    "privacy.enabled": True,
    "privacy.noise_multiplier": 0.8,
    "privacy.deterministic": True,
    "secagg.enabled": True,
    # Each SecAgg+ stage's deadline. Alone, a cold-engine round takes about 50 s; in CI, with four
    # pytest workers' real processes on two cores, a whole round took 332 s.
    "secagg.timeout": 1200.0,
}
# How long a test waits for a whole run (or its ``flwr run`` CLI) to end; only a hang reaches it.
# The longest, test_deployment's cold-engine run, takes about 164 s alone on 2 cores and 461-584 s
# in the suite, where four workers' real processes share the two cores (before the cold half ran
# the main run only: 185 s, 705 s, and more than 900 s in one CI run).
RUN_DEADLINE_S = 2700.0
# Fault runs: no evaluation round trip, one local iteration, a SecAgg+ timeout that bounds any hang
# (a lost node is noticed sooner, when its heartbeat lapses; on a loaded 2-core machine a ClientApp's
# first reply alone took over 120 s).
FAULT_RUN = {**SMALL_RUN, "evaluate-every": 0, "trainer.local_iterations": 1, "secagg.timeout": 300.0}


@contextlib.contextmanager
def local_deployment(root: Path, num_supernodes: int, **kwargs):
    """A started ``LocalDeployment``; everything it (and Flower) spawned is killed afterwards."""
    deployment = LocalDeployment(root, num_supernodes, **kwargs)
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()
        kill_processes_with_env(MARKER, str(deployment.root))


def count_in(path: Path, needle: str) -> int:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").count(needle)
    return 0


def run_directories(output_dir: Path) -> list[Path]:
    return sorted(output_dir.glob("run-*"))


def records(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tree_digest(directory: Path) -> str:
    """A digest of every file under ``directory`` (names and bytes)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- offline replay
def replay_updates(run_config: dict, partitions: list[int], num_partitions: int, global_arrays, server_round: int = 1):
    """Recompute, in this process, the updates that ``partitions`` send in round ``server_round``
    (round 1 of a fresh run: empty privacy history), with the exact fit config the strategy sends.
    Returns ``[(update arrays, num_examples), ...]``. Needs ``privacy.deterministic`` for DP runs."""
    from flwr.common import ndarrays_to_parameters

    from flwr_verl.config import parse_run_config
    from flwr_verl.federation.client import VerlClient, cached_rows
    from flwr_verl.federation.inprocess import InProcessClients
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.secagg import derive_parameters
    from flwr_verl.federation.strategy import FedProxAdapters

    config = parse_run_config(run_config)
    federation, engine = config.federation, config.engine
    secagg = derive_parameters(federation.secagg, engine.data, federation.min_fit_clients)
    strategy = FedProxAdapters(federation, global_arrays, local_iterations=engine.trainer.local_iterations,
                               secure_aggregation=SecAggBounds(secagg.clipping_range, secagg.max_weight))
    (_, fit_ins), *_ = strategy.configure_fit(server_round, ndarrays_to_parameters(global_arrays),
                                              InProcessClients.named(range(num_partitions)))
    out = []
    for partition in partitions:
        client = VerlClient(engine, cached_rows(engine, "train", partition, num_partitions),
                            cached_rows(engine, "val", partition, num_partitions), partition_id=partition)
        fit_config = {**fit_ins.config, "fail_partition": -1}  # replay what it would have sent
        update, num_examples, _ = client.fit([a.copy() for a in global_arrays], fit_config)
        out.append((update, num_examples))
    return out


def weighted_mean(updates):
    total = sum(n for _, n in updates)
    return [sum(u[i] * (n / total) for u, n in updates) for i in range(len(updates[0][0]))]


def saved_adapter(adapter_dir: Path, run_config: dict | None = None):
    """The arrays of a saved global adapter directory (``adapters/round-NNNN``), in AdapterSet order."""
    from flwr_verl.config import parse_run_config
    from flwr_verl.engine.models import build_models, load_adapter_into

    engine = parse_run_config(run_config or {}).engine
    models = build_models(engine.model, engine.needs_critic, seed=engine.trainer.seed)
    adapters = models.adapters
    for role, model in adapters.models.items():
        load_adapter_into(model, Path(adapter_dir) / role)
    return adapters.get_arrays()


def initial_adapter(run_config: dict | None = None):
    from flwr_verl.config import parse_run_config
    from flwr_verl.engine.models import build_models

    engine = parse_run_config(run_config or {}).engine
    return build_models(engine.model, engine.needs_critic, seed=engine.trainer.seed).adapters.get_arrays()


def assert_final_adapter_trained_and_loadable(run_dir: Path) -> None:
    """The run's final global adapter opens with plain PEFT and differs from the initial one."""
    import numpy as np
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flwr_verl.config import ModelConfig
    from flwr_verl.engine.models import AdapterSet, resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(ModelConfig()), local_files_only=True)
    final = PeftModel.from_pretrained(base, run_dir / "adapters" / "final" / "policy", is_trainable=True)
    trained, initial = AdapterSet({"policy": final}).get_arrays(), initial_adapter()
    assert [a.shape for a in trained] == [a.shape for a in initial]
    assert max(float(np.abs(a - b).max()) for a, b in zip(trained, initial)) > 1e-4
