"""End to end: `flwr run .` as a real Flower simulation, 3 clients, 2 rounds, DP and SecAgg+ on;
and a resume that finds its only checkpoint damaged and refuses before any client trains."""

from __future__ import annotations

import pytest

from deploy.launch import free_port
from tests.flower_harness import (
    RUN_DEADLINE_S,
    SMALL_RUN,
    assert_final_adapter_trained_and_loadable,
    flwr_run_simulation,
    isolated_env,
    kill_tree_with_env,
    records,
    run_directories,
    tree_digest,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def simulation_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    env = isolated_env(root)
    try:
        proc = flwr_run_simulation(env, root, {**SMALL_RUN, "output-dir": str(root / "out")},
                                   num_supernodes=3, timeout=RUN_DEADLINE_S)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])
    runs = sorted((root / "out").glob("run-*"))
    assert proc.returncode == 0 and runs, f"flwr run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return runs[-1], proc.stdout + proc.stderr


def test_every_round_is_recorded_with_epsilon(simulation_run):
    run_dir, _ = simulation_run
    rounds = records(run_dir)
    assert [r["round"] for r in rounds] == [0, 1, 2]  # round 0: the initial adapter, evaluated before training
    assert 0 <= rounds[0]["evaluate"]["accuracy"] <= 1 and "fit" not in rounds[0]
    rounds = rounds[1:]
    for record in rounds:
        assert record["fit"]["num_clients"] == 3
        assert record["fit"]["epsilon_run"] > 0
        assert 0 <= record["evaluate"]["reward"] <= 1
    assert rounds[1]["fit"]["epsilon_run"] > rounds[0]["fit"]["epsilon_run"]
    assert (run_dir / "progress.png").stat().st_size > 0


def test_global_adapter_changed_and_loads_with_peft(simulation_run):
    assert_final_adapter_trained_and_loadable(simulation_run[0])


def test_secure_aggregation_ran(simulation_run):
    _, log = simulation_run
    assert log.count("Secure aggregation completed") == 2
    assert "Secure aggregation halted" not in log


def test_flwr_run_used_the_superlink_we_started(simulation_run):
    """``flwr_run_simulation`` starts the SuperLink with a generous deadline and gives ``flwr run``
    its address; had ``flwr run`` probed for one (0.4 s) and found none, it would have started its
    own, with a 15 s deadline, and said so (once, under load, it did)."""
    _, log = simulation_run
    assert "Successfully started run" in log and "Starting local SuperLink" not in log, log[-3000:]


def simulate(env: dict, root, config: dict):
    try:
        return flwr_run_simulation(env, root, config, num_supernodes=2, timeout=RUN_DEADLINE_S)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])


@pytest.mark.xdist_group("simulation-damaged-resume")  # its own simulation, not the module's
def test_resume_with_only_a_damaged_checkpoint_refuses_before_any_client_trains(tmp_path):
    """Round 1 saved, then its state file torn and metrics.jsonl's last line torn: `flwr run`
    with resume=true refuses, naming the file and the ways on, and no client trains: every byte
    of the run directory and of the nodes' privacy ledger is as it was."""
    out = tmp_path / "out"
    env = isolated_env(tmp_path)
    config = {**SMALL_RUN, "secagg.enabled": False, "trainer.local_iterations": 1, "evaluate-every": 0,
              "min-fit-clients": 2, "min-evaluate-clients": 2, "min-available-clients": 2, "num-server-rounds": 1,
              "save-every": 1, "output-dir": str(out)}
    first = simulate(env, tmp_path, config)
    (run_dir,) = run_directories(out)
    assert [r["round"] for r in records(run_dir)][-1:] == [1], first.stdout[-3000:] + first.stderr[-3000:]
    (ledger,) = list((tmp_path / "flwr_home").rglob("privacy-ledger.sqlite"))
    tensors = run_dir / "adapters" / "round-0001" / "server_state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 2, "fi')  # killed during an append
    before = tree_digest(run_dir), ledger.read_bytes()

    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    second = simulate({**env, **ports}, tmp_path, {**config, "resume": True, "num-server-rounds": 2})
    log = second.stdout + second.stderr
    for part in (f"resume: {run_dir} has no checkpoint that verifies: {tensors}: sha256",
                 "Nothing in it was changed and no client trained", "resume=false",
                 f"model.init_adapter={run_dir / 'adapters' / 'round-0001' / 'policy'}"):
        assert part in log, log[-4000:]
    assert "round 1:" not in log and "round 2:" not in log, log[-4000:]
    assert (tree_digest(run_dir), ledger.read_bytes()) == before
