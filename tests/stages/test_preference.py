"""Stage ``reward_model``: preference data, the Bradley-Terry objective under DP, outputs."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flwr_verl.config import parse_run_config
from flwr_verl.engine.data import DataError
from flwr_verl.stages.preference import (
    LocalRewardModelTrainer,
    PreferenceUnit,
    build_reward_model_trainee,
    load_preference_files,
    load_units,
    pair_batch,
    pair_scores,
)
from tests.unit_independence import assert_units_are_independent

STAGE1 = {"stage": "reward_model", "privacy.enabled": True, "privacy.noise_multiplier": 1.0,
          "privacy.deterministic": True, "data.train_size": 64, "data.val_size": 32, "data.train_batch_size": 16,
          "actor.ppo_mini_batch_size": 8}


def stage1_config(**overrides):
    return parse_run_config({**STAGE1, **overrides}).engine


@pytest.fixture(scope="module")
def trainee():
    config = stage1_config()
    return config, build_reward_model_trainee(config.model, seed=config.trainer.seed)


# ----------------------------------------------------------------------------- data
def test_plain_and_conversational_rows_group_into_units_by_prompt(tmp_path):
    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": "1+1=", "chosen": "2", "rejected": "11"},
    ]), path)
    units = load_preference_files(str(path))
    assert [(u.prompt[0]["content"], u.pairs) for u in units] == [("1+1=", [("2", "3"), ("2", "11")]),
                                                                  ("2+2=", [("4", "5")])]
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": "1+1="}],
        "chosen": [{"role": "assistant", "content": "2"}], "rejected": [{"role": "assistant", "content": "3"}],
    }]), chat)
    assert load_preference_files(str(chat))[0].pairs == [("2", "3")]


PLAIN = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
CHAT = {"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "assistant", "content": "2"}],
        "rejected": [{"role": "assistant", "content": "3"}]}


@pytest.mark.parametrize("good, bad, field", [
    (PLAIN, {"prompt": "1+1=", "chosen": "2", "rejected": None}, "rejected"),
    (PLAIN, {"prompt": "", "chosen": "2", "rejected": "3"}, "prompt"),
    (CHAT, {**CHAT, "chosen": [{"role": "assistant", "content": None}]}, "chosen"),
])
def test_a_malformed_row_names_file_row_and_field(tmp_path, good, bad, field):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(DataError, match=rf"{path} row 1: .*'{field}'"):
        load_preference_files(str(path))


def test_embedded_pairs_are_correct_sums_against_near_misses_and_held_out_prompts_are_disjoint():
    config = stage1_config()
    train, val = load_units(config.data, "train", 0), load_units(config.data, "val", 0)
    for unit in train + val:
        a, b = unit.prompt[0]["content"].rstrip("=").split("+")
        assert all(chosen == str(int(a) + int(b)) != rejected for chosen, rejected in unit.pairs)
    assert not {u.prompt[0]["content"] for u in train} & {u.prompt[0]["content"] for u in val}


# ----------------------------------------------------------------------------- objective under DP
def test_bradley_terry_per_unit_gradients_equal_each_unit_computed_alone(trainee):
    """Units with 1, 2 and 3 pairs in one forward pass: each unit's pooled Opacus gradient is the
    gradient of that unit's loss computed alone (no coupling between privacy units)."""
    config, models = trainee
    units = [PreferenceUnit("t", [{"role": "user", "content": "12+7="}], [("19", "18")]),
             PreferenceUnit("t", [{"role": "user", "content": "3+40="}], [("43", "44"), ("43", "34")]),
             PreferenceUnit("t", [{"role": "user", "content": "9+9="}], [("18", "17"), ("18", "19"), ("18", "81")])]
    assert_units_are_independent(LocalRewardModelTrainer(config, units, models=models), units)


def test_only_the_adapter_and_score_head_train_and_the_base_stays_bit_identical(trainee):
    config, models = trainee
    frozen = {name: p.detach().clone() for name, p in models.model.named_parameters() if not p.requires_grad}
    trained = {name: p.detach().clone() for name, p in models.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or "score.modules_to_save.default" in name for name in trained), trained
    assert any("score" in name for name in trained)
    trainer = LocalRewardModelTrainer(config, load_units(config.data, "train", 0), models=models)
    result = trainer.fit(2, seed=1)
    assert result.mechanism is not None  # under DP
    after = dict(models.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())
    changed = [name for name, value in trained.items() if not torch.equal(after[name], value)]
    assert any("lora_" in name for name in changed) and any("score" in name for name in changed)
    models.adapters.set_arrays([v.numpy() for v in trained.values()])  # leave the shared model as it was


