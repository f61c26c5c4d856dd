"""Deployment: the app on a real SuperLink with 3 SuperNodes, over TLS with SuperNode authentication.

``deploy/launch.py`` starts everything on 127.0.0.1: a throwaway CA and server certificate
(``cryptography``), a SuperLink with ``--ssl-*`` and ``--enable-supernode-auth``, one key pair per
SuperNode registered with ``flwr supernode register``, and SuperNodes with ``--root-certificates``,
``--auth-supernode-private-key`` and ``--node-config "partition-id=i num-partitions=3"``. The run
is the simulation test's (2 rounds, DP and SecAgg+ on) and is checked the same way. Then nodes
that must be refused are: one with an unregistered key, one without TLS, one that trusts another CA.
Every process is stopped at the end, whatever happened (``local_deployment``). The module runs
twice: every node on a warm engine (one engine process per node, kept across messages and runs),
then every node cold (a fresh engine in every ClientApp process). The cold half runs what depends
on where the engine lives: the main run, its rounds, epsilon, SecAgg+, budget and ledger, each
message in a fresh process. A second run beside it, a restarted SuperNode and the refused nodes
are checked on the warm half only: the server, the SuperNode and each node's ledger file do the
same whichever engine computes, and each cold message (about 13 CPU-seconds: imports and the
model) would cost the suite minutes of its two cores.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from deploy.certs import make_node_key, make_tls
from deploy.launch import base_env, free_port, kill_processes_with_env
from flwr_verl.config import parse_run_config
from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount, sample_rate
from flwr_verl.privacy.ledger import PrivacyLedger
from tests.flower_harness import (
    REPO,
    RUN_DEADLINE_S,
    SMALL_RUN,
    assert_final_adapter_trained_and_loadable,
    engine_params,
    local_deployment,
    records,
    run_directories,
    tree_digest,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=engine_params("deployment", ("warm", "cold")))
def deployment(tmp_path_factory, request):
    """Every node on a warm engine (node config ``engine``, the default), then every node cold."""
    root = tmp_path_factory.mktemp(f"deploy-{request.param}") / "fl"
    # Node 0 names its ledger file; nodes 1 and 2 keep theirs at the default, under their FLWR_HOME.
    ledger = {0: {"privacy-ledger": str(root / "org-0-ledger.sqlite")}}
    with local_deployment(root, num_supernodes=3, tls=True, auth=True, node_config=ledger,
                          engine=request.param) as fed:
        yield fed


def epsilon_after(rounds: int) -> float:
    """What SMALL_RUN's clients have spent after ``rounds`` rounds."""
    engine = parse_run_config(SMALL_RUN).engine
    q = sample_rate(engine.data.train_batch_size, engine.data.train_size)
    mechanism = IterationMechanism(engine.privacy.noise_multiplier, q, engine.actor.ppo_epochs)
    return PrivacyAccount().after(mechanism, rounds * engine.trainer.local_iterations).epsilon(engine.privacy.delta)


def budget_for_two_rounds() -> float:
    """An epsilon budget that SMALL_RUN's clients can spend in 2 rounds but not in 3."""
    return (epsilon_after(2) + epsilon_after(3)) / 2


# Submitted at the same time as the main run (warm half), to the same SuperLink and SuperNodes and
# the same output-dir: one round in the clear, one local iteration.
OTHER_RUN = {**SMALL_RUN, "num-server-rounds": 1, "secagg.enabled": False, "trainer.local_iterations": 1,
             "evaluate-every": 0}


def run_directory_of(log: str) -> Path:
    match = re.search(r"flwr-verl: run directory (\S+)", log)
    assert match, log[-3000:]
    return Path(match[1])


def engine_of(deployment) -> str:
    return deployment.supernodes[0].node_config["engine"]


def warm_only(deployment, why: str) -> None:
    if engine_of(deployment) == "cold":
        pytest.skip(f"{why}: checked on the warm deployment (the module's docstring says why)")


