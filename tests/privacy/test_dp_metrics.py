"""``privacy.metrics = "dp"``: the released training metrics' noise, their spend in the ledger,
what the strategy receives, and bad input."""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch

from flwr_verl.config import ConfigError, FederationConfig, SecAggConfig, parse_run_config
from flwr_verl.engine.data import load_rows
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import FitReport
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.privacy.dpsgd import (
    IterationMechanism,
    centered_prompt_sum,
    noise_for_target_epsilon,
    release_metrics,
    released_metric_std,
)
from flwr_verl.privacy.ledger import DataSetKey, PrivacyLedger

DELTA = 1e-5
DP_METRICS_ON = {"enabled": True, "noise_multiplier": 1.0, "deterministic": True, "metrics": "dp",
                 "metrics_noise_multiplier": 2.0}
REWARD_CLIP = {"clip": 1.0}


def test_centered_prompt_sum_clips_each_prompt_to_its_range():
    values = torch.tensor([-5.0, -1.0, 0.0, 1.0, 7.0])  # clipped to [-1, 1], then to [-1/2, 1/2]
    assert centered_prompt_sum(values, -1.0, 1.0) == pytest.approx(-0.5 - 0.5 + 0.0 + 0.5 + 0.5)


def test_released_metrics_have_the_configured_noise():
    """20000 releases at a fixed seed: each value's empirical mean and std match a fixed
    denominator (iterations x batch size) and the std sigma_m * sqrt(2) / 2 * sqrt(T) / (T B) of the
    range, computed here from the definitions."""
    ranges = {"reward_mean": (-1.0, 1.0), "response_length": (0.0, 6.0)}
    sums = {"reward_mean": 3.0, "response_length": -2.0}
    iterations, batch, sigma_m = 4, 8, 2.0
    rng = np.random.default_rng(0)
    draws = [release_metrics(sums, ranges, iterations=iterations, batch_size=batch, noise_multiplier=sigma_m, rng=rng)
             for _ in range(20_000)]
    for name, (low, high) in ranges.items():
        values = np.array([d[name] for d in draws])
        expected_std = (high - low) * sigma_m * (math.sqrt(2) / 2) * math.sqrt(iterations) / (iterations * batch)
        assert released_metric_std(low, high, num_metrics=2, noise_multiplier=sigma_m, iterations=iterations,
                                   batch_size=batch) == pytest.approx(expected_std)
        assert values.std() == pytest.approx(expected_std, rel=0.03)
        expected_mean = low + (high - low) * (0.5 + sums[name] / (iterations * batch))
        assert abs(values.mean() - expected_mean) < 4 * expected_std / math.sqrt(len(values))


def _rdp_epsilon(q: float, sigma: float, steps: int) -> float:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = RDPAccountant.DEFAULT_ALPHAS
    return get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders),
                             delta=DELTA)[0]


@pytest.fixture(scope="module")
def dp_metrics_client(tiny_config):
    config = tiny_config(privacy=DP_METRICS_ON, custom_reward_function=REWARD_CLIP,
                         trainer={"local_iterations": 2}, actor={"ppo_epochs": 2})
    return VerlClient(config, load_rows(config.data, "train", seed=0), load_rows(config.data, "val", seed=0))


def test_what_the_strategy_receives_under_dp_and_what_the_ledger_spent(dp_metrics_client):
    """The FitRes has the protocol's entries, the privacy report and the noised metrics, nothing
    else; the epsilon is the update's K = 2 epochs at sigma and the metrics' release at sigma_m,
    one Gaussian over the same Poisson draw, subsampled at q = 8/32 for 2 iterations (Opacus's RDP
    primitives)."""
    client = dp_metrics_client
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=1, min_available_clients=1,
                                                secagg=SecAggConfig(enabled=False)),
                               client.adapters.get_arrays(), local_iterations=2)
    ((_, res),), round_metrics = fit_round(strategy, InProcessClients({"0": client}), 1)
    protocol = {"status", "partition_id", "client_id", "bytes_received", "bytes_sent", "iterations"}
    noised = {"training_dp.reward_mean", "training_dp.response_length",
              "training_dp.reward_mean_noise_std", "training_dp.response_length_noise_std"}
    assert {k for k in res.metrics if not k.startswith("privacy.")} == protocol | noised
    report = FitReport.from_metrics(res.metrics)
    assert report.training is None and all(math.isfinite(v) for v in vars(report.training_dp).values())
    assert round_metrics["dp_reward_mean"] == report.training_dp.reward_mean  # one client: its own value
    assert report.training_dp.reward_mean_noise_std == pytest.approx(2 * 2.0 * (math.sqrt(2) / 2) / (math.sqrt(2) * 8))

    sigma, sigma_m, epochs, q = 1.0, 2.0, 2, 8 / 32
    joint = 1 / math.sqrt(epochs / sigma ** 2 + 1 / sigma_m ** 2)
    assert report.privacy.epsilon_run == pytest.approx(_rdp_epsilon(q, joint, 2), rel=1e-9)
    assert report.privacy.epsilon_run > _rdp_epsilon(q, sigma / math.sqrt(epochs), 2)  # the metrics cost


