"""Device and dtype placement: every tensor flwr-verl creates names its device, and adapters
travel as float32 (float64 updates under SecAgg+) whatever the model's dtype.

On the CPU a missing ``device=`` goes unnoticed, and on CUDA it crashes the first fit (a FedProx
anchor on the CPU against weights on the GPU). The CPU test wraps torch's tensor factories while a
client fits, evaluates and the strategy aggregates, and fails on any call from flwr-verl's own
modules that does not pass ``device=``. The CUDA tests run the same on a GPU, in bfloat16; they
are skipped where torch sees none.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch
from flwr.common import parameters_to_ndarrays

from flwr_verl.config import FederationConfig, SecAggConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import EvaluateConfig, FitConfig, SecAggBounds
from flwr_verl.federation.strategy import FedProxAdapters

FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "randn", "rand", "randint", "eye",
             "linspace")


@contextlib.contextmanager
def deviceless_factory_calls():
    """Collect ``torch.<factory>(...)`` calls made directly by a ``flwr_verl`` module without ``device=``."""
    calls: list[str] = []
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def wrap(name, original):
        def factory(*args, **kwargs):
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if module.split(".")[0] == "flwr_verl" and "device" not in kwargs:
                calls.append(f"torch.{name} at {module}:{frame.f_lineno}")
            return original(*args, **kwargs)
        return factory

    for name, original in originals.items():
        setattr(torch, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def test_the_check_catches_a_deviceless_call():
    """The check has power: a factory call without ``device=`` from a flwr_verl module is caught."""
    with deviceless_factory_calls() as calls:
        exec("torch.zeros(3); torch.zeros(3, device='cpu')", {"__name__": "flwr_verl.example", "torch": torch})
    assert calls == ["torch.zeros at flwr_verl.example:1"]


def one_round(config, *, secure: bool):
    """Two clients fit and evaluate once; the strategy aggregates their updates."""
    train, val = load_rows(config.data, "train", 0), load_rows(config.data, "val", 0)
    clients = [VerlClient(config, train, val, partition_id=i) for i in range(2)]
    initial = clients[0].adapters.get_arrays()
    federation = FederationConfig(min_fit_clients=2, min_available_clients=2, proximal_mu=0.1,
                                  secagg=SecAggConfig(enabled=False))
    strategy = FedProxAdapters(federation, initial, local_iterations=1,
                               secure_aggregation=SecAggBounds(1.0, 64.0) if secure else None)
    results, _ = fit_round(strategy, InProcessClients({str(i): c for i, c in enumerate(clients)}), 1)
    evaluation = clients[0].evaluate(strategy.global_arrays, EvaluateConfig(server_round=1).to_config())
    return clients, strategy, [parameters_to_ndarrays(res.parameters) for _, res in results], evaluation


@pytest.mark.parametrize("privacy", [False, True], ids=["plain", "dp"])
def test_every_tensor_flwr_verl_creates_during_a_round_names_its_device(tiny_config, privacy):
    config = tiny_config(privacy={"enabled": privacy, "deterministic": True})
    with deviceless_factory_calls() as calls:
        one_round(config, secure=privacy)
    assert calls == [], "tensors created without device=: " + "; ".join(sorted(set(calls)))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("privacy", [False, True], ids=["plain", "dp"])
def test_a_round_runs_on_cuda_and_adapters_travel_as_float(tiny_config, dtype, privacy):
    config = tiny_config(model={"device": "cuda", "dtype": dtype}, privacy={"enabled": privacy, "deterministic": True})
    clients, strategy, updates, evaluation = one_round(config, secure=True)
    policy = clients[0].trainer.policy
    assert {p.device.type for p in policy.parameters()} == {"cuda"}
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16 if dtype == "bfloat16" else torch.float32}
    assert all(a.dtype == np.float32 for a in clients[0].adapters.get_arrays())
    assert all(u.dtype == np.float64 for update in updates for u in update)  # SecAgg+ quantizes float64 finely
    assert all(np.isfinite(a).all() for a in strategy.global_arrays)
    assert 0.0 <= evaluation[2]["accuracy"] <= 1.0


@cuda
def test_fedprox_anchor_lives_on_the_models_device(tiny_config):
    config = tiny_config(model={"device": "cuda"})
    client = VerlClient(config, load_rows(config.data, "train", 0), [], partition_id=0)
    arrays = client.adapters.get_arrays()
    with client.trainer.start_fit(anchor=arrays, proximal_mu=0.5) as fit:
        assert {a.device.type for a in fit.update.proximal.anchor} == {"cuda"}
        client.trainer.iteration(fit)
    client.fit(arrays, FitConfig(1, 1, 1, proximal_mu=0.5).to_config())
