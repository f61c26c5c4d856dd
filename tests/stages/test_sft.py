"""Stage ``sft``: its data, its per-unit loss under DP, a short federated run in one process, and
its final adapter as the start of the policy stage (``model.init_adapter``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flwr_verl.config import ConfigError, parse_run_config
from flwr_verl.engine.data import DataError
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, evaluate_round, fit_round
from flwr_verl.federation.rundir import RunDirectory
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.stages import build_stage_models
from flwr_verl.stages.sft import LocalSFTTrainer, SFTUnit, load_sft_files, load_units, unit_batch
from tests.unit_independence import assert_units_are_independent

CLIENTS = 3
SFT = {"stage": "sft", "privacy.enabled": True, "privacy.noise_multiplier": 0.8, "privacy.deterministic": True,
       "data.train_size": 64, "data.val_size": 32, "data.train_batch_size": 16, "actor.ppo_mini_batch_size": 16,
       "trainer.local_iterations": 3, "num-server-rounds": 2, "secagg.enabled": False, "actor.lr": 1e-2}


def sft_run_config(**overrides):
    return parse_run_config({**SFT, **overrides})


@pytest.fixture(scope="module")
def models():
    return build_stage_models(sft_run_config().engine)


@pytest.fixture(scope="module")
def sft_run(models, tmp_path_factory):
    """Two rounds of federated SFT under DP and FedProx, three clients in one process, evaluated
    at rounds 0 and 2, the final adapter saved as the run directory saves it."""
    config = sft_run_config()
    engine = config.engine
    clients = {str(i): VerlClient(engine, load_units(engine.data, "train", 0, i, CLIENTS),
                                  load_units(engine.data, "val", 0, i, CLIENTS), partition_id=i, models=models)
               for i in range(CLIENTS)}
    initial = models.adapters.get_arrays()
    strategy = FedProxAdapters(config.federation, initial, local_iterations=engine.trainer.local_iterations)
    manager = InProcessClients(clients)
    before = evaluate_round(strategy, manager, 0)
    for server_round in (1, 2):
        fit_round(strategy, manager, server_round)
    after = evaluate_round(strategy, manager, 2)
    run = RunDirectory.create(str(tmp_path_factory.mktemp("runs")), models.adapters, config)
    run.save(strategy.state_dict(), final=True)
    models.adapters.set_arrays(initial)  # leave the shared model as it was built
    return {"before": before, "after": after, "initial": initial, "final": run.path / "adapters" / "final",
            "weights": [w.numpy().astype(np.float32) for w in strategy.state_dict()["weights"]]}


# ----------------------------------------------------------------------------- data
def test_plain_and_conversational_rows_group_into_units_by_prompt(tmp_path):
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "4"}, {"prompt": "1+1=", "response": "two"},
    ]), path)
    assert [(u.prompt, u.responses) for u in load_sft_files(str(path))] == [
        ([{"role": "user", "content": "1+1="}], ["2", "two"]), ([{"role": "user", "content": "2+2="}], ["4"])]
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [
        {"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"}]}]), chat)
    [unit] = load_sft_files(str(chat))
    assert unit.prompt == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    assert unit.responses == ["2"]


def test_trls_prompt_completion_rows_read_as_prompt_and_response(tmp_path):
    """TRL's prompt-completion format, plain and conversational, gives the units that ``prompt``
    and ``response`` give."""
    path = tmp_path / "completion.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "completion": "2"},
                                         {"prompt": "1+1=", "completion": "two"}]), path)
    chat = tmp_path / "chat_completion.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1="}],
                                          "completion": [{"role": "assistant", "content": "2"}]}]), chat)
    assert [(u.prompt, u.responses) for u in load_sft_files(str(path))] == [
        ([{"role": "user", "content": "1+1="}], ["2", "two"])]
    assert [(u.prompt, u.responses) for u in load_sft_files(str(chat))] == [
        ([{"role": "user", "content": "1+1="}], ["2"])]


MULTI_TURN = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]


def test_every_assistant_turn_of_a_conversation_is_scored_and_nothing_else(tmp_path, models):
    """A multi-turn ``messages`` row is one unit whose loss covers each assistant turn (its tokens
    and EOS, after the messages before it), as TRL's assistant-only loss; the last turn is the
    response that evaluation checks."""
    path = tmp_path / "multi.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": MULTI_TURN}]), path)
    [unit] = load_sft_files(str(path))
    assert unit.prompt == MULTI_TURN[:3] and unit.responses == ["19"]
    assert unit.earlier_turns == [(MULTI_TURN[:1], "2")]
    batch = unit_batch([unit], models.tokenizer, 256, models.device)
    eos = [models.tokenizer.eos_token_id]
    scored = [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids, batch.loss_mask)]
    assert scored == [models.tokenizer(turn, add_special_tokens=False)["input_ids"] + eos for turn in ("2", "19")]
    assert batch.unit_of_row.tolist() == [0, 0] and batch.num_units == 1


@pytest.mark.parametrize("bad, field", [
    ({"prompt": "1+1="}, "response"),
    ({"prompt": "1+1=", "completion": []}, "completion"),
    ({"response": "2"}, "prompt"),
    ({"prompt": "", "response": "2"}, "prompt"),
    ({"messages": [{"role": "user", "content": "1+1="}, {"role": "user", "content": "2"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "1+1="}]}, "messages"),
])
def test_a_malformed_row_names_file_row_and_field(tmp_path, bad, field):
    path = tmp_path / "bad.parquet"
    answer = [{"role": "assistant", "content": "2"}]
    good = ({"messages": [{"role": "user", "content": "1+1="}, *answer]} if "messages" in bad
            else {"prompt": "1+1=", "completion": answer} if "completion" in bad
            else {"prompt": "1+1=", "response": "2"})  # a file has its first row's columns
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(DataError, match=rf"{path} row 1: .*'{field}'"):
        load_sft_files(str(path))


def test_embedded_units_answer_correctly_and_held_out_prompts_are_disjoint():
    data = sft_run_config().engine.data
    train, val = load_units(data, "train", 0), load_units(data, "val", 0)
    for unit in train + val:
        a, b = unit.prompt[0]["content"].rstrip("=").split("+")
        assert unit.responses == [str(int(a) + int(b))]
    assert not {u.prompt[0]["content"] for u in train} & {u.prompt[0]["content"] for u in val}


def test_the_loss_reads_response_tokens_only(models):
    """Changing the prompt's tokens changes what conditions the response, never which tokens are
    scored: the mask covers the response and EOS, exactly."""
    unit = SFTUnit("t", [{"role": "user", "content": "12+7="}], ["19"])
    batch = unit_batch([unit], models.tokenizer, 256, models.device)
    scored = batch.input_ids[0][batch.loss_mask[0].bool()].tolist()
    assert scored == models.tokenizer("19", add_special_tokens=False)["input_ids"] + [models.tokenizer.eos_token_id]


# ----------------------------------------------------------------------------- objective under DP
def test_sft_per_unit_gradients_equal_each_unit_computed_alone(models):
    """Units with 1, 2 and 3 responses of different lengths, and a two-turn conversation, in one
    forward pass: each unit's
    pooled Opacus gradient is the gradient of that unit's loss computed alone."""
    units = [SFTUnit("t", [{"role": "user", "content": "12+7="}], ["19"]),
             SFTUnit("t", [{"role": "user", "content": "3+40="}], ["43", "34"]),
             SFTUnit("t", [{"role": "user", "content": "9+9="}], ["18", "81", "180"]),
             SFTUnit("t", MULTI_TURN[:3], ["19"], [(MULTI_TURN[:1], "2")])]  # a conversation: two turns scored
    assert_units_are_independent(LocalSFTTrainer(sft_run_config().engine, units, models=models), units)


