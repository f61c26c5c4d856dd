"""Faults: failing clients, dead SuperNodes, a killed server, NaN updates and spent privacy budgets.

The first part drives ``VerlClient`` and ``FedProxAdapters`` in this process (fast). The slow
part runs the app on a real SuperLink with 3 SuperNodes (``deploy/launch.py``), SecAgg+ and DP
on, and kills real processes:

- a client whose fit raises (``inject-failure-partition``): a failure of the round, never
  aggregated; then the SuperLink (with its ServerApp) is SIGKILLed after round 1, restarted, and
  the run resumed with ``resume``: it starts from the saved round-1 adapter, bit for bit, with
  the privacy ledger intact, and runs round 2, once;
- two SuperNodes killed in the fit stage of round 3: fewer than the threshold survive, the run
  fails with one line that says why, and the saved adapters are untouched;
- with evaluation on, a SuperNode lost mid-fit: in the clear the round is saved, then evaluated
  on the survivors, and the run finishes; under SecAgg+ the round completes with the 2
  survivors (reconstruction threshold 2), its aggregate is the mean of exactly their updates,
  which this process recomputes (``privacy.deterministic`` makes a client's update
  reproducible), but the 2 left cannot run another round, so the run stops with one line saying
  so, and resumes once the node is back.

The deployment parts run with every node on a warm engine (node config ``engine``, the default:
a killed SuperNode's engine process outlives it, as on a machine whose SuperNode alone crashed,
and serves it again once it is back), and with ``FLWR_VERL_FAULT_ENGINES=warm,cold`` every node
cold too.

Killed SuperNodes get SIGTERM after their ClientApp got SIGKILL (see
``LocalDeployment.kill_supernode``); with SIGKILL the SuperLink would notice only when the
node's heartbeat lapses, which costs up to a minute and changes nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Error
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from flwr_verl.config import FederationConfig, SecAggConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.engine.trainer import FitResult
from flwr_verl.federation.checkpoint import CheckpointError, load_state
from flwr_verl.federation.client import NonFiniteUpdate, VerlClient
from flwr_verl.federation.inprocess import InProcessClients
from flwr_verl.federation.protocol import STATUS_BUDGET, STATUS_OK, FitConfig, FitReport, PrivacyReport, SecAggBounds
from flwr_verl.federation.rounds import RoundFailed, StopFederation
from flwr_verl.federation.rundir import RunDirectory, fingerprint
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount, sample_rate
from tests.flower_harness import (
    FAULT_RUN,
    REPO,
    RUN_DEADLINE_S,
    count_in,
    engine_params,
    initial_adapter,
    local_deployment,
    records,
    replay_updates,
    run_directories,
    saved_adapter,
    tree_digest,
    weighted_mean,
)

ATOL = 1e-5  # SecAgg+ quantisation error is ~1e-9; an update that should not be there is ~1e-3


def max_abs(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


# ============================================================================ in this process
@pytest.fixture(scope="module")
def rows(tiny_config):
    config = tiny_config()
    return load_rows(config.data, "train", seed=0), load_rows(config.data, "val", seed=0)


def report(partition_id: int, status: str = STATUS_OK, privacy: PrivacyReport | None = None) -> dict:
    """A client's report, as metrics on the wire."""
    return FitReport(status=status, partition_id=partition_id, client_id=str(partition_id), bytes_received=0,
                     bytes_sent=0, privacy=privacy).to_metrics()


def fit_res(update, num_examples, metrics) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), num_examples, metrics)


def fit_config(**overrides) -> dict:
    return FitConfig(**{"server_round": 1, "local_iterations": 1, "planned_iterations": 1, "proximal_mu": 0.0,
                        **overrides}).to_config()


def strategy_for(arrays, *, secure=False, **federation) -> FedProxAdapters:
    config = FederationConfig(min_fit_clients=federation.pop("min_fit_clients", 2), min_available_clients=1,
                              secagg=SecAggConfig(enabled=secure), **federation)
    return FedProxAdapters(config, arrays, local_iterations=1,
                           secure_aggregation=SecAggBounds(1.0, 64.0) if secure else None)


def poison(client: VerlClient, value: float) -> None:
    def fit(iterations, **kwargs):
        with torch.no_grad():
            client.adapters.parameters[0].view(-1)[0] = value
        return FitResult(metrics=[], mechanism=None)

    client.trainer.fit = fit


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_client_rejects_a_non_finite_update_before_sending(tiny_config, rows, value, monkeypatch):
    client = VerlClient(tiny_config(), *rows, partition_id=2)
    poison(client, value)
    with pytest.raises(NonFiniteUpdate, match=r"NaN or inf in 1 of \d+ arrays \(first: policy/.*\); not sent"):
        client.fit(client.adapters.get_arrays(), fit_config())


