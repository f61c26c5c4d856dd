"""End to end: `flwr run .` as a real Flower simulation, 3 clients, 2 rounds, DP and SecAgg+ on."""

from __future__ import annotations

import pytest

from tests.flower_harness import (
    SMALL_RUN,
    assert_final_adapter_trained_and_loadable,
    flwr_run_simulation,
    isolated_env,
    kill_tree_with_env,
    records,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def simulation_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    env = isolated_env(root)
    try:
        proc = flwr_run_simulation(env, root, {**SMALL_RUN, "output-dir": str(root / "out")},
                                   num_supernodes=3, timeout=600)
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