@pytest.fixture(scope="module")
def deployed_runs(deployment, tmp_path_factory):
    """The simulation test's run (2 rounds), asked for 3 rounds under an epsilon budget that lasts 2:
    after round 2 every client reports that one more round would exceed it, and the run ends
    normally with round 2's adapter as the final one. On the warm half ``OTHER_RUN`` runs
    alongside it (``other``: its process and log; None on the cold half)."""
    out = tmp_path_factory.mktemp("deploy-out")
    config = {**SMALL_RUN, "num-server-rounds": 3, "privacy.epsilon_budget": budget_for_two_rounds(),
              "output-dir": str(out)}
    other = other_log = None
    if engine_of(deployment) == "warm":
        other_log = out.parent / "other-run.log"
        other = deployment.flwr_run_background(REPO, {**OTHER_RUN, "output-dir": str(out)}, other_log)
    try:
        done = deployment.flwr_verl_run(REPO, config, timeout=RUN_DEADLINE_S)  # exits with the run's status
        log = done.stderr + done.stdout  # stdout: the streamed log, then the status line
        assert done.returncode == 0, f"flwr-verl run failed:\n{log[-6000:]}"
        yield {"main": (run_directory_of(log), log, deployment.run_status(log)),
               "other": None if other is None else (other, other_log), "out": out}
    finally:
        if other is not None and other.poll() is None:
            other.kill()


@pytest.fixture(scope="module")
def deployed_run(deployed_runs):
    return deployed_runs["main"]


def test_the_federation_is_tls_with_supernode_auth(deployment):
    superlink_log = deployment.superlink_log.read_text()
    assert "--insecure" not in " ".join(deployment.commands) and "--enable-supernode-auth" in deployment.commands[0]
    assert "SuperNode authentication is disabled" not in superlink_log
    config = (deployment.flwr_home / "config.toml").read_text()
    assert f'address = "127.0.0.1:{deployment.port}"' in config and "root-certificates" in config
    assert "insecure" not in config
    for node in deployment.supernodes:
        text = node.log.read_text()
        assert "SuperNode ID:" in text and "insecure" not in text.lower()


def test_every_round_is_recorded_with_epsilon(deployed_run):
    run_dir, _, _ = deployed_run
    rounds = records(run_dir)
    assert [r["round"] for r in rounds] == [0, 1, 2]  # round 0: the initial adapter, evaluated before training
    assert 0 <= rounds[0]["evaluate"]["accuracy"] <= 1 and "fit" not in rounds[0]
    rounds = rounds[1:]
    for record in rounds:
        assert record["fit"]["num_clients"] == 3 and record["clients"] == [0, 1, 2]
        assert record["fit"]["epsilon_run"] > 0
        assert 0 <= record["evaluate"]["reward"] <= 1
    assert rounds[1]["fit"]["epsilon_run"] > rounds[0]["fit"]["epsilon_run"]
    assert (run_dir / "progress.png").stat().st_size > 0


def test_global_adapter_changed_and_loads_with_peft(deployed_run):
    assert_final_adapter_trained_and_loadable(deployed_run[0])


def test_secure_aggregation_ran_and_the_run_completed(deployed_run):
    _, log, status = deployed_run
    assert log.count("Secure aggregation completed") == 2
    assert "Secure aggregation halted" not in log and "Traceback" not in log
    assert status == "finished:completed", status
    run_id = re.search(r"Successfully started run (\d+)", log)[1]
    assert log.splitlines()[-1] == f"flwr-verl: run {run_id} finished:completed", log[-3000:]  # its exit code: 0


def test_run_ends_normally_when_every_privacy_budget_is_spent(deployed_run):
    run_dir, log, _ = deployed_run
    assert log.count("; not sampled again") == 3  # each client, once, after round 2
    assert "flwr-verl: only 0 of 3 clients can train another round within their privacy budget" in log, log
    assert "stopping after round 2" in log and "[ROUND 3]" in log and not re.search(r"round 3: (reward|training)", log)
    assert tree_digest(run_dir / "adapters" / "final") == tree_digest(run_dir / "adapters" / "round-0002")
    budget = budget_for_two_rounds()
    assert all(r["fit"]["epsilon_run"] <= budget for r in records(run_dir) if "fit" in r)


