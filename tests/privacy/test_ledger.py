"""The node's privacy ledger (``ledger.py``) and what a client sends beside its update.

In this process: a second run on the same data continues from the first run's epsilon, and the
node's own budget holds whatever the run config says; the server neither sends nor keys by
what a client says of itself; a changed prompt set is a new entry, the same prompts one entry
in every stage; a crash after the ledger write over-counts; ``privacy.metrics`` and
``privacy.num_examples``; bad ledger paths. In two real processes: concurrent spenders never
exceed the budget.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters

from flwr_verl.config import ConfigError, FederationConfig, SecAggConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.federation import node as node_module
from flwr_verl.federation.client import VerlClient, client_from_context, reported_num_examples
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import STATUS_BUDGET, STATUS_OK, FitConfig, FitReport, PrivacyReport
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount
from flwr_verl.privacy.ledger import DataSetKey, LedgerError, PrivacyLedger, fingerprint_prompts
from flwr_verl.stages import unit_prompts
from flwr_verl.tools.cli import main as cli_main

DELTA = 1e-5
REPO = Path(__file__).resolve().parents[2]
PRIVATE = {"enabled": True, "noise_multiplier": 1.0, "deterministic": True}
ONE_ITERATION = {"local_iterations": 1}


def fit_config(server_round: int = 1) -> dict:
    return FitConfig(server_round=server_round, local_iterations=1, planned_iterations=1,
                     proximal_mu=0.0).to_config()


def node(ledger, run_id: int, **node_config) -> Context:
    return Context(run_id=run_id, node_id=7, state=RecordDict(), run_config={},
                   node_config={"partition-id": 0, "num-partitions": 1, "privacy-ledger": str(ledger), **node_config})


@pytest.fixture
def new_process(monkeypatch):
    """Forget the per-process ledger connections, as a restarted node would."""
    monkeypatch.setattr(node_module, "_LEDGERS", {})


def test_a_new_run_on_the_same_data_continues_and_the_nodes_budget_holds(tiny_config, tmp_path, new_process):
    """Run 2 (a new run id, a new process, no budget in its run config) starts from run 1's
    epsilon; the node's own ``epsilon-budget``, set between one and two rounds' worth, refuses it."""
    config = tiny_config(privacy=PRIVATE, trainer=ONE_ITERATION)
    ledger = tmp_path / "ledger.sqlite"
    first_run = client_from_context(node(ledger, run_id=1), config)
    _, _, metrics = first_run.fit(first_run.adapters.get_arrays(), fit_config())
    first = FitReport.from_metrics(metrics).privacy
    spent_once = PrivacyLedger(ledger).account(first_run.data_set)
    assert spent_once.steps == 1 and spent_once.epsilon(DELTA) > 0
    assert first.epsilon_run == pytest.approx(spent_once.epsilon(DELTA))

    node_module._LEDGERS.clear()  # the node restarted between the runs
    second_run = client_from_context(node(ledger, run_id=2), config)
    _, _, metrics = second_run.fit(second_run.adapters.get_arrays(), fit_config())
    second = FitReport.from_metrics(metrics).privacy
    spent_twice = PrivacyLedger(ledger).account(second_run.data_set)
    assert spent_twice.steps == 2 and spent_twice.epsilon(DELTA) > first.epsilon_run
    assert second.epsilon_run == pytest.approx(first.epsilon_run)  # the server hears of this run's spend only

    (sigma, q, _), = spent_twice.history
    thrice = spent_twice.after(IterationMechanism(sigma, q), 1).epsilon(DELTA)
    budget = (spent_twice.epsilon(DELTA) + thrice) / 2  # allows two rounds, not three
    third_run = client_from_context(node(ledger, run_id=3, **{"epsilon-budget": budget}), config)
    assert config.privacy.epsilon_budget == 0  # the run itself sets no budget
    update, weight, metrics = third_run.fit(third_run.adapters.get_arrays(), fit_config())
    refusal = FitReport.from_metrics(metrics)
    assert refusal.status == STATUS_BUDGET and weight == 0 and not any(np.any(u) for u in update)
    assert PrivacyLedger(ledger).account(second_run.data_set).steps == 2  # the refusal spent nothing


def report(client_id: str, privacy: PrivacyReport) -> dict:
    return FitReport(status=STATUS_OK, partition_id=0, client_id=client_id, bytes_received=0, bytes_sent=0,
                     privacy=privacy).to_metrics()


def test_a_forged_client_id_changes_nothing():
    """Node b claims node a's client id and says its budget is spent: the server keeps both
    reports apart by node id, sends neither to anyone, and stops sampling b only."""
    from flwr.common import Code, FitRes, Status

    arrays = [np.zeros((2, 2), np.float32)]
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=1, min_available_clients=1,
                                                secagg=SecAggConfig(enabled=False)), arrays, local_iterations=1)
    manager = InProcessClients.named(["a", "b"])
    honest = PrivacyReport(fits_next_round=True, epsilon_run=2.0)
    forged = PrivacyReport(fits_next_round=False, epsilon_run=0.0)
    results = [(manager.proxies[cid], FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 8,
                                             report("hospital-a", privacy)))
               for cid, privacy in (("a", honest), ("b", forged))]
    strategy.aggregate_fit(1, results, [])
    assert strategy.privacy_reports == {"a": honest, "b": forged}
    assert set(strategy.exhausted) == {"b"}
    sampled = strategy.configure_fit(2, ndarrays_to_parameters(arrays), manager)
    assert [proxy.cid for proxy, _ in sampled] == ["a"]
    assert not any("privacy" in key for _, ins in sampled for key in ins.config)  # no history goes out


def test_a_changed_prompt_set_gets_a_new_entry(tiny_config, tmp_path):
    prompts = [row["prompt"] for row in load_rows(tiny_config().data, "train", seed=0)]
    changed = [[{"role": "user", "content": "1+1="}], *prompts[1:]]
    # The same prompts in another order, repeated, or with other message fields: the same data set.
    assert fingerprint_prompts(prompts) == fingerprint_prompts(prompts[::-1]) == fingerprint_prompts(
        prompts + prompts[:3]) == fingerprint_prompts([[{**m, "name": "x"} for m in p] for p in prompts])
    assert fingerprint_prompts(changed) != fingerprint_prompts(prompts) != fingerprint_prompts(prompts[1:])
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    old = DataSetKey(fingerprint_prompts(prompts), "prompt", "old")
    new = DataSetKey(fingerprint_prompts(changed), "prompt")
    ledger.spend(old, IterationMechanism(1.0, 0.25), 3, budget=0, delta=DELTA, accountant="rdp", run_id="1",
                 server_round=1)
    assert ledger.account(new).steps == 0 and ledger.account(old).steps == 3
    assert ledger.account(DataSetKey(old.fingerprint, "client")).rounds == 0  # another privacy unit, another budget


def test_the_same_prompts_spend_one_budget_across_stages(tiny_config, tmp_path):
    """SFT on a client's private prompts, then PPO on the same prompts: the policy's first round
    continues the SFT round's account. A reward model's preference units of the same prompts key
    alike, and DPO on them continues the same account; other prompts (the validation split) have a
    budget of their own."""
    from flwr_verl.stages.preference import PreferenceUnit
    from flwr_verl.stages.sft import load_units

    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    policy = tiny_config(privacy=PRIVATE, trainer=ONE_ITERATION)
    sft = dataclasses.replace(policy, stage="sft")
    rows = load_rows(policy.data, "train", seed=0)
    sft_client = VerlClient(sft, load_units(sft.data, "train", seed=0), [], ledger=ledger, run_id="sft")
    _, _, metrics = sft_client.fit(sft_client.adapters.get_arrays(), fit_config())
    after_sft = ledger.account(sft_client.data_set)
    policy_client = VerlClient(policy, rows, [], ledger=ledger, run_id="policy")
    _, _, metrics = policy_client.fit(policy_client.adapters.get_arrays(), fit_config())
    after_policy = ledger.account(policy_client.data_set)
    assert policy_client.data_set == sft_client.data_set
    assert after_sft.steps == 1 and after_policy.steps == 2
    assert after_policy.epsilon(DELTA) > after_sft.epsilon(DELTA)
    assert [run.run_id for run in ledger.runs(policy_client.data_set)] == ["sft", "policy"]

    pairs = [PreferenceUnit(row["data_source"], row["prompt"], [(row["reward_model"]["ground_truth"], "0")])
             for row in rows]
    reward_model = dataclasses.replace(policy, stage="reward_model")
    assert fingerprint_prompts(unit_prompts(reward_model, pairs)) == policy_client.data_set.fingerprint
    # DPO on preference pairs of the same prompts is charged to the same account, like any stage
    dpo_client = VerlClient(dataclasses.replace(policy, stage="dpo"), pairs, [], ledger=ledger, run_id="dpo")
    _, _, metrics = dpo_client.fit(dpo_client.adapters.get_arrays(), fit_config())
    assert dpo_client.data_set == policy_client.data_set and ledger.account(dpo_client.data_set).steps == 3
    assert [run.run_id for run in ledger.runs(dpo_client.data_set)] == ["sft", "policy", "dpo"]
    held_out = VerlClient(policy, load_rows(policy.data, "val", seed=0), [], ledger=ledger)
    assert held_out.data_set != policy_client.data_set and ledger.account(held_out.data_set).steps == 0


# One spender, run in this process and in another: one iteration at a time until the ledger refuses.
def spend_until_refused(ledger, budget, run_id):
    spent, key, mechanism = 0, DataSetKey("shared-data", "prompt"), IterationMechanism(1.0, 0.1)
    while not ledger.spend(key, mechanism, 1, budget=budget, delta=1e-5, accountant="rdp", run_id=run_id,
                           server_round=spent + 1).refused:
        spent += 1
    return spent

# The other node's process imports the ledger only, warms the accountant, says "ready", and
# spends once the start file appears.
SPENDER = """
import sys, time
from pathlib import Path
from flwr_verl.privacy.ledger import DataSetKey, PrivacyLedger
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount
""" + inspect.getsource(spend_until_refused) + """
path, budget, start = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
PrivacyAccount().after(IterationMechanism(1.0, 0.1), 1).epsilon(1e-5)
print("ready", flush=True)
deadline = time.monotonic() + 60
while not start.exists():
    assert time.monotonic() < deadline, "no start signal within 60 s"
    time.sleep(0.001)