def test_a_round_with_a_poisoned_client_is_not_poisoned(tiny_config, rows):
    config = tiny_config()
    initial = build_models(config.model, with_critic=False).adapters.get_arrays()
    strategy = strategy_for(initial)
    (_, fit_ins), *_ = strategy.configure_fit(1, ndarrays_to_parameters(initial), InProcessClients.named(["0", "1", "2"]))
    results, updates = [], []
    proxies = InProcessClients.named(["0", "1", "2"]).proxies
    for pid in (0, 1):
        client = VerlClient(config, *rows, partition_id=pid)
        update, n, metrics = client.fit([a.copy() for a in initial], dict(fit_ins.config))
        results.append((proxies[str(pid)], fit_res(update, n, metrics)))
        updates.append((update, n))
    bad = VerlClient(config, *rows, partition_id=2)
    poison(bad, float("nan"))
    with pytest.raises(NonFiniteUpdate) as error:  # what the ClientApp's mod turns into an error reply
        bad.fit([a.copy() for a in initial], dict(fit_ins.config))
    failure = Exception(Error(code=1, reason=f"partition 2: NonFiniteUpdate: {error.value}"))
    # A client without the check (say, another implementation) sends NaN in the clear: rejected too.
    nan_update = [np.full_like(a, np.nan) for a in initial]
    sneaky = (InProcessClients.named(["3"]).proxies["3"], fit_res(nan_update, 32, report(3)))

    _, metrics = strategy.aggregate_fit(1, results + [sneaky], [failure])
    assert max_abs([a - b for a, b in zip(strategy.global_arrays, initial)], weighted_mean(updates)) < 1e-6
    assert all(np.isfinite(a).all() for a in strategy.global_arrays)
    assert metrics["num_clients"] == 2 and metrics["num_failures"] == 2
    failures = strategy.state_dict()["last_round"]["failures"]
    assert any("partition 2: NonFiniteUpdate" in m for m in failures)
    assert any("non-finite update rejected" in m for m in failures)


def test_a_report_that_breaks_the_protocol_is_a_failure_not_a_crash():
    initial = [np.zeros((2, 2), np.float32)]
    strategy = strategy_for(initial, min_fit_clients=1)
    proxies = InProcessClients.named(["0", "1"]).proxies
    good = (proxies["0"], fit_res([np.ones((2, 2))], 8, report(0)))
    garbled = (proxies["1"], fit_res([np.ones((2, 2))], 8, {"status": "ok", "partition_id": "one"}))
    _, metrics = strategy.aggregate_fit(1, [good, garbled], [])
    assert metrics["num_clients"] == 1 and metrics["num_failures"] == 1
    (failure,) = strategy.state_dict()["last_round"]["failures"]
    assert "client 1: unreadable report" in failure and "'partition_id'='one' must be of type int" in failure


def test_a_non_finite_secure_aggregate_fails_the_round_and_keeps_the_adapter():
    initial = [np.zeros((2, 3), np.float32)]
    strategy = strategy_for(initial, secure=True, min_fit_clients=3)
    proxy = InProcessClients.named(["0"]).proxies["0"]
    with pytest.raises(RoundFailed, match=r"round 1: the securely aggregated update of 1 clients is not one that "
                                          r"honest clients can send: 6 of 6 coordinates are outside \+-1 .*6 not finite"):
        strategy.aggregate_fit(1, [(proxy, fit_res([np.full((2, 3), np.nan)], 8, report(0)))], [])
    assert np.array_equal(strategy.global_arrays[0], initial[0])


def test_clients_over_their_epsilon_budget_are_refused_and_the_run_goes_on(tiny_config, rows):
    """Client 2's budget is below one round: it refuses. Client 1's allows one round: it trains,
    reports that the next would exceed it, and is not sampled again. Client 0 goes on alone."""
    privacy = {"enabled": True, "noise_multiplier": 1.0, "deterministic": True}
    base = tiny_config(privacy=privacy)
    mechanism = IterationMechanism(1.0, sample_rate(base.data.train_batch_size, len(rows[0])), base.actor.ppo_epochs)
    eps = [PrivacyAccount().after(mechanism, k).epsilon(base.privacy.delta) for k in (1, 2)]
    budgets = {0: 1e6, 1: (eps[0] + eps[1]) / 2, 2: eps[0] / 2}
    clients = {pid: VerlClient(tiny_config(privacy={**privacy, "epsilon_budget": budgets[pid]}), *rows,
                               partition_id=pid) for pid in budgets}
    initial = build_models(base.model, with_critic=False).adapters.get_arrays()
    strategy = strategy_for(initial, min_fit_clients=1)
    manager = InProcessClients.named(["0", "1", "2"])

    def run_round(server_round):
        sampled = strategy.configure_fit(server_round, ndarrays_to_parameters(strategy.global_arrays), manager)
        results = []
        for proxy, fit_ins in sampled:
            update, n, metrics = clients[int(proxy.cid)].fit(parameters_to_ndarrays(fit_ins.parameters),
                                                             dict(fit_ins.config))
            results.append((proxy, fit_res(update, n, metrics)))
        _, metrics = strategy.aggregate_fit(server_round, results, [])
        return {int(p.cid): (r.num_examples, FitReport.from_metrics(r.metrics)) for p, r in results}, metrics

    first, first_metrics = run_round(1)
    assert sorted(first) == [0, 1, 2]
    assert first[2][0] == 0 and first[2][1].status == STATUS_BUDGET
    assert first[1][1].status == STATUS_OK and not first[1][1].privacy.fits_next_round
    assert first_metrics["num_clients"] == 2 and first_metrics["num_refused"] == 1
    assert all(np.isfinite(a).all() for a in strategy.global_arrays)

    second, second_metrics = run_round(2)
    assert sorted(second) == [0]  # the others are no longer sampled
    assert second[0][1].privacy.epsilon_run > first[0][1].privacy.epsilon_run
    assert second[0][1].privacy.fits_next_round
    # The run's epsilon is the maximum over every node seen in it, so it never decreases.
    assert second_metrics["epsilon_run"] == max(r.privacy.epsilon_run for r in
                                                [second[0][1], first[1][1], first[2][1]])
    assert second_metrics["epsilon_run"] >= first_metrics["epsilon_run"]

    strategy.config = dataclasses.replace(strategy.config, min_fit_clients=2)
    with pytest.raises(StopFederation, match=r"only 1 of 3 clients can train another round"):
        strategy.configure_fit(3, ndarrays_to_parameters(strategy.global_arrays), manager)
    # The exhausted clients are part of the strategy's state: a resumed run does not sample them.
    resumed = strategy_for(initial, min_fit_clients=2)
    resumed.load_state_dict(strategy.state_dict())
    with pytest.raises(StopFederation, match=r"only 1 of 3 clients can train another round"):
        resumed.configure_fit(1, ndarrays_to_parameters(resumed.global_arrays), manager)


