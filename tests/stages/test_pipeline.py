"""The RLHF pipeline end to end on a real local deployment (a SuperLink and three SuperNodes):
stage 1 (``stage=reward_model``) trains a reward model under DP and SecAgg+; stage 2 runs GRPO
under DP and SecAgg+ with ``reward_model.enable``, each organisation scoring with the model its
own node config names (``reward-model-path``). Then the other way to preferences: stage ``dpo``
under DP and SecAgg+, and GRPO against its policy as the verifier (``reward_model.kind =
"implicit"``), again from each node's own path."""

from __future__ import annotations

import shutil

import pytest

from tests.flower_harness import REPO, RUN_DEADLINE_S, SMALL_RUN, local_deployment, records, run_directories

pytestmark = pytest.mark.slow

ONE_ROUND = {**SMALL_RUN, "num-server-rounds": 1, "trainer.local_iterations": 2}


def _run(deployment, out, run_config):
    done = deployment.flwr_run(REPO, {**run_config, "output-dir": str(out)}, timeout=RUN_DEADLINE_S)
    runs = run_directories(out)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and runs, f"flwr run failed:\n{log[-6000:]}"
    assert "Secure aggregation completed" in log and "Secure aggregation halted" not in log
    return runs[-1]


def test_preferences_then_grpo_against_each_nodes_reward_model_or_dpo_verifier_under_dp_and_secagg(tmp_path):
    reward_model = tmp_path / "org_reward_model"  # every node's reward-model-path; written by stage 1
    node_config = {i: {"partition-id": i, "num-partitions": 3, "reward-model-path": str(reward_model)}
                   for i in range(3)}
    with local_deployment(tmp_path / "fl", num_supernodes=3, node_config=node_config) as deployment:
        stage1 = _run(deployment, tmp_path / "out1", {**ONE_ROUND, "stage": "reward_model",
                                                      "actor.ppo_mini_batch_size": 8})
        rounds = records(stage1)
        assert [r["round"] for r in rounds] == [0, 1]
        assert rounds[1]["fit"]["epsilon_run"] > 0 and 0 <= rounds[1]["evaluate"]["accuracy"] <= 1
        assert (stage1 / "adapters" / "round-0001" / "reward_model" / "adapter_config.json").is_file()
        shutil.copytree(stage1 / "reward_model", reward_model)

        # Stage 2 trains only: its fit is where each node scores with its own reward model, and
        # every evaluation would cost one more ClientApp process per node.
        stage2 = _run(deployment, tmp_path / "out2", {**ONE_ROUND, "reward_model.enable": True, "evaluate-every": 0})
        (record,) = records(stage2)
        assert record["round"] == 1 and record["fit"]["epsilon_run"] > 0 and record["fit"]["num_clients"] == 3

        # DPO on the same deployment: its final policy adapter becomes every node's verifier.
        dpo = _run(deployment, tmp_path / "out3", {**ONE_ROUND, "stage": "dpo", "actor.ppo_mini_batch_size": 8})
        rounds = records(dpo)
        assert [r["round"] for r in rounds] == [0, 1] and rounds[0]["evaluate"]["accuracy"] == 0.5  # ties: half
        assert rounds[1]["fit"]["epsilon_run"] > 0
        shutil.rmtree(reward_model)
        shutil.copytree(dpo / "adapters" / "final" / "policy", reward_model)
        stage2 = _run(deployment, tmp_path / "out4", {**ONE_ROUND, "reward_model.enable": True,
                                                      "reward_model.kind": "implicit", "evaluate-every": 0})
        (record,) = records(stage2)
        assert record["round"] == 1 and record["fit"]["epsilon_run"] > 0 and record["fit"]["num_clients"] == 3
