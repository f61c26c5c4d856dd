"""``flwr-verl preference-pairs``: on-policy pairs from the embedded model, labelled by the task's
checker, written as TRL parquet that stage ``dpo`` reads; splits disjoint by the problem's hash,
and no split's content depends on another's settings."""

from __future__ import annotations

import json
import random
import shutil

import pyarrow.parquet as pq
import pytest

from flwr_verl import embedded
from flwr_verl.config import parse_run_config
from flwr_verl.stages.preference import load_units
from flwr_verl.tools import cli
from flwr_verl.tools.pairs import SPLIT_FILES, PairSettings, pair_replies, sha256, write_pairs

SMALL = {"task": "arithmetic", "train_prompts": 24, "tune_prompts": 8, "val_prompts": 8, "samples": 4,
         "temperature": 1.5, "response_length": 4, "max_prompt_length": 16, "pairs_per_prompt": 3, "batch_prompts": 16}


@pytest.fixture(scope="module")
def pairs_dir(model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs")
    manifest = write_pairs(PairSettings(model=str(model_path), out=str(out), **SMALL), log=lambda line: None)
    return out, manifest


def problem_split(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return embedded.split_of(embedded.problem_key(int(a), int(b)))


def test_splits_are_disjoint_by_the_problem_hash(pairs_dir):
    out, manifest = pairs_dir
    prompts = {}
    for split, name in SPLIT_FILES.items():
        records = pq.read_table(out / name).to_pylist()
        assert records, f"{split}: no pairs (the embedded model should be right on some samples, wrong on others)"
        prompts[split] = {r["prompt"] for r in records}
        assert all(problem_split(p) == split for p in prompts[split])
        assert manifest["splits"][split]["pairs"] == len(records)
        assert manifest["splits"][split]["sha256"] == sha256(out / name)
    assert not prompts["train"] & prompts["val"] and not prompts["train"] & prompts["tune"]
    assert not prompts["tune"] & prompts["val"]
    assert json.loads((out / "manifest.json").read_text())["settings"]["samples"] == SMALL["samples"]


def test_chosen_is_right_and_rejected_wrong(pairs_dir):
    out, _ = pairs_dir
    for name in SPLIT_FILES.values():
        for record in pq.read_table(out / name).to_pylist():
            truth = record["ground_truth"]
            assert embedded.compute_score("", record["chosen"], truth) == 1.0 == record["chosen_score"]
            assert embedded.compute_score("", record["rejected"], truth) == 0.0 == record["rejected_score"]
            assert record["chosen"] != record["rejected"]


def test_stage_dpo_reads_the_files(pairs_dir):
    out, _ = pairs_dir
    config = parse_run_config({"stage": "dpo", "data.train_files": str(out / "train.parquet"),
                               "data.val_files": str(out / "validation.parquet")}).engine
    train, val = load_units(config.data, "train", 0), load_units(config.data, "val", 0)
    assert sum(len(u.pairs) for u in train) == len(pq.read_table(out / "train.parquet"))
    assert all(1 <= len(u.pairs) <= SMALL["pairs_per_prompt"] for u in train + val)
    assert {u.prompt[0]["content"] for u in train}.isdisjoint(u.prompt[0]["content"] for u in val)


def test_no_split_depends_on_the_validation_settings(model_path, pairs_dir, tmp_path):
    """More validation problems change neither the train nor the tune file."""
    out, _ = pairs_dir
    other = write_pairs(PairSettings(model=str(model_path), out=str(tmp_path), **{**SMALL, "val_prompts": 12}),
                        log=lambda line: None)
    assert other["splits"]["train"]["sha256"] == sha256(out / "train.parquet")
    assert other["splits"]["tune"]["sha256"] == sha256(out / "tune.parquet")


def test_conversational_when_the_tokenizer_has_a_chat_template(model_path, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_path, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    settings = {**SMALL, "train_prompts": 12, "tune_prompts": 0, "val_prompts": 0}
    write_pairs(PairSettings(model=str(model), out=str(tmp_path / "out"), **settings), log=lambda line: None)
    record = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]
    assert record["prompt"][0]["role"] == "user" and record["chosen"][0]["role"] == "assistant"
    config = parse_run_config({"stage": "dpo", "data.train_files": str(tmp_path / "out" / "train.parquet")}).engine
    assert load_units(config.data, "train", 0)[0].pairs[0][0] == record["chosen"][0]["content"]


def test_pairing_uses_replies_evenly_and_never_twice():
    replies = [("a", 1.0), ("b", 1.0), ("x", 0.0), ("y", 0.0), ("z", 0.0), ("x", 0.0)]
    pairs = pair_replies(replies, 1.0, 6, random.Random(0))
    assert len(pairs) == len(set(pairs)) == 6  # every right x wrong combination once
    assert all(c[1] >= 1.0 > r[1] for c, r in pairs)
    three = pair_replies(replies, 1.0, 3, random.Random(0))
    assert len({r for _, r in three}) == 3  # the first pairs use each wrong reply once
    assert pair_replies([("a", 1.0), ("b", 1.0)], 1.0, 4, random.Random(0)) == []
    assert pair_replies([("a", 0.5), ("b", 0.0)], 0.5, 4, random.Random(0)) == [(("a", 0.5), ("b", 0.0))]


@pytest.mark.parametrize("argument, value, words", [
    ("--samples", "1", "--samples=1 is invalid"),
    ("--temperature", "0", "--temperature=0.0 is invalid"),
    ("--task", "gsm8k", "--task='gsm8k' is invalid"),
    ("--task-params", "{oops", "--task-params='{oops' is invalid"),
    ("--reward", "nocolon", "--reward='nocolon' is invalid"),
])
def test_bad_arguments_exit_2_naming_the_argument(model_path, tmp_path, capsys, argument, value, words):
    code = cli.main(["preference-pairs", "--model", str(model_path), "--out", str(tmp_path), argument, value])
    error = capsys.readouterr().err.strip()
    assert code == 2 and error.startswith("error: ") and words in error and "\n" not in error


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    assert cli.main(["preference-pairs", "--model", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert f"--model='{tmp_path / 'none'}' is invalid" in capsys.readouterr().err
