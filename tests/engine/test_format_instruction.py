"""data.format_instruction: one line appended to every generated prompt, task generators only."""

import pytest

from flwr_verl.config import ConfigError, parse_run_config
from flwr_verl.engine.data import load_rows


def test_the_instruction_ends_every_generated_prompt_and_nothing_else_changes():
    plain = parse_run_config({"data.val_size": 8}).engine.data
    instructed = parse_run_config({"data.val_size": 8, "data.format_instruction": "Reply with only the sum."}).engine.data
    before, after = load_rows(plain, "val", 0, 0, 2), load_rows(instructed, "val", 0, 0, 2)
    assert [row["reward_model"] for row in after] == [row["reward_model"] for row in before]
    assert [row["prompt"][-1]["content"] for row in after] == [
        row["prompt"][-1]["content"] + "\nReply with only the sum." for row in before]


def test_the_instruction_is_refused_with_parquet_files():
    with pytest.raises(ConfigError, match=r"data\.format_instruction='x' is invalid: applies to task generators only"):
        parse_run_config({"data.train_files": "train.parquet", "data.format_instruction": "x"})
