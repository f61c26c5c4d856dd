"""Clients with different compute: per-node budgets (``local-iterations``, ``time-budget-s``),
the iterations each client reports and accounts for, and FedNova's normalised averaging."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from flwr_verl.config import ConfigError, FederationConfig, LocalBudget, SecAggConfig, parse_run_config
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import STATUS_OK, FitConfig, FitReport
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount, sample_rate


@pytest.fixture(scope="module")
def private_config(tiny_config):
    return tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "deterministic": True})


@pytest.fixture(scope="module")
def models(private_config):
    return build_models(private_config.model, with_critic=False, seed=0)


def federation(clients: int, **overrides) -> FederationConfig:
    return FederationConfig(min_fit_clients=clients, min_evaluate_clients=clients, min_available_clients=clients,
                            secagg=SecAggConfig(enabled=False), **overrides)


def test_budgets_run_their_own_counts_and_account_exactly_those(private_config, models):
    budgets = [LocalBudget(iterations=1), LocalBudget(iterations=2), LocalBudget()]
    rows = [load_rows(private_config.data, "train", 0, i, 3) for i in range(3)]
    clients = {str(i): VerlClient(private_config, rows[i], [], partition_id=i, models=models, budget=budget)
               for i, budget in enumerate(budgets)}
    strategy = FedProxAdapters(federation(3), models.adapters.get_arrays(), local_iterations=3)
    results, metrics = fit_round(strategy, InProcessClients(clients), server_round=1)
    reports = {r.client_id: r for r in (FitReport.from_metrics(res.metrics) for _, res in results)}
    ran = {"0": 1, "1": 2, "2": 3}
    assert {cid: r.iterations for cid, r in reports.items()} == ran
    assert strategy.last_round["iterations"] == ran  # the round's record (metrics.jsonl), per client
    for cid, client in clients.items():  # each node's ledger holds exactly the iterations it ran
        mechanism = IterationMechanism(1.0, sample_rate(private_config.data.train_batch_size, len(rows[int(cid)])),
                                       private_config.actor.ppo_epochs)
        assert client.ledger.account(client.data_set) == PrivacyAccount("rdp").after(mechanism, ran[cid])
    epsilons = [reports[cid].privacy.epsilon_run for cid in ("0", "1", "2")]
    assert epsilons == sorted(epsilons) and epsilons[0] < epsilons[2]
    assert metrics["iterations"] == pytest.approx(2.0)  # the num_examples-weighted mean (equal shares)


def test_a_time_budget_starts_no_iteration_after_it_runs_out(private_config, models):
    rows = load_rows(private_config.data, "train", 0, 0, 3)
    client = VerlClient(private_config, rows, [], models=models, budget=LocalBudget(seconds=1e-9))
    config = FitConfig(server_round=1, local_iterations=3, planned_iterations=3, proximal_mu=0.0)
    _, _, metrics = client.fit(models.adapters.get_arrays(), config.to_config())
    report = FitReport.from_metrics(metrics)
    assert report.iterations == 1  # the first always runs
    # The ledger recorded the 3 allowed before training (ledger.py: write before release): a time
    # budget that stops the fit sooner over-counts, never under-counts.
    assert client.ledger.account(client.data_set).steps == 3


@pytest.mark.parametrize("node_config, key", [
    ({"local-iterations": 0}, "local-iterations=0"), ({"local-iterations": -3}, "local-iterations=-3"),
    ({"local-iterations": 2.5}, "local-iterations=2.5"), ({"time-budget-s": 0}, "time-budget-s=0"),
    ({"time-budget-s": -1.5}, "time-budget-s=-1.5"), ({"time-budget-s": "1"}, "time-budget-s='1'"),
])
def test_a_bad_node_budget_is_refused_naming_the_key(node_config, key):
    with pytest.raises(ConfigError, match=f"node config {key} is invalid"):
        LocalBudget.from_node_config(node_config)


def test_no_budget_keys_means_no_limit():
    budget = LocalBudget.from_node_config({"partition-id": 0})
    assert budget.iterations_for(7) == 7 and budget.seconds is None
    assert LocalBudget.from_node_config({"local-iterations": 2}).iterations_for(7) == 2


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ConfigError, match="aggregation='fedbogus' is invalid: allowed: mean, fednova"):
        parse_run_config({"aggregation": "fedbogus"})


def test_under_fednova_the_client_sends_its_update_divided_by_its_iterations(tiny_config):
    config = tiny_config()  # no DP: two fits with the same seed are the same fit
    models = build_models(config.model, with_critic=False, seed=0)
    client = VerlClient(config, load_rows(config.data, "train", 0, 0, 2), [], models=models)
    start = models.adapters.get_arrays()
    plain = FitConfig(server_round=1, local_iterations=3, planned_iterations=3, proximal_mu=0.0)
    raw, _, _ = client.fit(start, plain.to_config())
    normalized, _, metrics = client.fit(start, dataclasses.replace(plain, normalize_update=True).to_config())
    assert FitReport.from_metrics(metrics).iterations == 3
    assert max(np.abs(u).max() for u in raw) > 0
    for r, n in zip(raw, normalized):
        np.testing.assert_allclose(n * 3, r, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("aggregation", ["mean", "fednova"])
def test_fednova_weighs_clients_by_data_not_by_iterations(aggregation):
    # Two clients, same data size, same per-iteration step g: one ran 1 iteration, one ran 4.
    g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    updates = {"0": (g1 * 1, 1), "1": (g2 * 4, 4)}
    strategy = FedProxAdapters(federation(2, aggregation=aggregation, proximal_mu=0.0), [np.zeros(2)],
                               local_iterations=4)
    ins = dict(strategy.configure_fit(1, ndarrays_to_parameters([np.zeros(2)]), InProcessClients.named("01")))
    results = []
    for proxy, fit_ins in ins.items():
        delta, tau = updates[proxy.cid]
        instructions = FitConfig.from_config(fit_ins.config)
        assert instructions.normalize_update == (aggregation == "fednova")
        sent = delta / tau if instructions.normalize_update else delta  # what VerlClient.fit sends
        report = FitReport(status=STATUS_OK, partition_id=int(proxy.cid), client_id=proxy.cid, bytes_received=0,
                           bytes_sent=0, iterations=tau)
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([sent]), 10, report.to_metrics())))
    strategy.aggregate_fit(1, results, [])
    new = strategy.global_arrays[0]
    if aggregation == "mean":
        np.testing.assert_allclose(new, [0.5, 2.0])  # the client with 4 iterations dominates
    else:
        np.testing.assert_allclose(new, 2.5 * (g1 + g2) / 2)  # tau_eff = 2.5, equal directions


def test_a_straggler_that_misses_the_fit_deadline_is_dropped_and_the_round_completes():
    """Node 3 answers no fit before ``fit-timeout`` (its reply never arrives): the round goes on
    with the other two, names the node among its failures, and the run ends normally."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from federation_wire import LoopbackGrid, measure_wire

    class StragglerGrid(LoopbackGrid):
        def pull_messages(self, message_ids):
            replies = super().pull_messages(message_ids)
            return [r for r in replies if not (r.metadata.src_node_id == 3 and r.metadata.message_type == "train")]

    run = {"num-server-rounds": 1, "min-fit-clients": 3, "min-evaluate-clients": 2, "min-available-clients": 3,
           "evaluate-every": 0, "fit-timeout": 5.0, "secagg.enabled": False, "data.train_size": 32,
           "data.val_size": 8, "data.train_batch_size": 8, "rollout.n": 2, "rollout.response_length": 6,
           "actor.ppo_mini_batch_size": 4, "trainer.local_iterations": 1, "privacy.enabled": False}
    _, records = measure_wire(run, num_clients=3, grid_class=StragglerGrid)
    (record,) = records
    assert record["round"] == 1 and record["clients"] == [0, 1]
    assert record["failures"] == ["NoReply: node 3 sent no train reply within 5 s"]
    assert set(record["iterations"]) == {"1", "2"}  # by node id; node 3 missed the deadline
