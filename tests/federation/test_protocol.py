"""The typed messages between server and client: what is written is what is read, and a
malformed message is an error naming the entry."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flwr_verl.federation.protocol import (
    STATUS_BUDGET,
    STATUS_OK,
    EvaluateConfig,
    EvaluateReport,
    FitConfig,
    FitReport,
    PreflightConfig,
    PrivacyReport,
    ProtocolError,
    SecAggBounds,
    SparseRound,
    TrainingSummary,
)

PRIVACY = PrivacyReport(fits_next_round=True, epsilon_run=1.5)
TRAINING = TrainingSummary(reward_before=0.25, reward_after=0.5, reward_mean=0.375, kl=0.01, response_length=3.5,
                           pg_loss=-0.02, time_fit=1.0, time_rollout=0.2, time_reward=0.01, time_log_prob=0.1,
                           time_advantage=0.001, time_update=0.5)


@pytest.mark.parametrize("config", [
    FitConfig(server_round=3, local_iterations=10, planned_iterations=80, proximal_mu=0.01),
    FitConfig(server_round=1, local_iterations=1, planned_iterations=8, proximal_mu=0.0,
              secagg=SecAggBounds(clipping_range=1.0, max_weight=4096.0), fail_partition=2),
    FitConfig(server_round=2, local_iterations=10, planned_iterations=80, proximal_mu=0.0, normalize_update=True),
    FitConfig(server_round=4, local_iterations=2, planned_iterations=8, proximal_mu=0.0,
              sparse=SparseRound(density=0.25, seed=2**62 + 5)),
], ids=["plain", "secure", "fednova", "sparse"])
def test_fit_config_round_trips_through_flowers_config(config):
    wire = config.to_config()
    assert all(isinstance(v, (bool, int, float, str)) for v in wire.values())  # what a Flower ConfigRecord holds
    assert FitConfig.from_config(wire) == config


@pytest.mark.parametrize("config", [
    EvaluateConfig(server_round=0),
    EvaluateConfig(server_round=0, preflight=PreflightConfig(SecAggBounds(1.0, 4096.0), frozen_weights="ab" * 32)),
    EvaluateConfig(server_round=3, preflight=PreflightConfig()),
], ids=["plain", "carries-a-secure-preflight", "carries-a-plain-preflight"])
def test_evaluate_config_round_trips_through_flowers_config(config):
    wire = config.to_config()
    assert all(isinstance(v, (bool, int, float, str)) for v in wire.values())
    assert EvaluateConfig.from_config(wire) == config


@pytest.mark.parametrize("report", [
    FitReport(status=STATUS_OK, partition_id=1, client_id="org-b", bytes_received=10, bytes_sent=20,
              privacy=PRIVACY, training=TRAINING),
    FitReport(status=STATUS_BUDGET, partition_id=0, client_id="0", bytes_received=10, bytes_sent=0, privacy=PRIVACY),
    FitReport(status=STATUS_OK, partition_id=2, client_id="2", bytes_received=1, bytes_sent=1, iterations=10,
              training=TRAINING),
], ids=["trained-under-dp", "refused", "trained-without-dp"])
def test_fit_report_round_trips_through_flowers_metrics(report):
    wire = report.to_metrics()
    assert all(isinstance(v, (bool, int, float, str)) for v in wire.values())
    assert FitReport.from_metrics(wire) == report


def test_evaluate_report_round_trips():
    report = EvaluateReport(reward=0.5, accuracy=0.25)
    assert EvaluateReport.from_metrics(report.to_metrics()) == report
    assert "response_loss" not in report.to_metrics() and report.loss == 0.5  # Flower's loss: 1 - reward
    sft = EvaluateReport(reward=0.5, accuracy=0.5, response_loss=0.7)  # stage sft
    assert EvaluateReport.from_metrics(sft.to_metrics()) == sft and sft.loss == 0.7


@pytest.mark.parametrize(("broken", "message"), [
    ({"server_round": None}, "'server_round' is missing"),
    ({"server_round": 1.5}, "'server_round'=1.5 must be of type int"),
    ({"proximal_mu": "0.1"}, "'proximal_mu'='0.1' must be of type float"),
    ({"secure": True}, "'secagg_clipping_range' is missing"),
])
def test_a_malformed_fit_config_names_the_entry(broken, message):
    wire = FitConfig(server_round=1, local_iterations=1, planned_iterations=1, proximal_mu=0.0).to_config()
    for key, value in broken.items():
        if value is None:
            del wire[key]
        else:
            wire[key] = value
    with pytest.raises(Exception, match=message) as error:
        FitConfig.from_config(wire)
    assert isinstance(error.value, (ProtocolError, ValueError))


def test_a_report_with_an_unknown_status_or_a_bool_for_an_int_is_rejected():
    wire = FitReport(status=STATUS_OK, partition_id=1, client_id="1", bytes_received=0, bytes_sent=0).to_metrics()
    with pytest.raises(ProtocolError, match="'status'='done' must be one of ok, privacy_budget_exhausted"):
        FitReport.from_metrics({**wire, "status": "done"})
    with pytest.raises(ProtocolError, match="'partition_id'=True must be of type int"):
        FitReport.from_metrics({**wire, "partition_id": True})


def test_an_infinite_epsilon_survives_the_trip():
    loud = PrivacyReport(fits_next_round=False, epsilon_run=math.inf)
    report = FitReport(status=STATUS_OK, partition_id=0, client_id="0", bytes_received=0, bytes_sent=0, privacy=loud)
    assert FitReport.from_metrics(report.to_metrics()).privacy == loud
    quiet = dataclasses.replace(report, privacy=PrivacyReport(fits_next_round=True))  # no epsilon: weights not exact
    assert "privacy.epsilon_run" not in quiet.to_metrics()
    assert FitReport.from_metrics(quiet.to_metrics()).privacy == PrivacyReport(True, None)
    with pytest.raises(ProtocolError, match="'epsilon_run'=-1.0 must be a number >= 0"):
        FitReport.from_metrics({**report.to_metrics(), "privacy.epsilon_run": -1.0})