def test_the_ledger_keeps_the_metrics_mechanism_and_upgrades_an_old_file(tmp_path):
    path = tmp_path / "ledger.sqlite"
    old = sqlite3.connect(path)  # a ledger written before the metrics' column existed
    old.executescript("""
        CREATE TABLE data_sets (fingerprint TEXT NOT NULL, unit TEXT NOT NULL, description TEXT NOT NULL,
            created REAL NOT NULL, PRIMARY KEY (fingerprint, unit));
        CREATE TABLE spends (id INTEGER PRIMARY KEY AUTOINCREMENT, fingerprint TEXT NOT NULL, unit TEXT NOT NULL,
            run_id TEXT NOT NULL, server_round INTEGER NOT NULL, noise_multiplier REAL NOT NULL,
            sample_rate REAL NOT NULL, ppo_epochs INTEGER NOT NULL, iterations INTEGER NOT NULL,
            recorded REAL NOT NULL);
        INSERT INTO data_sets VALUES ('ab', 'prompt', '', 0);
        INSERT INTO spends (fingerprint, unit, run_id, server_round, noise_multiplier, sample_rate, ppo_epochs,
            iterations, recorded) VALUES ('ab', 'prompt', '1', 1, 1.0, 0.25, 1, 3, 0);
    """)
    old.close()
    ledger = PrivacyLedger(path)
    key = DataSetKey("ab", "prompt")
    ledger.spend(key, IterationMechanism(1.0, 0.25, 1, 2.0), 2, budget=0, delta=DELTA, accountant="rdp",
                 run_id="2", server_round=1)
    ledger.close()
    account = PrivacyLedger(path, read_only=True).account(key)
    assert account.history == [(1.0, 0.25, 3), (1 / math.sqrt(1 + 1 / 4), 0.25, 2)]


def test_target_epsilon_is_met_with_the_metrics_release(tiny_config):
    config = tiny_config(privacy={**DP_METRICS_ON, "target_epsilon": 8.0, "metrics_noise_multiplier": 4.0},
                         custom_reward_function=REWARD_CLIP)
    sigma = noise_for_target_epsilon(config.privacy, 0.25, 20, 2)
    joint = IterationMechanism(sigma, 0.25, 2, 4.0).effective_noise_multiplier
    assert _rdp_epsilon(0.25, joint, 20) == pytest.approx(8.0, abs=0.05)
    too_little_metrics_noise = tiny_config(privacy={**DP_METRICS_ON, "target_epsilon": 3.0},
                                           custom_reward_function=REWARD_CLIP)
    with pytest.raises(ConfigError, match=r"privacy\.metrics_noise_multiplier=2\.0 is invalid"):
        noise_for_target_epsilon(too_little_metrics_noise.privacy, 0.25, 20, 2)


@pytest.mark.parametrize(("privacy", "reward", "key"), [
    ({"enabled": False, "metrics": "dp"}, REWARD_CLIP, "privacy.metrics"),
    ({**DP_METRICS_ON, "metrics_noise_multiplier": 0.0}, REWARD_CLIP, "privacy.metrics_noise_multiplier"),
    ({**DP_METRICS_ON, "metrics_noise_multiplier": -1.0}, REWARD_CLIP, "privacy.metrics_noise_multiplier"),
    (DP_METRICS_ON, {"clip": 0.0}, "custom_reward_function.clip"),
])
def test_bad_dp_metrics_config_names_the_key(tiny_config, privacy, reward, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + "="):
        tiny_config(privacy=privacy, custom_reward_function=reward)


def test_dp_metrics_are_refused_for_the_reward_model_stage():
    with pytest.raises(ConfigError, match=r"privacy\.metrics='dp'.*stage='reward_model'"):
        parse_run_config({"stage": "reward_model", "custom_reward_function.clip": 1.0,
                          **{f"privacy.{key}": value for key, value in DP_METRICS_ON.items()}})


def test_the_progress_line_shows_the_noised_reward():
    from flwr_verl.federation.workflow import progress_line

    record = {"round": 2, "seconds": 3.0, "fit": {"dp_reward_mean": 0.41, "dp_response_length": 5.2}}
    assert progress_line(record, 4).startswith("round 2/4: noised reward 0.410 | not evaluated")
