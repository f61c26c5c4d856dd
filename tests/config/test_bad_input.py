"""Bad input: each case stops with a clear ``FlwrVerlError`` before any training, and no traceback.

Most cases call the code a client or the server runs (``parse_run_config``, ``build_models``,
``load_rows``, ``VerlClient``) directly. The last test runs ``flwr run`` on a real SuperLink with
a bad config and reads what the user sees.
"""

from __future__ import annotations

import io
import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flwr.app import DEFAULT_TTL, Context, Error, Message, MessageType, Metadata, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.common.config import flatten_dict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.compat.common.recorddict_compat import fitins_to_recorddict

from flwr_verl.config import ConfigError, DataConfig, FlwrVerlError, ModelConfig, parse_run_config
from flwr_verl.engine.data import DataError, load_rows
from flwr_verl.engine.models import AdapterShapeError, ModelLoadError, build_models
from flwr_verl.engine.rewards import RewardError
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.mods import ConciseErrors
from flwr_verl.federation.protocol import EvaluateConfig, FitConfig
from tests.conftest import TINY
from tests.flower_harness import REPO, local_deployment, run_directories

GOOD_ROW = {"data_source": "toy", "prompt": [{"role": "user", "content": "1+1="}],
            "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 0}}


# ----------------------------------------------------------------------------- model
def test_model_path_that_does_not_exist():
    with pytest.raises(ConfigError, match=r"model\.path='/no/such/model' is invalid: must be an existing local"):
        parse_run_config({"model.path": "/no/such/model"})


def test_model_path_that_is_not_a_causal_lm(tmp_path):
    from transformers import DistilBertConfig

    encoder = tmp_path / "encoder"
    DistilBertConfig(n_layers=1, dim=8, hidden_dim=16, n_heads=2, vocab_size=32).save_pretrained(encoder)
    with pytest.raises(ModelLoadError, match=r"model\.path=.*encoder.* is not a loadable Hugging Face causal LM"):
        build_models(ModelConfig(path=str(encoder)), with_critic=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"model\.path=.*empty.* is not a loadable"):
        build_models(ModelConfig(path=str(empty)), with_critic=False)


# ----------------------------------------------------------------------------- data
def test_dataset_file_that_is_missing(tmp_path):
    missing = tmp_path / "train.parquet"
    with pytest.raises(DataError, match=rf"{missing}: dataset file not found"):
        load_rows(DataConfig(train_files=str(missing)), "train", seed=0)


@pytest.mark.parametrize("row, field", [
    ({k: v for k, v in GOOD_ROW.items() if k != "prompt"}, "prompt"),
    ({**GOOD_ROW, "reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({**GOOD_ROW, "data_source": None}, "data_source"),
])
def test_malformed_row_names_file_row_and_field(tmp_path, row, field):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_ROW, GOOD_ROW, row]), path)
    with pytest.raises(DataError) as error:
        load_rows(DataConfig(train_files=str(path)), "train", seed=0)
    assert str(path) in str(error.value) and "row 2" in str(error.value) and f"'{field}'" in str(error.value)


def test_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(DataError, match=rf"{path}: not a readable parquet file"):
        load_rows(DataConfig(train_files=str(path)), "train", seed=0)


# ----------------------------------------------------------------------------- reward functions
REWARDS = '''
def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("answer")


def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "correct"


def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")
'''


@pytest.fixture(scope="module")
def rows(tiny_config):
    config = tiny_config()
    return load_rows(config.data, "train", seed=0), load_rows(config.data, "val", seed=0)


def test_reward_path_that_does_not_exist():
    with pytest.raises(ConfigError, match=r"custom_reward_function\.path='/no/reward\.py' is invalid"):
        parse_run_config({"custom_reward_function.path": "/no/reward.py"})


@pytest.mark.parametrize("name, message", [
    ("missing", r"custom_reward_function\.name='missing': no such function in"),
    ("raises", r"reward function .*raises on prompt '.*' \(data_source='flwr_verl/arithmetic'\) raised KeyError"),
    ("not_a_number", r"returned 'correct'; expected a finite float"),
    ("nan", r"returned nan; expected a finite float"),
])
def test_reward_function_that_is_missing_raises_or_returns_non_numbers(tiny_config, rows, tmp_path, name,
                                                                        message, monkeypatch):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    config = tiny_config(custom_reward_function={"path": str(path), "name": name})
    trained = []
    monkeypatch.setattr("flwr_verl.engine.trainer.LocalPPOTrainer.fit", lambda *a, **k: trained.append(1))
    with pytest.raises(RewardError, match=message):  # raised while the client is built, before fit
        VerlClient(config, *rows).fit([], {})
    assert not trained


