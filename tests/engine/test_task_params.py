"""data.task_params: a reasoning-gym task's config fields (its difficulty), validated at the edge."""

import re

import pytest

from flwr_verl.config import ConfigError, DataConfig, parse_run_config
from flwr_verl.engine.data import DataError, load_rows

EASY = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'


def test_the_params_set_the_generated_problems():
    pytest.importorskip("reasoning_gym")
    config = parse_run_config({"data.task": "reasoning_gym:chain_sum", "data.task_params": EASY,
                               "data.val_size": 4}).engine.data
    for row in load_rows(config, "val", seed=0):
        question = row["prompt"][-1]["content"]
        assert re.fullmatch(r"\d{1,2} [+-] \d{1,2}", question.split(":")[-1].strip(" =")), question


@pytest.mark.parametrize("overrides, detail", [
    ({"data.task_params": "[1, 2]"}, "must be a JSON object"),
    ({"data.task_params": "{max_digits: 1}"}, "must be a JSON object"),
    ({"data.task": "arithmetic", "data.task_params": EASY}, "applies to data.task='reasoning_gym:<name>' only"),
])
def test_a_bad_value_fails_at_the_edge_naming_the_key(overrides, detail):
    with pytest.raises(ConfigError, match=rf"data\.task_params=.* is invalid: {re.escape(detail)}"):
        parse_run_config({"data.task": "reasoning_gym:chain_sum", **overrides})


def test_a_field_the_task_does_not_have_is_a_data_error_naming_the_key():
    pytest.importorskip("reasoning_gym")
    config = DataConfig(task="reasoning_gym:chain_sum", task_params='{"no_such_field": 1}', val_size=4)
    with pytest.raises(DataError, match=r"data\.task_params=.*no_such_field"):
        load_rows(config, "val", seed=0)
