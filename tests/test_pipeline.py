"""The RLHF pipeline end to end as real Flower simulations: stage 1 (``stage=reward_model``) trains
a reward model under DP and SecAgg+, stage 2 (``stage=policy``) runs GRPO against its merged
output under DP and SecAgg+."""

from __future__ import annotations

import pytest

from tests.flower_harness import SMALL_RUN, flwr_run_simulation, isolated_env, kill_tree_with_env, records

pytestmark = pytest.mark.slow

ONE_ROUND = {**SMALL_RUN, "num-server-rounds": 1, "trainer.local_iterations": 2}


def _run(root, name, run_config):
    workdir = root / name
    workdir.mkdir()
    env = isolated_env(workdir)
    try:
        proc = flwr_run_simulation(env, workdir, {**run_config, "output-dir": str(workdir / "out")},
                                   num_supernodes=3, timeout=600)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])
    runs = sorted((workdir / "out").glob("run-*"))
    assert proc.returncode == 0 and runs, f"flwr run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    log = proc.stdout + proc.stderr
    assert log.count("Secure aggregation completed") == 1 and "Secure aggregation halted" not in log
    return runs[-1]


def test_stage_1_then_stage_2_against_the_learned_reward_model_under_dp_and_secagg(tmp_path):
    stage1 = _run(tmp_path, "stage1", {**ONE_ROUND, "stage": "reward_model", "actor.ppo_mini_batch_size": 8})
    rounds = records(stage1)
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[1]["fit"]["epsilon_total"] > 0 and 0 <= rounds[1]["evaluate"]["accuracy"] <= 1
    assert (stage1 / "adapters" / "round-0001" / "reward_model" / "adapter_config.json").is_file()
    merged = stage1 / "reward_model"
    assert (merged / "config.json").is_file()

    stage2 = _run(tmp_path, "stage2", {**ONE_ROUND, "reward_model.enable": True,
                                       "reward_model.model.path": str(merged)})
    fit = records(stage2)[1]["fit"]
    assert fit["epsilon_total"] > 0 and fit["num_clients"] == 3