def test_secagg_round_where_every_client_refuses_stops_cleanly():
    """Under SecAgg+ all-zero weights make Flower divide by zero: the aggregate arrives as NaN.
    The strategy sees that every client refused, keeps the adapter and stops the run normally."""
    initial = [np.ones((2, 2), np.float32)]
    strategy = strategy_for(initial, secure=True, min_fit_clients=3)
    proxies = InProcessClients.named(["0", "1", "2"]).proxies
    privacy = PrivacyReport(fits_next_round=False, epsilon_run=1.0)
    refused = [(proxies[c], fit_res([np.full((2, 2), np.nan)], 0, report(int(c), STATUS_BUDGET, privacy)))
               for c in proxies]
    with pytest.raises(StopFederation, match="round 1: 3 of 3 sampled clients refused to train: their privacy "
                                             "budget is spent; stopping after round 0"):
        strategy.aggregate_fit(1, refused, [])
    assert np.array_equal(strategy.global_arrays[0], initial[0])


def test_node_config_can_only_tighten_the_epsilon_budget(tiny_config, rows):
    from flwr.app import Context, RecordDict

    from flwr_verl.config import ConfigError
    from flwr_verl.federation.client import client_from_context

    def context(node_config):
        return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1, **node_config},
                       state=RecordDict(), run_config={})

    def budget(run_budget, node_config):
        config = tiny_config(privacy={"enabled": True, "epsilon_budget": run_budget})
        return client_from_context(context(node_config), config).config.privacy.epsilon_budget

    assert budget(8.0, {}) == 8.0
    assert budget(8.0, {"epsilon-budget": 1.5}) == 1.5  # the stricter one
    assert budget(8.0, {"epsilon-budget": 20}) == 8.0
    assert budget(0.0, {"epsilon-budget": 3}) == 3.0  # no federation budget: the node's
    with pytest.raises(ConfigError, match=r"node config epsilon-budget=-1.0 is invalid: must be a number > 0"):
        budget(8.0, {"epsilon-budget": -1.0})


def test_checkpoints_are_atomic_and_resume_reconciles_metrics(tiny_config, tmp_path):
    """Killed between saving round 2 and appending its metrics, with a half-written round 3 and a
    metrics line of a round that has no checkpoint: resume sees rounds 0, 1 and 2, once each."""
    config = tiny_config()
    adapters = build_models(config.model, with_critic=False).adapters
    strategy = strategy_for(adapters.get_arrays(), min_fit_clients=1)
    proxy = InProcessClients.named(["0"]).proxies["0"]
    run = RunDirectory(tmp_path / "run-x", adapters)
    run.append_metrics({"round": 0, "evaluate": {"reward": 0.5}})
    for server_round in (1, 2):
        update = [np.full_like(a, 0.125, dtype=np.float64) + 1e-12 for a in strategy.global_arrays]  # float64 only
        strategy.aggregate_fit(server_round, [(proxy, fit_res(update, 8, report(0)))], [])
        run.save(strategy.state_dict(), final=False)
        if server_round == 1:
            run.append_metrics(strategy.state_dict()["last_round"])
    run.append_metrics({"round": 3, "fit": {}})  # save-every > 1: a round after the checkpoint
    (run.path / "adapters" / ".round-0003.tmp").mkdir()  # killed while writing round 3
    (run.path / "adapters" / "round-0002" / "server_state.pt").write_bytes(b"planted: never read")

    resumed_run = RunDirectory(run.path, build_models(config.model, with_critic=False).adapters)
    state = resumed_run.last_checkpoint()
    assert state["round"] == 2 and [r["round"] for r in resumed_run.records()] == [0, 1, 2]
    resumed = strategy_for(adapters.get_arrays(), min_fit_clients=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.weights, strategy.weights))  # float64, exactly
    assert resumed.completed_round == 2 and resumed.round_number(1) == 3
    assert fingerprint(resumed.global_arrays) == fingerprint(strategy.global_arrays)


