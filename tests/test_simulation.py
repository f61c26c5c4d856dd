"""End to end: `flwr run .` as a real Flower simulation, 3 clients, 2 rounds, DP and SecAgg+ on."""

from __future__ import annotations

import json

import numpy as np
import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from flwr_verl.config import ModelConfig
from flwr_verl.models import AdapterSet, build_models, resolve_model_path
from tests.flower_harness import flwr_run_simulation, isolated_env, kill_tree_with_env

pytestmark = pytest.mark.slow

SMALL_RUN = {
    "num-server-rounds": 2,
    "data.train_size": 128,
    "data.val_size": 16,
    "data.train_batch_size": 16,
    "actor.ppo_mini_batch_size": 16,
    "trainer.local_iterations": 3,
    "privacy.enabled": True,
    "privacy.noise_multiplier": 0.8,
    "privacy.deterministic": True,
    "secagg.enabled": True,
}


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
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        assert record["fit"]["num_clients"] == 3
        assert record["fit"]["epsilon_total"] > 0
        assert 0 <= record["evaluate"]["reward"] <= 1
    assert records[1]["fit"]["epsilon_total"] > records[0]["fit"]["epsilon_total"]
    assert (run_dir / "progress.png").stat().st_size > 0


def test_global_adapter_changed_and_loads_with_peft(simulation_run):
    run_dir, _ = simulation_run
    initial = build_models(ModelConfig(), with_critic=False, seed=0).adapters.get_arrays()
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(ModelConfig()), local_files_only=True)
    final = PeftModel.from_pretrained(base, run_dir / "adapters" / "final" / "policy", is_trainable=True)
    trained = AdapterSet({"policy": final}).get_arrays()
    assert [a.shape for a in trained] == [a.shape for a in initial]
    assert max(float(np.abs(a - b).max()) for a, b in zip(trained, initial)) > 1e-4


def test_secure_aggregation_ran(simulation_run):
    _, log = simulation_run
    assert log.count("Secure aggregation completed") == 2
    assert "Secure aggregation halted" not in log
