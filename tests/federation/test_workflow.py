"""What the server sends before round 1 (``workflow.RoundLoop.first_round``), counted message by
message: in a deployment every message starts a ClientApp process on its node, so a fresh run's
initial evaluation carries the preflight instead of a preflight message of its own. Its checks
still run on every client, and a client that cannot train still stops the run before anything
trains, with the preflight's own message."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import flwr.compat.common.recorddict_compat as compat
import pytest
from flwr.app import Error
from flwr.common import (
    Code,
    EvaluateRes,
    GetPropertiesRes,
    MessageType,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import ErrorCode, MessageTypeLegacy
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

from flwr_verl.config import parse_run_config
from flwr_verl.engine.data import load_rows
from flwr_verl.federation import workflow
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients
from flwr_verl.federation.mods import describe
from flwr_verl.federation.rounds import PreflightFailed
from flwr_verl.federation.rundir import RunDirectory
from flwr_verl.federation.strategy import FedProxAdapters

FEDERATION = {"min-fit-clients": 3, "min-evaluate-clients": 3, "min-available-clients": 3, "secagg.enabled": False}


@pytest.fixture(scope="module")
def clients(tiny_config):
    """Three in-process clients on one model; client "2" has fewer prompts than a batch."""
    config = tiny_config(data={"train_batch_size": 8}, actor={"ppo_mini_batch_size": 8})
    first = VerlClient(config, load_rows(config.data, "train", 0), load_rows(config.data, "val", 0)[:2], partition_id=0)
    models = first.trainer.models
    return {"0": first,
            "1": VerlClient(config, load_rows(config.data, "train", 1), load_rows(config.data, "val", 1)[:2],
                            partition_id=1, models=models),
            "2": VerlClient(config, load_rows(config.data, "train", 2)[:5], load_rows(config.data, "val", 2)[:2],
                            partition_id=2, models=models)}


def first_round(clients: dict, cids: list[str], tmp_path, monkeypatch, **federation) -> tuple[list[str], list[dict]]:
    """``RoundLoop.first_round`` over ``cids``, each message answered in process as a ClientApp
    would; returns the message types sent and the run directory's records."""
    sent: list[str] = []

    @dataclass
    class Answered(workflow.Sent):  # answered at once: collect returns its replies
        replies: tuple = ()

    def send(grid, instructions, message_type, server_round, timeout):
        results, failures = [], []
        for proxy, ins in instructions:
            sent.append(message_type)
            client = clients[proxy.cid]
            try:
                if message_type == MessageTypeLegacy.GET_PROPERTIES:
                    results.append((proxy, GetPropertiesRes(Status(Code.OK, ""), client.get_properties(ins.config))))
                else:
                    loss, n, metrics = client.evaluate(parameters_to_ndarrays(ins.parameters), ins.config)
                    results.append((proxy, EvaluateRes(Status(Code.OK, ""), loss, n, metrics)))
            except Exception as error:  # as flwr_verl.federation.mods.concise_errors replies
                failures.append(Exception(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                                f"partition {client.partition_id}: {describe(error)}")))
        return Answered(grid, message_type, {}, timeout, time.monotonic(), replies=(results, failures))

    monkeypatch.setattr(workflow, "send", send)
    monkeypatch.setattr(workflow, "collect", lambda sent: sent.replies)
    run_config = parse_run_config({**FEDERATION, "output-dir": str(tmp_path), **federation})
    initial = clients["0"].adapters.get_arrays()
    strategy = FedProxAdapters(run_config.federation, initial, local_iterations=1)
    run = RunDirectory.create(str(tmp_path), clients["0"].adapters, run_config)
    legacy = SimpleNamespace(
        client_manager=InProcessClients({cid: clients[cid] for cid in cids}),
        state=SimpleNamespace(array_records={
            MAIN_PARAMS_RECORD: compat.parameters_to_arrayrecord(ndarrays_to_parameters(initial), keep_input=True)}))
    loop = workflow.RoundLoop(strategy, run, run_config.federation, secure_fit=None)
    try:
        loop.first_round(grid=None, legacy=legacy)
    finally:
        records = run.records()
    return sent, records


def test_a_fresh_runs_initial_evaluation_carries_the_preflight(clients, tmp_path, monkeypatch):
    sent, records = first_round(clients, ["0", "1"], tmp_path, monkeypatch, **{"min-available-clients": 2,
                                                                                "min-evaluate-clients": 2})
    assert sent == [MessageType.EVALUATE] * 2  # one message per node, not a preflight and an evaluation
    (record,) = records
    assert record["round"] == 0 and 0 <= record["evaluate"]["accuracy"] <= 1


def test_a_client_that_cannot_train_stops_the_run_at_the_carried_preflight(clients, tmp_path, monkeypatch):
    with pytest.raises(PreflightFailed) as error:
        first_round(clients, ["0", "1", "2"], tmp_path, monkeypatch)
    assert str(error.value).startswith("round 1: preflight: 1 of 3 clients cannot train; nothing was trained:\n"
                                       "  clients 2: ConfigError: data.train_batch_size=8 with 5 private prompts")


@pytest.mark.parametrize("federation", [{"evaluate-every": 0}, {"fraction-evaluate": 0.5}])
def test_without_an_initial_evaluation_of_every_client_the_preflight_goes_alone(clients, tmp_path, monkeypatch,
                                                                               federation):
    with pytest.raises(PreflightFailed, match="clients 2: ConfigError: data.train_batch_size=8 with 5 private"):
        first_round(clients, ["0", "1", "2"], tmp_path, monkeypatch, **federation)
    sent, records = first_round(clients, ["0", "1"], tmp_path, monkeypatch, **{"min-available-clients": 2,
                                                                                "min-evaluate-clients": 2, **federation})
    evaluations = 0 if federation.get("evaluate-every") == 0 else 2  # 0.5 of 2 is min-evaluate-clients=2
    assert sent == [MessageTypeLegacy.GET_PROPERTIES] * 2 + [MessageType.EVALUATE] * evaluations
    assert [r["round"] for r in records] == ([0] if evaluations else [])