# ----------------------------------------------------------------------------- outputs
def test_the_round_adapter_and_the_merged_model_score_as_the_trained_model(tmp_path, trainee):
    """Both stage-1 outputs load as ``reward_model.model.path`` and give the trained model's scores:
    the per-round PEFT adapter (on the causal-LM base, the head from the adapter) and the merged
    directory."""
    from flwr_verl.engine.reward_model import conversation_text, load_reward_model
    from flwr_verl.stages.preference import REWARD_MODEL_ROLE, export_merged

    config, models = trainee
    initial = models.adapters.get_arrays()
    LocalRewardModelTrainer(config, load_units(config.data, "train", 0), models=models).fit(1, seed=3)
    try:
        models.adapters.save(tmp_path / "round-0001")  # as the run directory saves a round
        merged = export_merged(tmp_path / "round-0001" / REWARD_MODEL_ROLE, tmp_path / "merged", config.model)
        units = load_units(config.data, "val", 0)[:6]
        with torch.no_grad():
            expected, _ = pair_scores(models.model.eval(), pair_batch(units, models.tokenizer, models.device))
        for directory in (tmp_path / "round-0001" / REWARD_MODEL_ROLE, merged):
            reward_model = load_reward_model(str(directory), torch.device("cpu"))
            texts = [conversation_text(u.prompt, chosen, reward_model.tokenizer) for u in units for chosen, _ in u.pairs]
            torch.testing.assert_close(reward_model.score(texts, micro_batch_size=4), expected, atol=1e-5, rtol=1e-4)
    finally:
        models.adapters.set_arrays(initial)


def test_an_adapter_that_does_not_save_the_score_head_is_refused(tmp_path, trainee):
    import json

    from flwr_verl.config import ConfigError
    from flwr_verl.engine.reward_model import load_reward_model
    from flwr_verl.stages.preference import REWARD_MODEL_ROLE

    _, models = trainee
    models.adapters.save(tmp_path)
    config_file = tmp_path / REWARD_MODEL_ROLE / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "modules_to_save": None}))
    with pytest.raises(ConfigError, match=r"does not save the 'score' head"):
        load_reward_model(str(tmp_path / REWARD_MODEL_ROLE), torch.device("cpu"))


def test_stages_on_the_same_prompts_compose_their_epsilon():
    from flwr_verl.privacy.dpsgd import IterationMechanism, PrivacyAccount, compose

    stage1, stage2 = PrivacyAccount(), PrivacyAccount()
    stage1.record(IterationMechanism(1.0, 0.05), 40)
    stage2.record(IterationMechanism(0.8, 0.02, ppo_epochs=2), 60)
    both = compose(stage1, stage2)
    assert both.steps == 100
    assert both.epsilon(1e-5) > max(stage1.epsilon(1e-5), stage2.epsilon(1e-5))
    assert both.epsilon(1e-5) < stage1.epsilon(1e-5) + stage2.epsilon(1e-5)  # RDP composes tighter than adding


def test_a_short_stage_1_beats_chance_on_held_out_pairs():
    """80 Bradley-Terry iterations of 64 prompts (no DP) against the same model untrained, on
    the pairs of 240 validation prompts that no training split holds (5 near misses each).
    Chance is 0.5 (one standard deviation over 240 prompts, counting a prompt's pairs as one:
    0.032); the margin 0.1 is three of them. The length was chosen on the tune split, on a Xeon
    with AMX (0.48 untrained; 0.58 / 0.62 / 0.69 after 40 / 60 / 80 iterations): 40, the length
    measured at 0.60 on AVX2 and AVX-512 machines, left too little room on AMX kernels."""
    config = stage1_config(**{"privacy.enabled": False, "data.train_size": 1024, "data.val_size": 240,
                              "data.train_batch_size": 64, "actor.ppo_mini_batch_size": 64, "actor.lr": 3e-3})
    trainer = LocalRewardModelTrainer(config, load_units(config.data, "train", 0))
    held_out = load_units(config.data, "val", 0)
    before = trainer.evaluate(held_out).accuracy
    trainer.fit(80, seed=0)
    after = trainer.evaluate(held_out).accuracy
    assert after >= max(before, 0.5) + 0.1, (before, after)


def test_a_stage_1_client_fits_under_dp_and_a_node_time_budget(trainee):
    """The client's fit, as a ClientApp runs it, on stage ``reward_model``: a node's
    ``time-budget-s`` reaches the Bradley-Terry trainer as it does the PPO one (the first
    iteration always runs), and the spend is in the privacy report."""
    from flwr_verl.config import LocalBudget
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.protocol import FitConfig, FitReport

    config, models = trainee
    client = VerlClient(config, load_units(config.data, "train", 0), load_units(config.data, "val", 0),
                        models=models, budget=LocalBudget(seconds=1e-9))
    instructions = FitConfig(server_round=1, local_iterations=3, planned_iterations=3, proximal_mu=0.0)
    update, weight, metrics = client.fit(client.get_parameters({}), instructions.to_config())
    report = FitReport.from_metrics(metrics)
    assert report.iterations == 1 and weight > 0 and any(abs(a).max() > 0 for a in update)
    assert report.privacy is not None and report.privacy.epsilon_run > 0