def test_a_restarted_supernode_keeps_its_ledger_and_a_new_run_continues_from_it(deployment, deployed_runs, tmp_path):
    """Run 1 spent two rounds of the budget on every node's data, and the run beside it
    (``OTHER_RUN``) one iteration on the same data. SuperNode 0 is restarted, then run 2, with the
    same budget, starts on the same data: every client counts from both runs' spends (one more
    round would bring it past three rounds' epsilon, not to one), so all refuse and nothing is
    trained. Refusals spend nothing: the ledgers still hold the two earlier runs' spends only."""
    warm_only(deployment, "a restarted SuperNode and a run beside the main one")
    other, _ = deployed_runs["other"]
    other.wait(timeout=RUN_DEADLINE_S)  # its spend is in the ledgers before the restart
    deployment.kill_supernode(0)
    deployment.start_supernode(0)
    deployment.wait_supernode(0)
    out = tmp_path / "second-run"
    done = deployment.flwr_run(REPO, {**SMALL_RUN, "num-server-rounds": 1, "privacy.epsilon_budget":
                                      budget_for_two_rounds(), "output-dir": str(out)}, timeout=RUN_DEADLINE_S)
    log = done.stdout + done.stderr
    engine = parse_run_config(SMALL_RUN).engine
    per_round = engine.trainer.local_iterations
    other_iterations = parse_run_config(OTHER_RUN).engine.trainer.local_iterations
    mechanism = IterationMechanism(engine.privacy.noise_multiplier,
                                   sample_rate(engine.data.train_batch_size, engine.data.train_size),
                                   engine.actor.ppo_epochs)  # OTHER_RUN's too: same data, same noise
    next_round = PrivacyAccount().after(mechanism, 3 * per_round + other_iterations).epsilon(engine.privacy.delta)
    # The epsilon a round would reach stays on the node: each node's own log says it.
    node_logs = "".join(node.log.read_text(errors="replace") for node in deployment.supernodes)
    wanted = re.findall(r"privacy budget: this round would bring .* to epsilon (\S+) > budget", node_logs)
    assert len(wanted) >= 3 and all(float(e) == pytest.approx(next_round, rel=5e-3) for e in wanted), wanted
    assert log.count("PrivacyBudgetExhausted: one more round would pass this node's epsilon budget") == 3, log
    assert "Secure aggregation completed" not in log
    assert not list(out.glob("*/adapters/round-*"))
    for path in (deployment.root / "org-0-ledger.sqlite",
                 deployment.supernodes[1].flwr_home / "flwr-verl" / "privacy-ledger.sqlite"):
        ledger = PrivacyLedger(path, read_only=True)
        (data_set,) = ledger.data_sets()
        assert sorted(run.iterations for run in ledger.runs(data_set)) == [other_iterations, 2 * per_round]


def refused(deployment, command: list[str], tmp_path, name: str) -> str:
    """Run a SuperNode that must not get in; return its output once it gave up. Flower refuses it
    at the transport, before any ClientApp or engine runs: checked once, on the warm deployment."""
    warm_only(deployment, "a refused SuperNode never reaches an engine")
    home = tmp_path / f"home-{name}"
    home.mkdir()
    log = home / "supernode.log"
    with open(log, "wb") as handle:  # not a pipe: the SuperExec it spawns would hold that open
        process = subprocess.Popen(command + ["--max-retries", "2", "--max-wait-time", "20"], cwd=home,
                                   env=base_env(home, str(deployment.root)), stdout=handle, stderr=subprocess.STDOUT)
    try:
        assert process.wait(timeout=120) != 0, log.read_text()
    finally:
        process.kill()
        kill_processes_with_env("FLWR_HOME", str(home))
    return log.read_text(errors="replace")


def test_supernode_with_an_unregistered_key_is_refused(deployment, tmp_path):
    rogue = make_node_key(tmp_path, "rogue")
    out = refused(deployment, deployment.supernode_command(0, key=rogue.private_key, port=free_port()), tmp_path,
                  "rogue")
    assert "Failed to initialize the connection to the SuperLink" in out, out