print(spend_until_refused(PrivacyLedger(path), budget, "run-b"))
"""


def test_concurrent_spenders_never_exceed_the_budget(tmp_path):
    """This process and another spend the same data set's budget at once: together they spend
    exactly what one spender alone could, and the total stays within the budget."""
    mechanism, allowed = IterationMechanism(1.0, 0.1), 40
    budget = (PrivacyAccount().after(mechanism, allowed).epsilon(DELTA)
              + PrivacyAccount().after(mechanism, allowed + 1).epsilon(DELTA)) / 2
    path, start = tmp_path / "ledger.sqlite", tmp_path / "start"
    ledger = PrivacyLedger(path)  # created before the race
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    other = subprocess.Popen([sys.executable, "-c", SPENDER, str(path), repr(budget), str(start)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline() == "ready\n", other.communicate(timeout=60)
        start.touch()
        mine = spend_until_refused(ledger, budget, "run-a")
        out, err = other.communicate(timeout=60)
    finally:
        other.kill()
    assert other.returncode == 0, err
    assert mine + int(out) == allowed, (mine, out)
    total = ledger.account(DataSetKey("shared-data", "prompt"))
    assert total.steps == allowed and total.epsilon(DELTA) <= budget


def test_a_crash_between_the_ledger_write_and_the_send_over_counts(tiny_config, tmp_path, new_process):
    """The spend is committed before training starts: another connection (a restarted node) sees
    it while the fit is still running, and after the fit dies it is still counted, once."""
    config = tiny_config(privacy=PRIVATE, trainer=ONE_ITERATION)
    path = tmp_path / "ledger.sqlite"
    node_client = client_from_context(node(path, run_id=1), config)
    seen_during_training = []

    def crash(*args, **kwargs):
        seen_during_training.append(PrivacyLedger(path).account(node_client.data_set).steps)
        raise SystemExit("the node died before sending")

    node_client.trainer.fit = crash
    with pytest.raises(SystemExit):
        node_client.fit(node_client.adapters.get_arrays(), fit_config())
    assert seen_during_training == [1]
    node_module._LEDGERS.clear()
    restarted = client_from_context(node(path, run_id=1), config)
    _, _, metrics = restarted.fit(restarted.adapters.get_arrays(), fit_config())
    assert PrivacyLedger(path).account(restarted.data_set).steps == 2  # the lost round still counts


@pytest.mark.parametrize(("metrics", "num_examples", "sends_training", "weight"), [
    ("auto", "exact", False, 32), ("none", "fixed", False, 1), ("clear", "bucketed", True, 32),
])
def test_privacy_metrics_and_num_examples_decide_what_the_strategy_receives(tiny_config, metrics, num_examples,
                                                                            sends_training, weight):
    """The FitRes the strategy gets: under ``none`` (and ``auto`` under DP) only the protocol's
    entries, no training metric of any kind."""
    config = tiny_config(privacy={**PRIVATE, "metrics": metrics, "num_examples": num_examples}, trainer=ONE_ITERATION)
    train, val = load_rows(config.data, "train", seed=0), load_rows(config.data, "val", seed=0)
    client = VerlClient(config, train, val, partition_id=0)
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=1, min_available_clients=1,
                                                secagg=SecAggConfig(enabled=False)),
                               client.adapters.get_arrays(), local_iterations=1)
    (_, res), = fit_round(strategy, InProcessClients({"0": client}), 1)[0]
    protocol = {"status", "partition_id", "client_id", "bytes_received", "bytes_sent", "iterations"}
    assert res.num_examples == weight
    assert {k for k in res.metrics if not k.startswith("privacy.")} >= protocol
    assert any(k.startswith("training.") for k in res.metrics) == sends_training
    if not sends_training:
        assert {k for k in res.metrics if not k.startswith("privacy.")} == protocol


def test_reported_num_examples():
    assert [reported_num_examples("bucketed", n) for n in (1, 2, 3, 32, 33, 100)] == [1, 2, 4, 32, 64, 128]
    assert reported_num_examples("fixed", 777) == 1 and reported_num_examples("exact", 777) == 777


def test_ledger_show_prints_each_data_set_per_run_and_in_total(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    ledger = PrivacyLedger(path)
    key = DataSetKey("ab" * 32, "prompt", "task 'arithmetic' seed 0, partition 0, 32 prompts")
    for run_id, rounds in (("11", (1, 2)), ("12", (1,))):
        for server_round in rounds:
            ledger.spend(key, IterationMechanism(1.0, 0.25), 5, budget=0, delta=DELTA, accountant="rdp",
                         run_id=run_id, server_round=server_round)
    assert cli_main(["ledger", "show", str(path), "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    run_11 = PrivacyAccount().after(IterationMechanism(1.0, 0.25), 10).epsilon(DELTA)
    total = PrivacyAccount().after(IterationMechanism(1.0, 0.25), 15).epsilon(DELTA)
    assert f"data set {'ab' * 8} (privacy unit: prompt): task 'arithmetic'" in out
    assert f"run 11: rounds 1-2, 10 iterations, epsilon {run_11:.3f}" in out
    assert f"total: 15 iterations, epsilon {total:.3f}" in out, out


def test_client_level_spends_are_their_own_entry_shown_and_held_to_their_budget(tmp_path, capsys):
    """Client-level DP's rounds go to the same data set under privacy unit "client", composed at
    sampling rate 1 (the node does not trust the server's sampling), never mixed with its
    per-prompt spends; past ``budget`` a round is refused and nothing is written."""
    from flwr_verl.config import ClientLevelConfig
    from flwr_verl.privacy import distributed_dp as ddp

    path = tmp_path / "ledger.sqlite"
    ledger = PrivacyLedger(path)
    prompts = DataSetKey("cd" * 32, "prompt", "task 'arithmetic' seed 0, partition 1, 32 prompts")
    clients = DataSetKey(prompts.fingerprint, ddp.PRIVACY_UNIT, prompts.description)
    plan = ddp.plan_round(ClientLevelConfig(enabled=True, noise_multiplier=2.0), dim=64, num_clients=3, min_survivors=2)
    ledger.spend(prompts, IterationMechanism(1.0, 0.25), 5, budget=0, delta=DELTA, accountant="rdp", run_id="11",
                 server_round=1)

    def rounds(n: int) -> float:
        account = ddp.ClientLevelAccount()
        for _ in range(n):
            account.record(plan, sample_rate=1.0)
        return account.epsilon(DELTA)

    budget = (rounds(3) + rounds(4)) / 2
    answers = [ledger.spend_client_level(clients, plan, budget=budget, delta=DELTA, run_id=run_id, server_round=r)
               for run_id, r in (("11", 1), ("11", 2), ("12", 1), ("12", 2))]
    assert [a.refused for a in answers] == [False, False, False, True]
    assert answers[2].epsilon_after == pytest.approx(rounds(3)) and answers[3].epsilon_after == answers[3].epsilon_before
    reopened = PrivacyLedger(path, read_only=True)
    assert reopened.account(clients).rounds == 3 and reopened.account(clients).epsilon(DELTA) == pytest.approx(rounds(3))
    assert reopened.account(prompts).steps == 5  # the per-prompt account is untouched
    with pytest.raises(LedgerError, match="privacy unit 'client'"):
        ledger.spend_client_level(prompts, plan, budget=0, delta=DELTA, run_id="13", server_round=1)

    assert cli_main(["ledger", "show", str(path), "--client-level-delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert f"data set {'cd' * 8} (privacy unit: client): task 'arithmetic'" in out
    assert f"run 11: rounds 1-2, 2 rounds, epsilon {rounds(2):.3f}" in out
    assert f"total: 3 rounds, epsilon {rounds(3):.3f}" in out
    assert "total: 5 iterations" in out  # the prompt unit's entry, shown as before


@pytest.mark.parametrize("value", [0, -1.0, "2", True])
def test_a_bad_client_epsilon_budget_fails_before_training_naming_the_key(tiny_config, tmp_path, new_process, value):
    config = tiny_config(privacy=PRIVATE)
    with pytest.raises(ConfigError, match=rf"node config client-epsilon-budget={value!r} is invalid: must be a "
                                          "number > 0"):
        client_from_context(node(tmp_path / "ledger.sqlite", 1, **{"client-epsilon-budget": value}), config)


def test_bad_ledger_paths_fail_before_training(tiny_config, tmp_path, new_process, capsys):
    config = tiny_config(privacy=PRIVATE)
    with pytest.raises(LedgerError, match=r"node config privacy-ledger='.*/absent/ledger.sqlite' is invalid: "
                                          r"directory '.*/absent' does not exist"):
        client_from_context(node(tmp_path / "absent" / "ledger.sqlite", 1), config)
    (tmp_path / "a-directory").mkdir()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database, " * 64)
    for unusable in (tmp_path / "a-directory", garbage):
        with pytest.raises(LedgerError, match="the privacy ledger must be a writable SQLite file"):
            client_from_context(node(unusable, 1), config)
    with pytest.raises(ConfigError, match=r"node config privacy-ledger='' is invalid: must be a file path"):
        client_from_context(node("", 1), config)
    assert garbage.read_bytes() == b"not a database, " * 64  # left as it was
    assert cli_main(["ledger", "show", str(tmp_path / "missing.sqlite")]) == 2
    assert "cannot read the privacy ledger" in capsys.readouterr().err
    assert not (tmp_path / "missing.sqlite").exists()


def test_a_spender_waits_for_the_write_lock_with_a_deadline_and_says_why(tmp_path):
    path = tmp_path / "ledger.sqlite"
    waiting = PrivacyLedger(path, timeout=0.2)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another run in the middle of its check-and-spend
    try:
        with pytest.raises(LedgerError, match=r"no write lock within 0.2 s \(another run is holding it\)"):
            waiting.spend(DataSetKey("d", "prompt"), IterationMechanism(1.0, 0.1), 1, budget=0, delta=DELTA,
                          accountant="rdp", run_id="r", server_round=1)
    finally:
        holder.execute("ROLLBACK")
    assert waiting.account(DataSetKey("d", "prompt")).steps == 0