# ----------------------------------------------------------------------------- a short federated run
def test_federated_sft_lowers_the_held_out_response_loss(sft_run):
    """Round 0 against round 2 on the 96 held-out prompts of the three clients; Flower's
    evaluation loss is the response loss. Measured (seeded DP; embedded model of recipe version 3):
    0.596 -> 0.549, exact match 0.52 -> 0.53 (version 2: 0.660 -> 0.570, exact match
    0.40 -> 0.48)."""
    (loss_before, before), (loss_after, after) = sft_run["before"], sft_run["after"]
    assert loss_before == pytest.approx(before["response_loss"]) and loss_after == pytest.approx(after["response_loss"])
    assert after["response_loss"] < before["response_loss"] - 0.04, (before, after)
    assert 0 <= before["accuracy"] <= 1 and before["reward"] == before["accuracy"]  # exact match


def test_the_final_sft_adapter_starts_the_policy_stage_bit_exactly(sft_run):
    """``model.init_adapter`` = the SFT run's ``adapters/final/policy``: the policy stage's
    initial adapter (what the server and every client build, ``stages.build_stage_models``) is
    the SFT run's final global adapter, bit for bit, not the fresh initialisation."""
    engine = sft_run_config(**{"stage": "policy", "model.init_adapter": str(sft_run["final"] / "policy")}).engine
    started = build_stage_models(engine).adapters.get_arrays()
    assert len(started) == len(sft_run["weights"])
    assert all(np.array_equal(a, b) for a, b in zip(started, sft_run["weights"]))
    assert not all(np.array_equal(a, b) for a, b in zip(started, sft_run["initial"]))