def test_supernode_without_tls_or_trusting_another_ca_is_refused(deployment, tmp_path):
    key = deployment.supernodes[0].key.private_key  # a registered key: only the transport is wrong
    plain_command = deployment.supernode_command(0, port=free_port(), insecure=True)
    at = plain_command.index("--auth-supernode-private-key")  # Flower itself refuses a key without TLS
    plain = refused(deployment, plain_command[:at] + plain_command[at + 2:], tmp_path, "plain")
    other_ca = make_tls(tmp_path / "other-ca").ca_cert
    forged = refused(deployment, deployment.supernode_command(0, key=key, port=free_port(), root_certificates=other_ca),
                     tmp_path, "other-ca")
    for out in (plain, forged):
        assert "SuperNode ID:" not in out and "Failed to initialize the connection" in out, out
    assert "CERTIFICATE_VERIFY_FAILED" in forged, forged
    nodes = subprocess.run(["flwr", "supernode", "ls", deployment.connection, "--format", "json"],
                           env=deployment.env, cwd=deployment.root, capture_output=True, text=True, timeout=60)
    online = [n for n in json.loads(nodes.stdout).get("nodes", []) if n.get("status") == "online"]
    assert len(online) == 3, nodes.stdout  # only the three registered, TLS-verified SuperNodes


def test_two_runs_at_once_on_one_federation_stay_apart(deployment, deployed_runs):
    """Both runs finish, each in its own run directory with its own config, rounds and privacy
    ledger: the other run's epsilon is that of one fresh round of its own mechanism."""
    warm_only(deployment, "a run beside the main one")
    main_dir, main_log, _ = deployed_runs["main"]
    other, other_log_file = deployed_runs["other"]
    other.wait(timeout=RUN_DEADLINE_S)  # the shorter run; it usually ended first
    other_log = other_log_file.read_text(errors="replace")
    other_dir, other_status = run_directory_of(other_log), deployment.run_status(other_log)
    assert other_status == "finished:completed", other_log[-3000:]
    assert main_dir != other_dir and sorted(run_directories(deployed_runs["out"])) == sorted([main_dir, other_dir])
    assert str(main_dir) not in other_log and str(other_dir) not in main_log
    assert json.loads((other_dir / "config.json").read_text())["federation"]["num_server_rounds"] == 1
    assert json.loads((main_dir / "config.json").read_text())["federation"]["num_server_rounds"] == 3
    (record,) = records(other_dir)
    assert record["round"] == 1 and record["clients"] == [0, 1, 2] and "evaluate" not in record
    engine = parse_run_config(OTHER_RUN).engine
    mechanism = IterationMechanism(engine.privacy.noise_multiplier,
                                   sample_rate(engine.data.train_batch_size, engine.data.train_size),
                                   engine.actor.ppo_epochs)
    # The server learns this run's own epsilon only (the total over both runs stays on the node).
    one_round = PrivacyAccount().after(mechanism, engine.trainer.local_iterations).epsilon(engine.privacy.delta)
    assert record["fit"]["epsilon_run"] == pytest.approx(one_round, rel=1e-6)
    ledger = PrivacyLedger(deployment.root / "org-0-ledger.sqlite", read_only=True)
    (data_set,) = ledger.data_sets()
    assert engine.trainer.local_iterations in [run.iterations for run in ledger.runs(data_set)]
    assert [r["round"] for r in records(main_dir)] == [0, 1, 2]
    assert (other_dir / "adapters" / "final" / "policy").is_dir()


def test_each_node_keeps_one_engine_across_messages_and_runs(deployment, deployed_runs):
    """Warm: each node started one engine, which served every message of both runs (their messages
    say so), from its own directory under the node's Flower home. Cold: no engine process."""
    if deployed_runs["other"] is not None:
        deployed_runs["other"][0].wait(timeout=RUN_DEADLINE_S)
    engine = engine_of(deployment)
    for node in deployment.supernodes:
        log = node.log.read_text(errors="replace")
        lines = re.findall(r"flwr-verl: (\w+) message, (\w+) engine: ([\d.]+) s compute, [\d.]+ s since the "
                           r"ClientApp process started \([\d.]+ s of them before Flower", log)
        assert {kind for _, kind, _ in lines} == {engine}, lines
        assert {method for method, _, _ in lines} >= {"fit", "evaluate"}
        engine_log = node.flwr_home / "flwr-verl" / "engine" / "engine.log"
        if engine == "cold":
            assert not engine_log.exists()
            continue
        text = engine_log.read_text(errors="replace")
        assert text.count("flwr-verl engine: listening on") == 1, text[-3000:]
        assert text.count("flwr-verl engine: fit for run") >= 3  # 2 rounds of one run, 1 of the other
        assert len(set(re.findall(r"engine: fit for run (\d+)", text))) >= 2  # both runs (and later ones), one engine