def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(tiny_config, tmp_path):
    config = tiny_config()
    adapters = build_models(config.model, with_critic=False).adapters
    strategy = strategy_for(adapters.get_arrays(), min_fit_clients=1)
    proxy = InProcessClients.named(["0"]).proxies["0"]
    run = RunDirectory(tmp_path / "run-y", adapters)
    for server_round in (1, 2):
        update = [np.full_like(a, 0.01 * server_round) for a in strategy.global_arrays]
        strategy.aggregate_fit(server_round, [(proxy, fit_res(update, 8, report(0)))], [])
        run.save(strategy.state_dict(), final=False)
        if server_round == 1:
            round_one = [w.clone() for w in strategy.weights]
    tensors = run.path / "adapters" / "round-0002" / "server_state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-8] + b"\0" * 8)  # a torn write
    with pytest.raises(Exception, match="does not match the recorded"):
        load_state(tensors.parent)
    damaged = tree_digest(tensors.parent)
    state = RunDirectory(run.path, adapters).last_checkpoint()
    assert state["round"] == 1 and all(torch.equal(a, b) for a, b in zip(state["weights"], round_one))
    # The damaged round is kept, byte for byte, out of the way of the round that runs again.
    (aside,) = (run.path / "adapters").glob("round-0002.damaged-*")
    assert tree_digest(aside) == damaged and not tensors.parent.exists()
    assert [p.name for p in RunDirectory(run.path, adapters).checkpoints()] == ["round-0001"]


def saved_run(tiny_config, path: Path, rounds: int) -> RunDirectory:
    """A run directory with ``rounds`` checkpoints and their metrics, as a finished run leaves it."""
    adapters = build_models(tiny_config().model, with_critic=False).adapters
    strategy = strategy_for(adapters.get_arrays(), min_fit_clients=1)
    proxy = InProcessClients.named(["0"]).proxies["0"]
    run = RunDirectory(path, adapters)
    run.append_metrics({"round": 0, "evaluate": {"reward": 0.5}})
    for server_round in range(1, rounds + 1):
        update = [np.full_like(a, 0.01 * server_round) for a in strategy.global_arrays]
        strategy.aggregate_fit(server_round, [(proxy, fit_res(update, 8, report(0)))], [])
        run.save(strategy.state_dict(), final=False)
        run.append_metrics(strategy.state_dict()["last_round"])
    return run


def test_resume_with_no_checkpoint_that_verifies_refuses_and_changes_nothing(tiny_config, tmp_path):
    """The only checkpoint's state is damaged and metrics.jsonl ends in a torn line: resume
    refuses, names the file and the ways on (a new run, from the round-1 policy adapter, which
    loads), and leaves every byte of the run directory as it was."""
    run = saved_run(tiny_config, tmp_path / "run-z", rounds=1)
    tensors = run.path / "adapters" / "round-0001" / "server_state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    with open(run.path / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 2, "fi')
    before = tree_digest(run.path)
    with pytest.raises(CheckpointError) as error:
        RunDirectory(run.path, run.adapters).last_checkpoint()
    message = str(error.value)
    for part in (f"resume: {run.path} has no checkpoint that verifies: {tensors}: sha256",
                 "Nothing in it was changed and no client trained", "resume=false", "a new output-dir",
                 f"model.init_adapter={run.path / 'adapters' / 'round-0001' / 'policy'}"):
        assert part in message, message
    assert tree_digest(run.path) == before
    # No adapter that loads: no init_adapter to offer. No checkpoint at all: said so.
    (run.path / "adapters" / "round-0001" / "policy" / "adapter_model.safetensors").write_bytes(b"{")
    with pytest.raises(CheckpointError) as error:
        RunDirectory(run.path, run.adapters).last_checkpoint()
    assert "init_adapter" not in str(error.value)
    shutil.rmtree(run.path / "adapters")
    with pytest.raises(CheckpointError, match=r"no round was checkpointed \(.*adapters holds no round-NNNN\)"):
        RunDirectory(run.path, run.adapters).last_checkpoint()


def test_under_secagg_fewer_than_3_clients_stop_the_run_saying_how_to_go_on():
    initial = [np.zeros((2, 2), np.float32)]
    config = FederationConfig(min_fit_clients=3, min_available_clients=3, connect_timeout=0.05,
                              secagg=SecAggConfig(enabled=True))
    strategy = FedProxAdapters(config, initial, local_iterations=1, secure_aggregation=SecAggBounds(1.0, 64.0))
    three, two = InProcessClients.named(["0", "1", "2"]), InProcessClients.named(["0", "1"])
    cannot = r"SecAgg\+ cannot run with 2 clients \(Flower's SecAgg\+ needs at least 3\): "
    with pytest.raises(RoundFailed, match=r"round 1: only 2 of min-available-clients=3 SuperNodes connected after "
                                          r"connect-timeout=0.05 s; " + cannot + "start more SuperNodes, or start a "
                                          "new run with secagg.enabled=false"):
        strategy.configure_fit(1, ndarrays_to_parameters(initial), two)
    strategy.aggregate_fit(1, [(three.proxies[c], fit_res([np.full((2, 2), 0.5)], 8, report(int(c)))) for c in "012"],
                           [])
    with pytest.raises(RoundFailed, match=cannot + "bring SuperNodes back and run again with resume=true to "
                                                   "continue after round 1, or start a new run with"):
        strategy.configure_fit(2, ndarrays_to_parameters(initial), two)