def test_the_policy_stage_starts_where_sft_ended_on_the_same_held_out_prompts(sft_run):
    """On the embedded task the two stages hold the same held-out prompts, and SFT's exact match
    is the policy's rule reward: the policy stage's round 0 reports SFT's last figure."""
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.trainer import LocalPPOTrainer

    engine = sft_run_config(**{"stage": "policy", "model.init_adapter": str(sft_run["final"] / "policy")}).engine
    models = build_stage_models(engine)
    units, rows = load_units(engine.data, "val", 0, 0, CLIENTS), load_rows(engine.data, "val", 0, 0, CLIENTS)
    assert [u.prompt for u in units] == [r["prompt"] for r in rows]
    sft = LocalSFTTrainer(sft_run_config().engine, units, models=models).evaluate(units)
    policy = LocalPPOTrainer(engine, rows, models=models).evaluate(rows)
    assert sft.accuracy == policy.accuracy and sft.reward == policy.reward


# ----------------------------------------------------------------------------- bad input
def test_a_missing_init_adapter_is_refused_naming_the_key(tmp_path, sft_run):
    for missing in (tmp_path / "nowhere", tmp_path):  # no directory; a directory that holds no adapter
        with pytest.raises(ConfigError, match=r"model\.init_adapter=.*must be an existing PEFT adapter directory"):
            sft_run_config(**{"stage": "policy", "model.init_adapter": str(missing)})
    with pytest.raises(ConfigError, match=r"model\.init_adapter=.*must be empty under stage='reward_model'"):
        sft_run_config(**{"stage": "reward_model", "model.init_adapter": str(sft_run["final"] / "policy")})


def test_an_init_adapter_of_another_rank_is_refused_naming_the_keys(sft_run):
    engine = sft_run_config(**{"stage": "policy", "model.init_adapter": str(sft_run["final"] / "policy"),
                               "model.lora_rank": 4}).engine
    with pytest.raises(ConfigError, match=r"model\.init_adapter=.*r=8.*model\.lora_rank"):
        build_stage_models(engine)


def test_a_response_longer_than_the_model_is_refused_before_training(models):
    engine = sft_run_config().engine
    units = [SFTUnit("t", [{"role": "user", "content": "1+1="}], ["2" * 100])]  # the embedded model has 64 positions
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length=.*more than the model's 64 positions"):
        VerlClient(engine, units, [], models=models)