# ----------------------------------------------------------------------------- config values
@pytest.mark.parametrize("override, message", [
    ({"proximal-mu": -0.1}, r"proximal-mu=-0.1 is invalid: must be >= 0"),
    ({"model.lora_rank": 0}, r"model\.lora_rank=0 is invalid: must be > 0"),
    ({"secagg.reconstruction-threshold": 4}, r"secagg\.reconstruction-threshold=4 is invalid: must be in \[2, "
                                             r"secagg\.num-shares=3\)"),
    ({"secagg.num-shares": 5, "secagg.reconstruction-threshold": 4},
     r"secagg\.num-shares=5 is invalid: must be <= min-fit-clients=3"),
    ({"algorithm.adv_estimator": "ppo2"}, r"algorithm\.adv_estimator='ppo2' is invalid: allowed: gae, grpo"),
    ({"privacy.noise_multiplier": -0.5}, r"privacy\.noise_multiplier=-0.5 is invalid: must be >= 0"),
])
def test_config_value_out_of_range(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(override)


# ----------------------------------------------------------------------------- wrong parameters
@pytest.fixture(scope="module")
def client(tiny_config, rows):
    return VerlClient(tiny_config(), *rows, partition_id=1)


FIT_CONFIG = FitConfig(server_round=1, local_iterations=1, planned_iterations=1, proximal_mu=0.0).to_config()


def test_parameters_of_another_model_name_expected_and_received_shapes(client):
    rank4 = build_models(ModelConfig(lora_rank=4), with_critic=False).adapters.get_arrays()
    expected = client.adapters.get_arrays()
    before = [a.copy() for a in expected]
    with pytest.raises(AdapterShapeError) as error:
        client.fit(rank4, FIT_CONFIG)
    message = str(error.value)
    assert f"expected shape {expected[0].shape}" in message and f"received {rank4[0].shape}" in message
    with pytest.raises(AdapterShapeError, match=rf"expected {len(expected)} adapter arrays .* received "
                                                rf"{len(expected) - 1}"):
        client.fit(expected[:-1], FIT_CONFIG)
    with pytest.raises(AdapterShapeError):
        client.evaluate(rank4, EvaluateConfig(server_round=1).to_config())
    assert all(np.array_equal(a, b) for a, b in zip(client.adapters.get_arrays(), before))  # nothing trained


def incoming_train_message(arrays: list[np.ndarray]) -> Message:
    """A legacy fit instruction as a SuperNode hands it to the ClientApp: content and full metadata
    (what Flower builds from the wire; an instruction built in-process would need a running task)."""
    content = fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), FIT_CONFIG), keep_input=True)
    metadata = Metadata(run_id=7, message_id="instruction-1", src_node_id=SUPERLINK_NODE_ID, dst_node_id=3,
                        reply_to_message_id="", group_id="1", created_at=time.time(), ttl=DEFAULT_TTL,
                        message_type=MessageType.TRAIN)
    return Message(content, metadata=metadata)


def test_client_errors_reach_the_server_as_one_line():
    """The real ClientApp (its mods included) answers a fit with wrong-shaped parameters with a
    one-line error reply, addressed back to the sender of the instruction."""
    from apps.client_app import app

    context = Context(run_id=7, node_id=3, node_config={"partition-id": 1, "num-partitions": 2},
                      state=RecordDict(), run_config=flatten_dict(TINY))
    reply = app(incoming_train_message([np.zeros((2, 2), np.float32)]), context)
    assert reply.has_error() and not reply.has_content()
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    reason = reply.error.reason
    assert reason.startswith("partition 1: AdapterShapeError: expected") and "\n" not in reason, reason
    assert (reply.metadata.reply_to_message_id, reply.metadata.src_node_id, reply.metadata.dst_node_id,
            reply.metadata.run_id, reply.metadata.message_type) == ("instruction-1", 3, SUPERLINK_NODE_ID, 7, "train")