def test_exchange_matches_replies_to_messages_and_names_the_nodes_that_did_not_answer(monkeypatch):
    """A client's reply, the SuperLink's "node unavailable" for a node that died (sent by the
    SuperLink, not by the node) and silence from a node that hangs: each is told apart, and the
    silent node is a NoReply that names it once the deadline has passed."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.common import GetPropertiesIns, GetPropertiesRes, Message
    from flwr.common.constant import MessageTypeLegacy
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
    from flwr.supercore.task_identity import TaskIdentity

    from flwr_verl.federation.rounds import describe_failures
    from flwr_verl.federation.wire import NodeNamedErrors
    from flwr_verl.federation.workflow import exchange

    for identity in ("_run_id", "_task_id", "_node_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, identity, 1)

    class Grid:
        def push_messages(self, messages):
            for message in messages:  # as Flower's grids do when they push a message
                message.metadata.__dict__["_message_id"] = message.object_id
            alive, dead, _ = messages
            ready = compat.getpropertiesres_to_recorddict(GetPropertiesRes(Status(Code.OK, ""), {}))
            self.replies = [create_message_error_unavailable_res_message(dead.metadata, "node_unavail"),
                            Message(ready, reply_to=alive)]
            return [message.metadata.message_id for message in messages]

        def pull_messages(self, message_ids):
            replies, self.replies = self.replies, []
            return replies

    proxies = [GridClientProxy(node_id=node, grid=None, run_id=1) for node in (11, 22, 33)]
    results, failures = exchange(NodeNamedErrors(Grid()), [(proxy, GetPropertiesIns({})) for proxy in proxies],
                                 MessageTypeLegacy.GET_PROPERTIES, 1, timeout=1)
    assert [proxy.node_id for proxy, _ in results] == [11]
    unavailable, silent = describe_failures(failures)
    assert unavailable.startswith("node 22: Error: Node Unavailable") and unavailable.endswith("(Flower error code 5)")
    assert silent == "NoReply: node 33 sent no get_properties reply within 1 s"


# ============================================================================ real processes
def run_config(out: Path, **overrides) -> dict:
    return {**FAULT_RUN, "output-dir": str(out), **overrides}


def wait_until(predicate, timeout: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


FIT_STAGE = 3  # SecAgg+ sends 4 train messages per round; the 3rd carries the fit instructions


def kill_in_fit_stage(deployment, indices: list[int], process: subprocess.Popen, *, stage: int = FIT_STAGE,
                      graceful: bool = True) -> None:
    """Kill SuperNodes ``indices`` as soon as each receives the fit message of the round that is
    starting (the ``stage``-th train message: 3 under SecAgg+, 1 in the clear), before its
    ClientApp can answer."""
    baseline = {i: count_in(deployment.supernodes[i].log, "Receiving: train message") for i in indices}
    pending = set(indices)
    deadline = time.monotonic() + RUN_DEADLINE_S
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            if count_in(deployment.supernodes[i].log, "Receiving: train message") >= baseline[i] + stage:
                deployment.kill_supernode(i, graceful=graceful)
                pending.discard(i)
        if process.poll() is not None:
            raise AssertionError("the run ended before the fit stage")
        time.sleep(0.1)
    assert not pending, "timed out waiting for the fit stage"


def restart(deployment, indices) -> None:
    for i in indices:
        if deployment.supernodes[i].process.poll() is not None:
            deployment.start_supernode(i)
    for i in indices:
        deployment.wait_supernode(i)
    deployment.wait_online(len(deployment.supernodes))  # a SIGKILLed node's old entry lapses first


def finish(process: subprocess.Popen, log: Path, timeout: float = RUN_DEADLINE_S) -> str:
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return log.read_text(errors="replace")


# The suite runs the faults on the default warm engine; FLWR_VERL_FAULT_ENGINES=warm,cold runs them
# cold too (test_deployment.py runs the whole deployment on both in every suite).
FAULT_ENGINES = os.environ.get("FLWR_VERL_FAULT_ENGINES", "warm").split(",")


@pytest.fixture(scope="module", params=engine_params("faults", FAULT_ENGINES))
def federation(tmp_path_factory, request):
    """Every node on a warm engine (the default), and with FLWR_VERL_FAULT_ENGINES=warm,cold every
    node cold after it: each fault below runs on each."""
    with local_deployment(tmp_path_factory.mktemp(f"faults-{request.param}") / "fl", num_supernodes=3,
                          engine=request.param) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def failed_client_then_resumed(federation, tmp_path_factory):
    """Round 1 with partition 1's fit raising; once round 1 is saved the SuperLink is SIGKILLed
    with everything it spawned (the ServerApp included), as a crash of the server's machine
    would, and restarted on the same port and database; the SuperNodes reconnect by themselves.
    `flwr run` again with resume=true (and no injected failure) runs round 2."""
    root = tmp_path_factory.mktemp("resume")
    out = root / "out"
    first = run_config(out, **{"num-server-rounds": 2, "inject-failure-partition": 1})
    log1 = root / "run1.log"
    process = federation.flwr_run_background(REPO, first, log1)
    try:
        wait_until(lambda: list(out.glob("run-*/adapters/round-0001/server_state.json")), RUN_DEADLINE_S,
                   "the round-1 checkpoint", process)
        assert federation.serverapp_processes(), "no ServerApp process found"
        federation.kill_superlink()
        process.wait(timeout=60)  # `flwr run --stream` loses its SuperLink
    finally:
        if process.poll() is None:
            process.kill()
        if federation.superlink.poll() is not None:
            federation.start_superlink()
    survivors = federation.serverapp_processes()
    (run_dir,) = run_directories(out)
    killed_after = [r["round"] for r in records(run_dir)]
    saved = load_state(run_dir / "adapters" / "round-0001")
    federation.wait_online(3)
    resumed = federation.flwr_run(REPO, {**first, "resume": True, "inject-failure-partition": -1},
                                  timeout=RUN_DEADLINE_S)
    return {"run_dir": run_dir, "config": first, "killed_after": killed_after, "saved": saved,
            "survivors": survivors, "first_log": log1.read_text(errors="replace"),
            "resumed_log": resumed.stdout + resumed.stderr}


@pytest.mark.slow
def test_failing_client_is_a_failure_of_the_round_and_never_aggregated(failed_client_then_resumed):
    run = failed_client_then_resumed
    first = records(run["run_dir"])[0]
    assert first["round"] == 1 and first["clients"] == [0, 2] and first["fit"]["num_clients"] == 2
    assert any("partition 1: RuntimeError: injected failure in partition 1" in f for f in first["failures"])

    initial = initial_adapter(run["config"])
    delta = [a - b for a, b in zip(saved_adapter(run["run_dir"] / "adapters" / "round-0001", run["config"]), initial)]
    updates = replay_updates(run["config"], [0, 1, 2], 3, initial)
    assert max_abs(delta, weighted_mean([updates[0], updates[2]])) < ATOL
    assert max_abs(delta, weighted_mean(updates)) > 10 * ATOL


@pytest.mark.slow
def test_superlink_killed_after_round_1_resumes_at_round_2_from_the_saved_adapter(failed_client_then_resumed):
    run = failed_client_then_resumed
    run_dir, log = run["run_dir"], run["resumed_log"]
    assert run["killed_after"] == [1] and not run["survivors"]  # the ServerApp died with its SuperLink
    match = re.search(r"resume: (\S+) continues after round (\d+) from adapter ([0-9a-f]{16})", log)
    assert match, log
    assert Path(match[1]) == run_dir and match[2] == "1"
    on_disk = fingerprint(saved_adapter(run_dir / "adapters" / "round-0001", run["config"]))
    saved = fingerprint([w.numpy() for w in run["saved"]["weights"]])
    assert match[3] == saved == on_disk  # the adapter it restarted from is the saved one
    rounds = records(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]  # nothing lost, nothing repeated
    assert rounds[1]["fit"]["num_clients"] == 3
    assert rounds[0]["fit"]["epsilon_run"] > 0 and rounds[1]["fit"]["epsilon_run"] > 0  # each run's own
    # The server keeps no privacy account of any node (the nodes' ledgers do), and labels nodes by
    # their node ids: partition 1 failed in round 1, so round 1 knows 2 nodes and round 2 all 3.
    states = [load_state(run_dir / "adapters" / f"round-000{k}") for k in (1, 2)]
    assert all("privacy_ledger" not in state for state in states)
    assert len(states[1]["client_ids"]) == 3 and sorted(states[1]["client_ids"].values()) == ["0", "1", "2"]
    assert all(node.isdigit() and int(node) > 2 for node in states[1]["client_ids"])  # Flower's node ids
    assert (run_dir / "adapters" / "final" / "policy").is_dir()
    # Flower counts the resumed run's rounds from 1; the app's own round numbers go on from 2.
    assert "round 2: training metrics not sent" in log and "round 1: training" not in log  # DP: privacy.metrics=none
    assert log.count("Secure aggregation completed") == 1


@pytest.mark.slow
def test_too_few_survivors_fail_the_round_cleanly_and_keep_the_adapter(federation, failed_client_then_resumed,
                                                                        tmp_path):
    run = failed_client_then_resumed
    run_dir = run["run_dir"]
    before = tree_digest(run_dir / "adapters")
    log = tmp_path / "run3.log"
    config = {**run["config"], "resume": True, "inject-failure-partition": -1, "num-server-rounds": 3}
    process = federation.flwr_run_background(REPO, config, log)
    try:
        kill_in_fit_stage(federation, [1, 2], process)
        text = finish(process, log)
    finally:
        restart(federation, [1, 2])
    # The nodes die in the fit stage; the SuperLink may notice only in the next stage (heartbeats).
    assert re.search(r"round 3: secure aggregation halted at stage '(collect masked vectors|unmask)': "
                     r"1 of 3 sampled clients", text), text
    assert "flwr-verl: run failed: RoundFailed: round 3:" in text and "Traceback" not in text, text
    assert "the run directory keeps the adapter of round 2 (" in text
    assert tree_digest(run_dir / "adapters") == before  # the global adapter stays as it was
    assert not (run_dir / "adapters" / "round-0003").exists()
    assert [r["round"] for r in records(run_dir)] == [1, 2]
    assert federation.run_status(text) == "finished:failed"


def test_under_secagg_a_refusing_client_leaves_the_round_and_is_not_sampled_again(tiny_config, rows):
    """A zero-weight participant would still count towards SecAgg+'s reconstruction threshold, and
    the server could unmask one client's exact update as the "sum". Under SecAgg+ a client over
    its budget therefore leaves the round with an error; the strategy stops sampling it."""
    from flwr_verl.federation.client import PrivacyBudgetExhausted
    from flwr_verl.federation.mods import describe

    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "deterministic": True,
                                  "epsilon_budget": 1e-3})
    client = VerlClient(config, *rows, partition_id=1)
    secure = fit_config(secagg=SecAggBounds(1.0, 64.0))
    with pytest.raises(PrivacyBudgetExhausted, match=r"one more round would pass this node's epsilon budget"):
        client.fit(client.adapters.get_arrays(), secure)
    _, n, metrics = client.fit(client.adapters.get_arrays(), fit_config())  # in the clear: a zero-weight refusal
    assert n == 0 and FitReport.from_metrics(metrics).status == STATUS_BUDGET

    initial = [np.zeros((2, 2), np.float32)]
    strategy = strategy_for(initial, secure=True, min_fit_clients=3)
    manager = InProcessClients.named(["0", "1", "2", "3"])
    error = PrivacyBudgetExhausted("one more round would pass this node's epsilon budget; leaving the SecAgg+ round")
    failure = Exception(Error(code=1, reason=f"node 1: partition 1: {describe(error)}"))  # as NodeNamedErrors names it
    def results(cids):
        return [(manager.proxies[c], fit_res([np.full((2, 2), 0.5)], 8, report(int(c)))) for c in cids]

    strategy.aggregate_fit(1, results("0123"), [])  # round 1: node 1 trained and reported its id
    strategy.aggregate_fit(2, results("023"), [failure])  # round 2: it left for its budget
    sampled = {proxy.cid for proxy, _ in strategy.configure_fit(3, ndarrays_to_parameters(initial), manager)}
    assert sampled == {"0", "2", "3"}

    # A node that claims node 1's client-id and refuses excludes itself, never node 1.
    strategy = strategy_for(initial, secure=True, min_fit_clients=3)
    strategy.aggregate_fit(1, results("0123"), [])
    forged = Exception(Error(code=1, reason=f"node 3: client 1: {describe(error)}"))
    strategy.aggregate_fit(2, results("012"), [forged])
    sampled = {proxy.cid for proxy, _ in strategy.configure_fit(3, ndarrays_to_parameters(initial), manager)}
    assert sampled == {"0", "1", "2"} and set(strategy.exhausted) == {"3"}


def test_resume_refuses_a_changed_model_or_privacy_config_naming_each_key(tmp_path, tiny_config):
    from flwr_verl.config import ConfigError, RunConfig, parse_run_config

    adapters = build_models(tiny_config().model, with_critic=False).adapters
    pinned = {"model.lora_alpha": 16.0, "privacy.noise_multiplier": 0.65}  # whatever the defaults become
    first = parse_run_config({"output-dir": str(tmp_path), **pinned})
    run = RunDirectory.create(str(tmp_path), adapters, first)
    run.save(strategy_for(adapters.get_arrays()).state_dict(), final=False)

    def resume(**overrides) -> RunConfig:
        return parse_run_config({"output-dir": str(tmp_path), "resume": True, **pinned, **overrides})

    with pytest.raises(ConfigError) as error:
        RunDirectory.create(str(tmp_path), adapters, resume(**{"model.lora_alpha": 64.0, "model.lora_rank": 4,
                                                               "privacy.noise_multiplier": 0.3}))
    message = str(error.value)
    for change in ("engine.model.lora_alpha 16.0 -> 64.0", "engine.model.lora_rank 8 -> 4",
                   "engine.privacy.noise_multiplier 0.65 -> 0.3"):
        assert change in message, message
    assert not (run.path / "config_changes.jsonl").exists()
    resumed = RunDirectory.create(str(tmp_path), adapters, resume(**{"num-server-rounds": 12, "fit-timeout": 60.0}))
    assert resumed.path == run.path and resumed.resumed["round"] == 0
    (change,) = [json.loads(line) for line in (run.path / "config_changes.jsonl").read_text().splitlines()]
    assert change["changes"]["federation.num_server_rounds"] == [8, 12]


def test_a_torn_last_metrics_line_is_dropped_and_run_names_never_collide(tmp_path, tiny_config):
    from flwr_verl.config import parse_run_config

    adapters = build_models(tiny_config().model, with_critic=False).adapters
    config = parse_run_config({"output-dir": str(tmp_path)})
    names = {RunDirectory.create(str(tmp_path), adapters, config).path.name for _ in range(5)}  # within a second
    assert len(names) == 5
    run = RunDirectory(tmp_path / sorted(names)[0], adapters)
    run.append_metrics({"round": 1, "fit": {}})
    with open(run.path / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 2, "fi')  # killed during an append
    assert [r["round"] for r in run.records()] == [1]


def test_the_progress_line_and_the_summary_tell_the_story():
    from flwr_verl.federation.server import summary
    from flwr_verl.federation.workflow import progress_line

    record = {"round": 3, "seconds": 21.3, "evaluate": {"accuracy": 0.5625},
              "fit": {"reward_before": 0.2, "reward_after": 0.3, "epsilon_run": 5.6,
                      "bytes_sent": 313344.0, "bytes_received": 626688.0}}
    assert progress_line(record, 8) == ("round 3/8: reward 0.200 -> 0.300 | held-out accuracy 0.562 | epsilon 5.60 "
                                        "in this run | 21.3 s | 0.31 MB up, 0.63 MB down")
    assert summary([{"round": 0, "evaluate": {"accuracy": 0.37}}, record]) == \
        "held-out accuracy 0.370 at round 0 -> 0.562 at round 3, epsilon 5.60 in the last run"


@pytest.mark.slow
@pytest.mark.xdist_group("secagg-threshold-deployment")  # its own SuperLink and SuperNodes
def test_under_secagg_the_server_never_unmasks_fewer_real_contributors_than_the_threshold(tmp_path):
    """Real processes: 3 SuperNodes under SecAgg+ (reconstruction threshold 2), two of them with a
    node budget below one round. They leave the round instead of taking part with weight 0, so
    the one client that trained is alone: the protocol halts before unmasking and the server
    learns nothing (with weight-0 participants it had unmasked that client's exact update). Too
    few clients can still train, for their budgets only: the run ends normally, with the message
    it ends with in the clear."""
    tiny = {"epsilon-budget": 1e-3}
    with local_deployment(tmp_path / "fl", num_supernodes=3, node_config={1: tiny, 2: tiny}) as deployment:
        out = tmp_path / "out"
        done = deployment.flwr_verl_run(REPO, run_config(out, **{"num-server-rounds": 1}), timeout=RUN_DEADLINE_S)
        log = done.stdout + done.stderr
        status = deployment.run_status(log)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].endswith(" finished:completed"), log
    assert "round 1: 2 of 3 sampled clients refused to train: their privacy budget is spent; stopping after " \
           "round 0" in log, log
    assert log.count("PrivacyBudgetExhausted: one more round would pass this node's epsilon budget") >= 2, log
    assert "Secure aggregation completed" not in log and "Traceback" not in log and "RoundFailed" not in log
    (run_dir,) = run_directories(out)
    assert not (run_dir / "adapters").exists() or not list((run_dir / "adapters").glob("round-*"))
    assert status == "finished:completed", status


# Evaluation on; the clear, with 2 of 3 clients enough to go on; short deadlines bound every wait.
PLAIN_EVALUATED = {"secagg.enabled": False, "evaluate-every": 1, "min-available-clients": 2, "min-fit-clients": 2,
                   "fit-timeout": 120.0, "evaluate-timeout": 120.0}


@pytest.mark.slow
def test_a_supernode_lost_mid_fit_round_is_saved_then_evaluated_on_the_survivors(federation, tmp_path):
    """SuperNode 2 dies as its fit instruction arrives (its ClientApp SIGKILLed mid-fit). The
    round aggregates the 2 survivors, is checkpointed before it is evaluated, is evaluated on
    whoever is left (fewer than min-evaluate-clients=3) within evaluate-timeout, and the run
    finishes. (A node SIGKILLed whole is noticed only when its heartbeat lapses, up to 60 s:
    the same path, slower; ``test_exchange_names_the_nodes_that_sent_no_reply`` covers the
    deadline itself.)"""
    out, log = tmp_path / "out", tmp_path / "run.log"
    config = run_config(out, **{"num-server-rounds": 1, **PLAIN_EVALUATED})
    process = federation.flwr_run_background(REPO, config, log)
    try:
        kill_in_fit_stage(federation, [2], process, stage=1)
        text = finish(process, log)
    finally:
        restart(federation, [2])
    (run_dir,) = run_directories(out)
    before, first = records(run_dir)
    assert before["round"] == 0 and first["round"] == 1
    assert first["clients"] == [0, 1] and first["fit"]["num_clients"] == 2, first
    assert first["fit"]["num_failures"] == 1, first
    assert "reward" in first["evaluate"] and first["evaluate"]["seconds"] < 120 + 10, first
    saved, evaluated = text.find("round 1: adapter "), text.find("round 1: held-out greedy reward")
    assert 0 <= saved < evaluated, text  # the checkpoint exists before evaluation starts
    assert "round 1: evaluating on the 2 connected clients (min-evaluate-clients=3)" in text, text
    assert "flwr-verl: finished" in text and "Traceback" not in text, text
    assert federation.run_status(text) == "finished:completed"


@pytest.mark.slow
def test_under_secagg_a_supernode_lost_for_good_stops_cleanly_keeping_round_1(federation, tmp_path):
    """Under SecAgg+ with 3 organisations, SuperNode 2 dies in round 1's fit stage and stays
    away. Round 1 completes with the 2 survivors (its aggregate is the mean of exactly their
    updates), is saved and evaluated on them; round 2 cannot
    run (SecAgg+ needs 3): after connect-timeout the run fails with one line that says so and how
    to go on. (That resume=true then continues from the saved round is
    ``test_superlink_killed_after_round_1_resumes_at_round_2_from_the_saved_adapter``'s path.)"""
    out, log = tmp_path / "out", tmp_path / "run.log"
    config = run_config(out, **{"num-server-rounds": 2, "evaluate-every": 1, "connect-timeout": 20.0,
                                "evaluate-timeout": 120.0})
    process = federation.flwr_run_background(REPO, config, log)
    try:
        kill_in_fit_stage(federation, [2], process)
        text = finish(process, log)
    finally:
        restart(federation, [2])
    (run_dir,) = run_directories(out)
    rounds = records(run_dir)
    assert "Secure aggregation completed" in text and [r["round"] for r in rounds] == [0, 1], text
    assert ("round 2: only 2 of min-available-clients=3 SuperNodes connected after connect-timeout=20 s; SecAgg+ "
            "cannot run with 2 clients (Flower's SecAgg+ needs at least 3): bring SuperNodes back and run again "
            "with resume=true to continue after round 1, or start a new run with secagg.enabled=false.") in text, text
    assert "the run directory keeps the adapter of round 1 (" in text and "Traceback" not in text, text
    assert federation.run_status(text) == "finished:failed"
    assert rounds[1]["clients"] == [0, 1] and "reward" in rounds[1]["evaluate"]  # evaluated on the survivors
    assert rounds[1]["fit"]["num_clients"] == 2 and rounds[1]["fit"]["num_failures"] >= 1

    # Round 1's secure aggregate is the mean over the two survivors, and not over all three.
    initial = initial_adapter(config)
    delta = [a - b for a, b in zip(saved_adapter(run_dir / "adapters" / "round-0001", config), initial)]
    updates = replay_updates(config, [0, 1, 2], 3, initial)
    assert max_abs(delta, weighted_mean(updates[:2])) < ATOL
    assert max_abs(delta, weighted_mean(updates)) > 10 * ATOL
