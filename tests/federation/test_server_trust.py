"""What the server checks of what a node sends, assuming the node may lie: the unmasked aggregate
against what honest clients can send, robust aggregation in the clear, one node per client-id,
and exactly which entries each node's messages carry (docs/security.md lists them)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, GetPropertiesRes, Status, ndarrays_to_parameters

from flwr_verl.config import ConfigError, FederationConfig, SecAggConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import (
    STATUS_OK,
    EvaluateConfig,
    FitConfig,
    FitReport,
    PreflightConfig,
    PreflightReport,
    SecAggBounds,
)
from flwr_verl.federation.rounds import PreflightFailed, RoundFailed
from flwr_verl.federation.strategy import FedProxAdapters

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def fit_res(update, num_examples: int, partition_id: int) -> FitRes:
    report = FitReport(status=STATUS_OK, partition_id=partition_id, client_id=str(partition_id), bytes_received=0,
                       bytes_sent=0)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), num_examples, report.to_metrics())


def secure_strategy(initial) -> FedProxAdapters:
    config = FederationConfig(min_fit_clients=3, min_available_clients=1, secagg=SecAggConfig(enabled=True))
    return FedProxAdapters(config, initial, local_iterations=1, secure_aggregation=SecAggBounds(1.0, 64.0))


def as_secure_aggregate(mean, count: int = 3) -> list:
    """What ``SecAggPlusWorkflow`` hands the strategy: every result carries the unmasked mean."""
    proxies = InProcessClients.named([str(i) for i in range(count)]).proxies
    return [(proxies[str(i)], fit_res(mean, 8, i)) for i in range(count)]


# ----------------------------------------------------------------------------- feasible aggregate
def test_a_secure_aggregate_within_the_clipping_range_is_applied():
    initial = [np.zeros((2, 3), np.float32)]
    strategy = secure_strategy(initial)
    mean = [np.array([[1.0, -1.0, 0.5], [0.0, -0.25, 1.0 + 1e-9]])]  # the range, plus SecAgg+'s rounding
    strategy.aggregate_fit(1, as_secure_aggregate(mean), [])
    np.testing.assert_allclose(strategy.global_arrays[0], mean[0], atol=1e-6)
    assert strategy.completed_round == 1


def test_a_secure_aggregate_no_honest_clients_can_send_fails_the_round_and_the_next_one_goes_on():
    """The attack that was summed before: one coordinate far outside the clipping range (the
    masked NaN of a client that skipped its own checks unmasks as a large number)."""
    initial = [np.zeros((2, 3), np.float32)]
    strategy = secure_strategy(initial)
    poisoned = [np.array([[0.1, 24385.2, 0.0], [0.0, 0.0, -0.2]])]
    with pytest.raises(RoundFailed, match=r"round 1: the securely aggregated update of 3 clients is not one that "
                                          r"honest clients can send: 1 of 6 coordinates are outside \+-1 "
                                          r"\(secagg.clipping-range.*largest finite \|value\| 2.439e\+04"):
        strategy.aggregate_fit(1, as_secure_aggregate(poisoned), [])
    assert np.array_equal(strategy.global_arrays[0], initial[0]) and strategy.completed_round == 0
    honest = [np.full((2, 3), 0.5)]
    strategy.aggregate_fit(2, as_secure_aggregate(honest), [])
    np.testing.assert_allclose(strategy.global_arrays[0], honest[0], atol=1e-6)


def test_under_client_level_dp_an_aggregate_longer_than_honest_clients_can_send_fails(tiny_config):
    """Client-level DP: each node hands SecAgg+ clipped, noised integers. Honest nodes pass the
    norm bound (``distributed_dp.feasible_mean_norm``); one that adds a quarter of the modular
    range to its integers after its own clipping (what an unclipped or NaN update becomes) makes
    the round fail, and the global adapter stays. A shift below the noise's spread passes: the
    docs/security.md says so."""
    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "deterministic": True,
                                  "client_level.enabled": True, "client_level.clip_norm": 0.05,
                                  "client_level.noise_multiplier": 0.8},
                         trainer={"local_iterations": 1})
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", 0, i, 3), [], partition_id=i)
               for i in range(3)}
    initial = clients["0"].adapters.get_arrays()

    def strategy() -> FedProxAdapters:
        return FedProxAdapters(FederationConfig(min_fit_clients=3, secagg=SecAggConfig()), initial,
                               local_iterations=1, secure_aggregation=SecAggBounds(1.0, 64.0),
                               client_level=config.privacy.client_level)

    honest = strategy()
    fit_round(honest, InProcessClients(clients), 1, secure=True)
    assert honest.completed_round == 1

    liar, honest_fit = clients["2"], clients["2"].fit
    step = 2 ** config.privacy.client_level.bits // 4

    def fit_and_add(parameters, instructions):
        (sent,), weight, metrics = honest_fit(parameters, instructions)
        return [sent + step], weight, metrics  # still integers of the modular range: no client check sees it

    liar.fit = fit_and_add
    attacked = strategy()
    with pytest.raises(RoundFailed, match=r"round 1: the securely aggregated update of 3 clients is not one that "
                                          r"honest clients can send: its L2 norm .* exceeds .*, the most that 3 "
                                          r"clipped, noised client updates reach"):
        fit_round(attacked, InProcessClients(clients), 1, secure=True)
    assert all(np.array_equal(a, b) for a, b in zip(attacked.global_arrays, initial)) and attacked.completed_round == 0


# ----------------------------------------------------------------------------- robust aggregation
@pytest.mark.parametrize("aggregation, values, expected", [
    ("mean", [0.1, 0.2, 0.3, 0.4, 100.0], 20.2),  # one outlier moves the mean anywhere
    ("median", [0.1, 0.2, 0.3, 0.4, 100.0], 0.3),
    ("trimmed_mean", [0.1, 0.2, 0.3, 0.4, 100.0], 0.3),  # 20% cut at each end: the mean of 0.2, 0.3, 0.4
])
def test_in_the_clear_a_robust_aggregation_bounds_what_one_client_moves(aggregation, values, expected):
    initial = [np.zeros(2, np.float32)]
    config = FederationConfig(min_fit_clients=5, min_available_clients=1, secagg=SecAggConfig(enabled=False),
                              aggregation=aggregation, trim_fraction=0.2)
    strategy = FedProxAdapters(config, initial, local_iterations=1)
    proxies = InProcessClients.named([str(i) for i in range(5)]).proxies
    results = [(proxies[str(i)], fit_res([np.full(2, v)], 8, i)) for i, v in enumerate(values)]
    strategy.aggregate_fit(1, results, [])
    np.testing.assert_allclose(strategy.global_arrays[0], [expected] * 2, rtol=1e-6)


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_robust_aggregation_under_secagg_is_refused_naming_the_key(aggregation):
    with pytest.raises(ConfigError, match=rf"aggregation='{aggregation}' is invalid: needs each client's update, which SecAgg\+ hides"):
        FederationConfig(aggregation=aggregation, secagg=SecAggConfig(enabled=True))


@pytest.mark.parametrize("fraction", [-0.1, 0.5])
def test_a_trim_fraction_outside_its_range_is_refused(fraction):
    with pytest.raises(ConfigError, match=rf"trim-fraction={fraction!r} is invalid: must be in \[0, 0.5\)"):
        FederationConfig(aggregation="trimmed_mean", trim_fraction=fraction, secagg=SecAggConfig(enabled=False))


# ----------------------------------------------------------------------------- one node per client-id
def test_two_nodes_claiming_one_client_id_are_refused_by_node_before_round_1():
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=3, secagg=SecAggConfig(enabled=False)),
                               [np.zeros(2, np.float32)], local_iterations=1)
    proxies = InProcessClients.named(["11", "12", "13"]).proxies
    claims = {"11": "org-a", "12": "org-b", "13": "org-b"}
    results = [(proxies[node], GetPropertiesRes(Status(Code.OK, ""), PreflightReport(name).to_metrics()))
               for node, name in claims.items()]
    with pytest.raises(PreflightFailed, match=r"round 1: preflight: 2 of 3 clients cannot train; nothing was trained:"
                                              r"\n  clients org-b: nodes 12, 13 all claim client-id='org-b'"):
        strategy.check_preflight(1, results, [])
    claims["13"] = "org-c"
    strategy.check_preflight(1, [(proxies[node], GetPropertiesRes(Status(Code.OK, ""),
                                                                  PreflightReport(name).to_metrics()))
                                 for node, name in claims.items()], [])


# ----------------------------------------------------------------------------- what the server sees
FIT_REPLY = {"status", "partition_id", "client_id", "bytes_received", "bytes_sent", "iterations",
             "privacy.fits_next_round"}
EXACT_ONLY = {"privacy.epsilon_run"}
PREFLIGHT_REPLY = {"status", "preflight.client_id"}
EVALUATE_REPLY = {"accuracy", "reward"}


@pytest.mark.parametrize("weights, sent_num_examples", [("exact", 32), ("bucketed", 32), ("fixed", 1)])
def test_what_the_server_sees_from_a_node_under_dp_is_exactly_the_readmes_list(tiny_config, weights,
                                                                              sent_num_examples):
    """Every entry a DP node's replies carry by default (``privacy.metrics`` "auto" sends no
    training metrics), by the weight it sends: never its budget, account history or data size
    (the bucketed weight of 30 prompts is 32; "fixed" sends 1). docs/security.md
    names each entry, so the list cannot drift from the code."""
    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "num_examples": weights,
                                  "epsilon_budget": 50.0})
    rows = load_rows(config.data, "train", 0, 0, 3)[:30 if weights == "bucketed" else 32]
    client = VerlClient(config, rows, load_rows(config.data, "val", 0, 0, 3)[:5], partition_id=0, client_id="org-a")
    parameters = client.get_parameters({})
    properties = client.get_properties(PreflightConfig().to_config())
    _, num_examples, fit_metrics = client.fit(
        parameters, FitConfig(server_round=1, local_iterations=1, planned_iterations=1, proximal_mu=0.0).to_config())
    _, evaluated, eval_metrics = client.evaluate(parameters, EvaluateConfig(server_round=1).to_config())

    assert set(properties) == PREFLIGHT_REPLY
    assert set(fit_metrics) == FIT_REPLY | (EXACT_ONLY if weights == "exact" else set())
    assert set(eval_metrics) == EVALUATE_REPLY
    assert num_examples == sent_num_examples and evaluated == {"exact": 5, "bucketed": 8, "fixed": 1}[weights]
    assert not any(re.search(r"budget|history|sample_rate|num_prompts|account", key) for key in fit_metrics)

    section = SECURITY_DOC.read_text().split("\n## ", 1)[0]  # the page up to its first subsection
    documented = set(re.findall(r"`([a-z_.]+)`", section))
    missing = (FIT_REPLY | EXACT_ONLY | PREFLIGHT_REPLY | EVALUATE_REPLY) - documented
    assert not missing, f"docs/security.md does not name {sorted(missing)}"