def test_user_errors_are_logged_without_a_traceback():
    stream = io.StringIO()
    logger = logging.getLogger("test_concise_errors")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.addFilter(ConciseErrors())
    try:
        try:
            try:
                parse_run_config({"proximal-mu": -1.0})
            except ConfigError as error:
                raise RuntimeError("wrapped by Flower") from error
        except RuntimeError as error:
            logger.error("ServerApp raised an exception", exc_info=error)
        try:
            raise KeyError("a bug")
        except KeyError as error:
            logger.error("ServerApp raised an exception", exc_info=error)
    finally:
        logger.removeHandler(handler)
    first, *rest = stream.getvalue().splitlines()
    assert first == "flwr-verl: run failed: ConfigError: proximal-mu=-1.0 is invalid: must be >= 0 (0 = FedAvg)"
    assert "Traceback" in "\n".join(rest)  # a bug keeps its traceback
    assert issubclass(ConfigError, FlwrVerlError)


# ----------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_flwr_run_with_a_bad_config_fails_cleanly_before_training(tmp_path):
    """`flwr run` on a real SuperLink: the ServerApp validates the config first and ends the run as
    failed with one line naming the key, the value and what is allowed."""
    out = tmp_path / "out"
    with local_deployment(tmp_path / "fl", num_supernodes=0) as deployment:
        done = deployment.flwr_run(REPO, {"proximal-mu": -1.0, "output-dir": str(out)}, timeout=300)
        log = done.stdout + done.stderr
        status = deployment.run_status(log)
    assert "flwr-verl: run failed: ConfigError: proximal-mu=-1.0 is invalid: must be >= 0 (0 = FedAvg)" in log, log
    assert "Traceback" not in log, log
    assert not run_directories(out)  # stopped before a run directory, a model or a client
    assert status == "finished:failed", status


def test_preflight_finds_a_batch_larger_than_a_clients_prompts_and_names_the_clients(tiny_config):
    """Before round 1 every client checks the config against its own data. A batch that one
    client's prompts cannot fill is one line naming the clients, not a SecAgg+ halt in round 1."""
    from flwr.common import Code, GetPropertiesRes, Status
    from flwr.common.constant import ErrorCode

    from flwr_verl.config import FederationConfig
    from flwr_verl.federation.inprocess import InProcessClients
    from flwr_verl.federation.protocol import PreflightConfig, SecAggBounds
    from flwr_verl.federation.rounds import PreflightFailed
    from flwr_verl.federation.strategy import FedProxAdapters

    config = tiny_config(data={"train_batch_size": 16}, actor={"ppo_mini_batch_size": 8})
    rows = load_rows(config.data, "train", 0)
    small = VerlClient(config, rows[:10], [], partition_id=1)
    with pytest.raises(ConfigError, match=r"data.train_batch_size=16 with 10 private prompts"):
        small.get_properties(PreflightConfig().to_config())
    with pytest.raises(ConfigError, match=r"secagg.max-weight=8 is invalid: this client has 32 training prompts"):
        VerlClient(config, rows, [], partition_id=0).get_properties(PreflightConfig(SecAggBounds(1.0, 8.0)).to_config())
    assert VerlClient(config, rows, [], partition_id=0).get_properties(PreflightConfig().to_config()) == \
        {"status": "ok", "preflight.client_id": "0"}

    strategy = FedProxAdapters(FederationConfig(min_fit_clients=3, min_available_clients=3),
                               [np.zeros(2, np.float32)], local_iterations=1)
    manager = InProcessClients.named(["a", "b", "c"])
    assert len(strategy.configure_preflight(1, manager)) == 3
    reason = "data.train_batch_size=16 with 10 private prompts gives sample rate q=1.6"
    failures = [Exception(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"partition {p}: ConfigError: {reason}"))
                for p in (1, 2)]
    ok = [(manager.proxies["a"], GetPropertiesRes(Status(Code.OK, ""), {"status": "ok", "preflight.client_id": "0"}))]
    with pytest.raises(PreflightFailed) as error:
        strategy.check_preflight(1, ok, failures)
    assert str(error.value) == ("round 1: preflight: 2 of 3 clients cannot train; nothing was trained:\n"
                                f"  clients 1, 2: ConfigError: {reason}")
    strategy.check_preflight(1, ok, [])  # all ready: no error
    from flwr_verl.federation.rounds import NoReply

    strategy.check_preflight(1, ok, [NoReply("node 7 sent no get_properties reply within 600 s")])  # a warning
