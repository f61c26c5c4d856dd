"""The clients of a SecAgg+ harness run (``secagg_harness.run_flower``): what each returns from
``fit`` for a spec, the ClientApp that returns it, and the SecAgg+ settings for their data.

The updates are deterministic, seeded by the spec and the client's partition id, so that a test
or ``secagg_precision.py`` recomputes in its own process exactly what each client sent. This
module runs in Ray's client actors too: it imports Flower and the project's SecAgg+ pieces only,
and leaves ``sys.path`` to whoever imports it (``secagg_harness``, or a test: this checkout first).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.client import Client, ClientApp, NumPyClient

from flwr_verl.federation.mods import secaggplus_when_requested
from flwr_verl.federation.protocol import STATUS_OK, FitConfig, FitReport
from flwr_verl.federation.secagg import check_update, exact_update

SPEC_ENV = "FLWR_VERL_SECAGG_SPEC"  # env var: path of the run's spec (JSON)
NUM_EXAMPLES = (96, 256, 480)  # per partition, unequal; max-weight 2 * train_size = 500 covers them
# Not a power of two on purpose: with max-weight 2**k the weights n / max-weight land on SecAgg+'s
# quantization grid, and so do many float32-derived updates, which hides most rounding error.
TRAIN_SIZE = 250

_CACHE: dict = {}  # per process: the spec, and updates by key


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
                        min_survivors: int) -> list[np.ndarray]:
    """The fixed update encoded for client-level DP (``distributed_dp.encode_update``), with noise
    seeded by (seed, round, partition): a test recomputes exactly what each client handed SecAgg+."""
    from flwr_verl.config import ClientLevelConfig
    from flwr_verl.privacy.distributed_dp import encode_update, plan_round

    update = fixed_update(spec, partition_id)
    plan = plan_round(ClientLevelConfig(**phase_config), sum(a.size for a in update), num_clients, min_survivors)
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
                                         instructions.client_level.min_survivors)
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
