"""FFA-LoRA (``model.lora_freeze_a``): A stays at the shared seeded init and never travels, B
trains, and the aggregated adapter's effective update is exactly the clients' mean update.

Each fixture runs one real federated round (two clients, tiny engine, DP on) through the
strategy, in process; the standard-LoRA round is the contrast that shows the check can fail."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.common import parameters_to_ndarrays

from flwr_verl.config import ConfigError, FederationConfig, SecAggConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import PreflightConfig
from flwr_verl.federation.strategy import FedProxAdapters

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lora_aggregation  # noqa: E402  (the benchmark's measure is the one tested)

DP = {"enabled": True, "noise_multiplier": 1.0, "deterministic": True}


def lora_a_factors(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The A factor of every LoRA layer (PEFT's ``lora_A`` / ``lora_embedding_A``)."""
    return [(name, param) for name, param in model.named_parameters()
            if ".lora_A." in name or ".lora_embedding_A." in name]


def one_round(tiny_config, freeze_a: bool) -> SimpleNamespace:
    """Two DP clients, one round: what each sent, the aggregate, and the models' A factors."""
    config = tiny_config(model={"lora_freeze_a": freeze_a}, privacy=DP, actor={"lr": 1e-2})
    models = build_models(config.model, with_critic=False, seed=config.trainer.seed)
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", 0, i, 2), [], partition_id=i,
                                  models=models) for i in range(2)}
    adapters = models.adapters
    initial = adapters.get_arrays()
    a_before = {name: p.detach().clone() for name, p in lora_a_factors(models.policy)}
    federation = FederationConfig(min_fit_clients=2, min_evaluate_clients=2, min_available_clients=2,
                                  proximal_mu=0.0, secagg=SecAggConfig(enabled=False))
    strategy = FedProxAdapters(federation, initial, local_iterations=2, frozen_weights=adapters.frozen_fingerprint)
    results, _ = fit_round(strategy, InProcessClients(clients), server_round=1)
    updates = [(parameters_to_ndarrays(res.parameters), res.num_examples) for _, res in results]
    return SimpleNamespace(config=config, models=models, adapters=adapters, clients=clients, initial=initial,
                           a_before=a_before, updates=updates, aggregate=strategy.global_arrays)


def aggregation_error(run: SimpleNamespace) -> float:
    """max |Delta W(aggregate) - weighted mean of the clients' Delta W| / max |that mean|."""
    return lora_aggregation.aggregation_error(run.models.policy, run.adapters, run.initial, run.updates,
                                              run.aggregate)["max_relative"]


@pytest.fixture(scope="module")
def ffa(tiny_config):
    return one_round(tiny_config, freeze_a=True)


@pytest.fixture(scope="module")
def standard(tiny_config):
    return one_round(tiny_config, freeze_a=False)


def test_only_b_travels_and_a_is_not_trainable(ffa, standard):
    sent, full = ffa.adapters.names, standard.adapters.names
    assert sent == [name for name in full if ".lora_A." not in name]
    assert all(".lora_B." in name for name in sent)
    assert [len(update) for update, _ in ffa.updates] == [len(sent)] * 2
    a_size = sum(p.numel() for _, p in lora_a_factors(ffa.models.policy))
    assert ffa.adapters.num_parameters() == standard.adapters.num_parameters() - a_size


def test_a_is_bit_identical_after_dp_training_and_b_moved(ffa):
    for name, param in lora_a_factors(ffa.models.policy):
        assert not param.requires_grad
        assert torch.equal(param, ffa.a_before[name]), name
    for update, _ in ffa.updates:
        assert all(np.isfinite(u).all() for u in update)
        assert max(np.abs(u).max() for u in update) > 0  # B trained under DP


def test_aggregate_delta_w_is_the_mean_of_the_clients_delta_w(ffa, standard):
    exact, inexact = aggregation_error(ffa), aggregation_error(standard)
    assert exact < 1e-5, exact  # float32 rounding of B @ A
    assert inexact > 100 * exact, (inexact, exact)  # mean(B) mean(A) != mean(B A)


def test_preflight_refuses_a_client_with_other_frozen_factors(ffa):
    client = ffa.clients["0"]
    assert client.get_properties(PreflightConfig(frozen_weights=ffa.adapters.frozen_fingerprint).to_config())
    other = PreflightConfig(frozen_weights="0" * 64).to_config()
    with pytest.raises(ConfigError, match=r"model.path=\(embedded\): this client's base model and its frozen LoRA A "
                                          r"factors \(model.lora_freeze_a\) \(sha256 [0-9a-f]{16}\) differ from the "
                                          r"server's \(0000000000000000\)"):
        client.get_properties(other)


def test_the_fingerprint_covers_the_base_model_and_the_frozen_factors(ffa, standard):
    """Standard LoRA freezes the base only; FFA-LoRA also its A factors. A client whose base
    differs in one weight is refused (its updates would mean something else there)."""
    assert standard.adapters.frozen_fingerprint != ffa.adapters.frozen_fingerprint
    rebuilt = build_models(standard.config.model, with_critic=False, seed=standard.config.trainer.seed)
    server = rebuilt.adapters.frozen_fingerprint
    client = standard.clients["0"]
    assert server == standard.adapters.frozen_fingerprint
    assert client.get_properties(PreflightConfig(frozen_weights=server).to_config())
    assert client.get_properties(PreflightConfig().to_config())  # a server that sends none: nothing to compare
    base = standard.models.policy.get_base_model().model.embed_tokens.weight
    saved = base.detach().clone()
    with torch.no_grad():
        base[0, 0] += 1e-3
    try:
        with pytest.raises(ConfigError, match=r"this client's base model \(sha256"):
            client.get_properties(PreflightConfig(frozen_weights=server).to_config())
    finally:
        with torch.no_grad():
            base.copy_(saved)
