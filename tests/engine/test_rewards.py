"""The reward contract: verl's compute_score, custom functions from a file, and checked scores."""

from __future__ import annotations

import math
import re

import pytest

from flwr_verl import embedded
from flwr_verl.config import ConfigError, DataConfig, RewardConfig
from flwr_verl.engine._verl import default_compute_score
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.engine.rewards import RewardError, checked, final_number_score, load_function, resolve_compute_score
from flwr_verl.engine.trainer import LocalPPOTrainer

REWARD_FILE = '''
def exact(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def quarter(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.25, "length": float(len(solution_str))}
'''


@pytest.fixture(scope="module")
def setup(tiny_config):
    config = tiny_config()
    return config, load_rows(config.data, "train", seed=0), build_models(config.model, with_critic=False)


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_custom_function_loads_from_path_and_name(reward_file):
    score = resolve_compute_score(RewardConfig(path=str(reward_file), name="exact"), DataConfig())
    assert score.__name__ == "exact"
    assert score("any", " 42", "42") == 1.0 and score("any", "41", "42") == 0.0
    with pytest.raises(RewardError, match=rf"reward function {reward_file}:exact on prompt"):
        checked(score)("any", 42, "42", {})  # an int response: `.strip()` fails in the function


def test_default_scorers():  # resolved functions come checked: __wrapped__ is the scorer itself
    assert resolve_compute_score(RewardConfig(), DataConfig()).__wrapped__ is embedded.compute_score
    assert resolve_compute_score(RewardConfig(), DataConfig(train_files="x.parquet")).__wrapped__ is default_compute_score


def test_missing_file_function_or_broken_file_is_a_reward_error(reward_file, tmp_path):
    missing = tmp_path / "absent.py"
    with pytest.raises(RewardError, match=rf"custom_reward_function\.path='{missing}': file not found"):
        load_function(str(missing), "exact")
    with pytest.raises(RewardError, match=rf"custom_reward_function\.name='nope': no such function in {reward_file}"):
        load_function(str(reward_file), "nope")
    with pytest.raises(RewardError, match=r"name='REWARD': str in .*, not a function"):
        reward_file.write_text(REWARD_FILE + 'REWARD = "not callable"\n')
        load_function(str(reward_file), "REWARD")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(RewardError, match=r"failed to import: ModuleNotFoundError\(.*no_such_module_xyz"):
        load_function(str(broken), "compute_score")


@pytest.mark.parametrize("response, truth, score", [
    ("43", "43", 1.0), (" -7\n", "-7", 1.0), ("1,043", "1043", 1.0), ("3.0", "3", 1.0), ("43.", "43", 1.0),
    ("The answer to this arithmetic problem is 43.", "43", 0.5),  # verl's pattern keeps the period
    ("It is 1,043.", "1043", 0.5),
    ("12 + 31 = 44.", "43", 0.0),  # the last number counts, not any number
    ("43 or 44", "43", 0.0), ("44", "43", 0.0), ("no number", "43", 0.0), ("...", "1", 0.0), ("", "0", 0.0),
])
def test_final_number_score_reads_the_last_number_of_the_reply(response, truth, score):
    assert final_number_score("any", response, truth) == score


def test_a_built_in_scorer_is_chosen_by_import_path_as_verl_takes_it():
    reward = RewardConfig(path="pkg://flwr_verl.engine.rewards", name="final_number_score")
    score = resolve_compute_score(reward, DataConfig())
    assert score.__wrapped__ is final_number_score
    assert score("any", "The answer is 5.", "5") == 0.5
    with pytest.raises(ConfigError, match=r"custom_reward_function\.path='pkg://flwr_verl\.no_such_module' is "
                                          r"invalid: must be an existing \.py file or pkg://<an importable module>"):
        RewardConfig(path="pkg://flwr_verl.no_such_module")
    with pytest.raises(ConfigError, match=r"path='pkg://no_such_package\.rewards' is invalid"):
        RewardConfig(path="pkg://no_such_package.rewards")


def test_dict_with_score_from_configured_file_drives_training(setup, reward_file, tiny_config):
    _, rows, models = setup
    config = tiny_config(custom_reward_function={"path": str(reward_file), "name": "quarter"})
    (metrics,) = LocalPPOTrainer(config, rows, models=models).fit(1).metrics
    assert metrics["reward_mean"] == 0.25


def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("boom")


def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")


def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"


def returns_inf(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": math.inf}


def returns_none(data_source, solution_str, ground_truth, extra_info=None):
    return None


@pytest.mark.parametrize(
    ("function", "detail"),
    [(raises, "ValueError('boom')"), (returns_nan, "returned nan"), (returns_text, "returned '1.0'"),
     (returns_inf, "returned {'score': inf}"), (returns_none, "returned None")],
)
def test_bad_reward_stops_training_naming_function_and_prompt(setup, function, detail):
    config, rows, models = setup
    trainer = LocalPPOTrainer(config, rows, compute_score=function, models=models)
    with pytest.raises(RewardError) as error:
        trainer.fit(1)
    message = str(error.value)
    assert f"{__name__}.{function.__name__}" in message and detail in message
    prompt = re.search(r"on prompt '(?:<s>)?([^']*)'", message)
    assert prompt and prompt.group(1) in {row["prompt"][0]["content"] for row in rows}, message
    with pytest.raises(RewardError):  # evaluation checks scores too
        trainer.evaluate(rows[:2])


def test_reasoning_gym_task_rows_are_verl_rows_scored_by_its_own_checker():
    from flwr_verl.engine.data import task_compute_score, task_rows, validate_row

    rows = task_rows("reasoning_gym:chain_sum", 4, seed=0, split="train")
    score = task_compute_score("reasoning_gym:chain_sum")
    for index, row in enumerate(rows):
        validate_row(row, f"row {index}")
        truth = row["reward_model"]["ground_truth"]
        assert score(row["data_source"], truth, truth, row["extra_info"]) == 1.0
        assert score(row["data_source"], "not a number", truth, row["extra_info"]) == 0.0
