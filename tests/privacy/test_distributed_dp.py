"""Client-level DP with distributed Skellam noise (``flwr_verl.privacy.distributed_dp``).

Fast: the noise's distribution (chi-square against scipy's Skellam, fixed seed), the rotation and
the rounding, what Flower's own quantization does to the clients' integers, epsilon against
Opacus's RDP primitives, bad input. Slow: a real SecAgg+ round (``benchmarks/secagg_harness.py``)
whose secure sum is compared, integer for integer, with the sum of what the clients handed it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from flwr_verl.config import ClientLevelConfig, ConfigError, parse_run_config
from flwr_verl.federation.run_config import load_run_config
from flwr_verl.federation.secagg import integer_secagg_parameters
from flwr_verl.privacy import distributed_dp as ddp

CONFIG = ClientLevelConfig(enabled=True, clip_norm=0.1, noise_multiplier=1.0, bits=20)


def _chi_square_p(samples: np.ndarray, variance: float) -> float:
    """p-value of ``samples`` against symmetric Skellam of ``variance`` (bins with >= 20 expected)."""
    law = stats.skellam(variance / 2, variance / 2)
    span = int(6 * math.sqrt(variance)) + 1
    values = np.arange(-span, span + 1)
    expected = law.pmf(values) * samples.size
    keep = expected >= 20
    observed = np.array([(samples == v).sum() for v in values[keep]])
    rest_observed, rest_expected = samples.size - observed.sum(), samples.size - expected[keep].sum()
    return float(stats.chisquare(np.append(observed, rest_observed), np.append(expected[keep], rest_expected)).pvalue)


# ----------------------------------------------------------------------------- the noise
def test_each_clients_noise_is_skellam_of_its_share_of_the_variance():
    rng = ddp.noise_generator((2021,))  # the clients' generator (ChaCha20), on the explicit seed path
    share = 7.5
    samples = ddp.skellam_noise(share, 200_000, rng)
    assert samples.dtype == np.int64
    assert _chi_square_p(samples, share) > 1e-3
    assert abs(samples.mean()) < 4 * math.sqrt(share / samples.size)
    assert samples.var() == pytest.approx(share, rel=0.02)
    # the test has power: the same samples are rejected against a 15% larger variance
    assert _chi_square_p(samples, 1.15 * share) < 1e-6


def test_the_noise_key_comes_from_the_os_unless_a_seed_is_given():
    unseeded = [ddp.noise_generator().integers(0, 2**63, size=4) for _ in range(2)]
    assert not np.array_equal(*unseeded)  # a fresh 256-bit key each time
    seeded = [ddp.noise_generator((7, 1, 0)).integers(0, 2**63, size=4) for _ in range(2)]
    assert np.array_equal(*seeded)  # privacy.deterministic: reproducible
    assert not np.array_equal(seeded[0], ddp.noise_generator((7, 2, 0)).integers(0, 2**63, size=4))


def test_the_summed_shares_are_exactly_skellam_of_the_accounted_variance():
    """Skellam is closed under sums: the shares of the fewest survivors give Sk(central)."""
    plan = ddp._plan(CONFIG, 20, dim=64, num_clients=3, min_survivors=2)
    shrunk = dataclasses.replace(plan, scale=10.0)  # a variance small enough to bin
    rng = np.random.default_rng(7)
    total = sum(ddp.skellam_noise(shrunk.client_variance, 100_000, rng) for _ in range(shrunk.min_survivors))
    assert shrunk.central_variance == pytest.approx(1.0)  # (z * scale * C)^2
    assert _chi_square_p(total, shrunk.central_variance) > 1e-3


# ----------------------------------------------------------------------------- the client's steps
def test_rotation_is_orthonormal_and_undone_by_the_server():
    x = np.random.default_rng(0).normal(size=1024)
    y = ddp.rotate(x, seed=3)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12)
    np.testing.assert_allclose(ddp.unrotate(y, seed=3), x, atol=1e-12)
    assert not np.allclose(ddp.unrotate(y, seed=4), x)  # the seed matters
    spike = ddp.rotate(np.eye(1024)[0], seed=3)  # rotation spreads a spike over every coordinate
    np.testing.assert_allclose(np.abs(spike), 1 / 32, rtol=1e-12)


def test_clipping_bounds_the_whole_update():
    v = np.full(100, 1.0)
    assert np.linalg.norm(ddp.clip_l2(v, 0.5)) == pytest.approx(0.5)
    np.testing.assert_array_equal(ddp.clip_l2(0.01 * v, 0.5), 0.01 * v)  # inside the ball: unchanged


def test_conditional_rounding_is_unbiased_and_within_the_sensitivity():
    plan = ddp.plan_round(CONFIG, 300, num_clients=3, min_survivors=2)
    x = ddp.clip_l2(np.random.default_rng(1).normal(size=plan.padded_dim), plan.clip_norm) * plan.scale
    rng = np.random.default_rng(2)
    draws = np.stack([ddp.conditional_round(x, plan.l2_sensitivity, rng) for _ in range(400)])
    assert draws.dtype == np.int64
    assert (np.abs(draws - x) < 1).all()
    assert np.linalg.norm(draws, axis=1).max() <= plan.l2_sensitivity
    assert np.abs(draws.mean(axis=0) - x).max() < 0.5 / math.sqrt(400) * 5


def test_what_a_client_hands_secagg_already_carries_its_noise_share():
    """The noise is added before the update leaves the client, so every sum that SecAgg+ (or
    anyone) can form from what clients send contains it: decoded alone, one client's message is
    its update plus noise of its share's variance."""
    plan = ddp.plan_round(CONFIG, 4096, num_clients=3, min_survivors=2)
    rng = np.random.default_rng(5)
    update = rng.normal(size=4096) * 1e-4  # inside the clipping ball
    sent = ddp.encode_update([update], plan, server_round=1, rng=rng)
    alone = ddp.decode_aggregate(sent, 1, plan, 1, [(4096,)])[0]
    assert np.std(alone - update) == pytest.approx(math.sqrt(plan.client_variance) / plan.scale, rel=0.05)
    assert np.std(alone - update) > 100 * np.std(update)


def test_flowers_quantization_passes_the_clients_integers_unchanged():
    """What secaggplus_mod does to the encoded update (weight 1, clip, shift, scale 1, stochastic
    rounding), with Flower's own functions: it yields each client's integers modulo 2**bits."""
    from flwr.common.secure_aggregation.quantization import quantize

    plan = ddp.plan_round(CONFIG, 1000, num_clients=3, min_survivors=2)
    params = integer_secagg_parameters(_secagg_parameters(), plan.bits)
    assert round(1 / params.max_weight * params.quantization_range) / params.quantization_range == 1.0
    integers = np.random.default_rng(3).integers(-3 * plan.modulus, 3 * plan.modulus, size=5000)
    sent = ddp.to_secagg_input(integers, plan.modulus)
    quantized = quantize([sent], params.clipping_range, params.quantization_range)[0]
    np.testing.assert_array_equal(quantized.astype(np.int64), np.mod(integers, plan.modulus))


def _secagg_parameters():
    from flwr_verl.config import DataConfig, SecAggConfig
    from flwr_verl.federation.secagg import derive_parameters

    return derive_parameters(SecAggConfig(), DataConfig(train_size=64), num_clients=3)


def test_the_integer_settings_are_accepted_by_flower():
    from flwr.server.workflow import SecAggPlusWorkflow

    SecAggPlusWorkflow(**integer_secagg_parameters(_secagg_parameters(), 20).workflow_kwargs())


def test_the_round_instructions_travel_in_the_fit_config():
    from flwr_verl.federation.protocol import ClientLevelRound, FitConfig, SecAggBounds

    sent = FitConfig(server_round=4, local_iterations=2, planned_iterations=16, proximal_mu=0.0,
                     secagg=SecAggBounds(1.0, 64.0), client_level=ClientLevelRound(num_clients=5, min_survivors=2))
    assert FitConfig.from_config(sent.to_config()) == sent
    plain = FitConfig(server_round=4, local_iterations=2, planned_iterations=16, proximal_mu=0.0)
    assert FitConfig.from_config(plain.to_config()).client_level is None


# ----------------------------------------------------------------------------- accounting
def test_epsilon_at_full_participation_matches_opacus_gaussian_rdp_plus_skellams_term():
    """fraction-fit 1: per round, Opacus's RDP of the Gaussian mechanism at sigma = sqrt(mu) / D2,
    plus the discreteness term of Agarwal et al. (2021, Thm 3.5), computed here independently."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    plan = ddp.plan_round(CONFIG, 5000, num_clients=3, min_survivors=2)
    account = ddp.ClientLevelAccount()
    for _ in range(8):
        account.record(plan, 1.0)
    orders = [float(a) for a in ddp.ORDERS]
    mu, d1, d2 = plan.central_variance, plan.l1_sensitivity, plan.l2_sensitivity
    gaussian = compute_rdp(q=1.0, noise_multiplier=math.sqrt(mu) / d2, steps=8, orders=orders)
    discrete = 8 * np.array([min(((2 * a - 1) * d2**2 + 6 * d1) / (4 * mu**2), 3 * d1 / (2 * mu)) for a in orders])
    expected = get_privacy_spent(orders=orders, rdp=gaussian + discrete, delta=1e-5)[0]
    assert account.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    # with a fine grid the Skellam mechanism is the Gaussian one: within 0.1% of Opacus's figure
    assert account.epsilon(1e-5) == pytest.approx(get_privacy_spent(orders=orders, rdp=gaussian, delta=1e-5)[0],
                                                  rel=1e-3)


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.1, 50), (1.0, 0.3, 10), (2.0, 0.1, 50), (2.0, 0.5, 10)])
def test_client_sampling_amplification_is_an_upper_bound_on_opacus_sampled_gaussian(sigma, q, steps):
    """Zhu & Wang's bound for any mechanism, fed the Gaussian mechanism's RDP, against Opacus's
    exact RDP of the Sampled Gaussian Mechanism: never below it (it is a bound for any mechanism),
    at most 1.6x its epsilon on this grid (measured 1.2x at sigma 1, up to 1.58x at sigma 2)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [float(a) for a in ddp.ORDERS]
    gaussian = np.array([a / (2 * sigma**2) for a in orders])
    ours = ddp.poisson_subsampled_rdp(gaussian, q)
    exact = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders)
    assert (ours >= exact * (1 - 1e-9)).all()
    eps_ours = get_privacy_spent(orders=orders, rdp=steps * ours, delta=1e-5)[0]
    eps_exact = get_privacy_spent(orders=orders, rdp=steps * exact, delta=1e-5)[0]
    assert eps_exact <= eps_ours <= 1.6 * eps_exact
    assert (ddp.poisson_subsampled_rdp(gaussian, 1.0) == gaussian).all()


def test_the_account_composes_rounds_and_round_trips_through_json():
    plan = ddp.plan_round(CONFIG, 5000, num_clients=3, min_survivors=2)
    account = ddp.ClientLevelAccount()
    spent = []
    for _ in range(3):
        account.record(plan, 0.5)
        spent.append(account.epsilon(1e-5))
    assert spent[0] < spent[1] < spent[2]
    assert account.history[-1][-1] == 3  # repeated rounds merge
    assert ddp.ClientLevelAccount.from_json(account.to_json()).epsilon(1e-5) == spent[-1]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("key", "value", "message"), [
    ("clip_norm", 0.0, r"privacy.client_level.clip_norm=0.0 is invalid: must be > 0"),
    ("clip_norm", -1.0, r"privacy.client_level.clip_norm=-1.0 is invalid: must be > 0"),
    ("noise_multiplier", -0.5, r"privacy.client_level.noise_multiplier=-0.5 is invalid: must be >= 0"),
    ("noise_multiplier", 0.0, r"privacy.client_level.noise_multiplier=0.0 is invalid: must be > 0 under"),
    ("bits", 31, r"privacy.client_level.bits=31 is invalid: must be in \[2, 30\]"),
])
def test_bad_client_level_values_fail_with_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config({"privacy.client_level.enabled": True, f"privacy.client_level.{key}": value})


def test_a_bit_width_too_small_for_the_clients_fails_before_training():
    with pytest.raises(ConfigError, match=r"privacy.client_level.bits=6 is invalid for 3 clients per round.*"
                                          r"use privacy.client_level.bits=\d+ or more"):
        load_run_config({"privacy.client_level.enabled": True, "privacy.client_level.bits": 6})
    load_run_config({"privacy.client_level.enabled": True, "privacy.client_level.bits": 12})
    # more clients need more bits: what passes for 3 fails for 500 sampled clients
    with pytest.raises(ConfigError, match=r"bits=12 is invalid for 500 clients"):
        ddp.plan_round(ClientLevelConfig(enabled=True, bits=12), 1, num_clients=500, min_survivors=2)
    # and the SecAgg+ modulus bounds clients times range
    with pytest.raises(ConfigError, match=r"modulus 2\*\*40 holds the sum of at most 1023 clients"):
        ddp.plan_round(ClientLevelConfig(enabled=True, bits=30), 1000, num_clients=1100, min_survivors=2)


def test_client_level_dp_without_secagg_is_refused():
    from flwr_verl.config import FederationConfig
    from flwr_verl.federation.strategy import FedProxAdapters

    with pytest.raises(ConfigError, match=r"needs secagg.enabled=true"):
        parse_run_config({"privacy.client_level.enabled": True, "secagg.enabled": False})
    with pytest.raises(ConfigError, match=r"needs secagg.enabled=true"):
        FedProxAdapters(FederationConfig(), [np.zeros(4)], local_iterations=1, client_level=CONFIG)


def test_the_server_refuses_a_round_with_more_clients_than_the_bits_hold_before_anyone_trains():
    from flwr.common import ndarrays_to_parameters

    from flwr_verl.config import FederationConfig
    from flwr_verl.federation.inprocess import InProcessClients
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    initial = [np.zeros(64)]
    strategy = FedProxAdapters(FederationConfig(), initial, local_iterations=1, secure_aggregation=SecAggBounds(1, 64),
                               client_level=dataclasses.replace(CONFIG, bits=12))
    assert len(strategy.configure_fit(1, ndarrays_to_parameters(initial), InProcessClients.named(range(3)))) == 3
    with pytest.raises(ConfigError, match=r"privacy.client_level.bits=12 is invalid for 500 clients per round"):
        strategy.configure_fit(1, ndarrays_to_parameters(initial), InProcessClients.named(range(500)))


def test_a_sampled_round_splits_the_noise_over_the_fewest_survivors_and_accounts_the_sampling_rate():
    """300 organisations, 10% sampled a round (min-fit-clients 30): each round a fresh uniform
    sample of 30; every client is told to add 1/20 of the accounted variance (at least 20 of 30
    survive SecAgg+'s default 3 shares and threshold 2, not 2), and the round is accounted at q = 0.1."""
    import random

    from flwr.common import ndarrays_to_parameters

    from flwr_verl.config import FederationConfig
    from flwr_verl.federation.inprocess import InProcessClients
    from flwr_verl.federation.protocol import FitConfig, SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    initial = [np.zeros(64)]
    federation = FederationConfig(fraction_fit=0.1, min_fit_clients=30, min_available_clients=300)
    strategy = FedProxAdapters(federation, initial, local_iterations=1, secure_aggregation=SecAggBounds(1, 64),
                               client_level=CONFIG)
    manager = InProcessClients.named(range(300), rng=random.Random(0))
    sampled = []
    for server_round in (1, 2):
        instructions = strategy.configure_fit(server_round, ndarrays_to_parameters(initial), manager)
        sampled.append({proxy.cid for proxy, _ in instructions})
        told = {FitConfig.from_config(dict(ins.config)).client_level for _, ins in instructions}
        assert len(sampled[-1]) == 30 and {(t.num_clients, t.min_survivors) for t in told} == {(30, 20)}
    assert sampled[0] != sampled[1]  # a fresh random sample each round, as Flower's client manager draws
    plan, rate = strategy._round_plan
    assert rate == pytest.approx(0.1) and plan.client_variance == pytest.approx(plan.central_variance / 20)


# ----------------------------------------------------------------------------- real SecAgg+ (slow)
CLIENTS = 3
PHASE_CONFIG = {"enabled": True, "clip_norm": 0.5, "noise_multiplier": 0.5, "bits": 24, "rotation": True}


@pytest.fixture(scope="module")
def secure_round(tmp_path_factory):
    folder = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import secagg_clients
    import secagg_harness

    workflow = integer_secagg_parameters(_secagg_parameters(), PHASE_CONFIG["bits"]).workflow_kwargs()
    spec = {"num_supernodes": CLIENTS, "num_examples": [64] * CLIENTS, "shapes": [[16, 64], [64, 16], [300]],
            "seed": 11, "delta_scale": 0.05, "weight_scale": 0.0, "client_cpus": 1,
            "phases": [{"name": "client_level", "secagg": workflow, "format": "client_level", "dtype": "float64",
                        "client_level": PHASE_CONFIG, "rounds": 1, "capture": True}]}
    results = secagg_harness.run_flower(spec, timeout=300, workdir=tmp_path_factory.mktemp("ddp"))
    (phase,) = results["phases"]
    assert phase["aggregated_rounds"] == 1, f"{phase['failures']}\n{results['log'][-4000:]}"
    return secagg_clients, spec, phase


@pytest.mark.slow
def test_the_secure_sum_is_the_sum_of_the_clients_noisy_integers_exactly(secure_round):
    clients, spec, phase = secure_round
    dim = sum(math.prod(s) for s in spec["shapes"])
    plan = ddp.plan_round(ClientLevelConfig(**PHASE_CONFIG), dim, CLIENTS, min_survivors=2)
    sent = [clients.client_level_output(spec, PHASE_CONFIG, pid, 1, CLIENTS, 2)[0] for pid in range(CLIENTS)]
    expected = np.mod(sum((s + plan.modulus // 2).astype(np.int64) for s in sent), plan.modulus)
    expected = np.where(expected >= plan.modulus // 2, expected - plan.modulus, expected)
    received = [arrays for _, _, arrays in phase["received"]]
    assert all(num_examples == 1 for num_examples, _, _ in phase["received"])
    np.testing.assert_array_equal(ddp.secure_integer_sum(received[0], CLIENTS, plan), expected)
    assert all(np.array_equal(r[0], received[0][0]) for r in received)  # one aggregate, nothing per client


@pytest.mark.slow
def test_the_server_applies_the_noisy_mean_and_accounts_it(secure_round):
    clients, spec, phase = secure_round
    clean = np.mean([ddp.clip_l2(np.concatenate([a.astype(np.float64).ravel() for a in clients.fixed_update(spec, p)]),
                                 PHASE_CONFIG["clip_norm"]) for p in range(CLIENTS)], axis=0)
    applied = np.concatenate([w.ravel() for w in phase["weights"]])  # from zeros: the applied mean update
    error = applied - clean
    # noise of the mean: z * C * sqrt(survivors / fewest survivors, 2 of 3) / survivors per coordinate (rounding 1e-6)
    expected_std = PHASE_CONFIG["noise_multiplier"] * PHASE_CONFIG["clip_norm"] * math.sqrt(CLIENTS / 2) / CLIENTS
    assert np.std(error) == pytest.approx(expected_std, rel=0.1)
    assert abs(np.mean(error)) < 5 * expected_std / math.sqrt(error.size)
    account = ddp.ClientLevelAccount.from_json(phase["client_level_account"])
    assert phase["fit_metrics"]["epsilon_client_level"] == pytest.approx(account.epsilon(1e-5))
    assert account.history[0][3] == 1.0  # every available client was sampled


# ----------------------------------------------------------------------------- with the RL engine
def test_verl_clients_send_noisy_integers_and_the_server_reports_client_level_epsilon(tiny_config):
    """Three ``VerlClient``s in this process under client-level DP: each hands SecAgg+ one vector
    of integers of the modular range with weight 1 (its data size stays private), and the round's
    metrics and log carry the client-level epsilon beside the per-prompt one."""
    from flwr.common import parameters_to_ndarrays

    from flwr_verl.config import FederationConfig, SecAggConfig
    from flwr_verl.engine.data import load_rows
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "deterministic": True,
                                  "client_level.enabled": True, "client_level.clip_norm": 0.05,
                                  "client_level.noise_multiplier": 0.8},
                         trainer={"local_iterations": 1})
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", 0, i, 3), [], partition_id=i)
               for i in range(3)}
    initial = clients["0"].adapters.get_arrays()
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=3, secagg=SecAggConfig()), initial,
                               local_iterations=1, secure_aggregation=SecAggBounds(1.0, 64.0),
                               client_level=config.privacy.client_level)
    results, metrics = fit_round(strategy, InProcessClients(clients), 1, secure=True)
    modulus = 2**config.privacy.client_level.bits
    dim = sum(a.size for a in initial)
    for _, res in results:
        (sent,) = parameters_to_ndarrays(res.parameters)
        assert res.num_examples == 1
        assert sent.size == 1 << (dim - 1).bit_length()
        assert (sent == np.round(sent)).all() and sent.min() >= -modulus // 2 and sent.max() < modulus // 2
    assert 0 < metrics["epsilon_client_level"] < math.inf and metrics["epsilon_run"] > 0
    moved = np.concatenate([(a - b).ravel() for a, b in zip(strategy.global_arrays, initial)])
    assert np.linalg.norm(moved) > 0
    assert strategy.state_dict()["client_level_account"] == strategy.client_level_account.to_json()
    # Each node's ledger holds the round as privacy unit "client" (at q = 1, as here every client
    # was sampled: the same figure as the server's), beside its per-prompt spend on the same data.
    for client in clients.values():
        key = dataclasses.replace(client.data_set, unit=ddp.PRIVACY_UNIT)
        assert client.ledger.account(key).epsilon(1e-5) == pytest.approx(metrics["epsilon_client_level"])
        assert client.ledger.account(client.data_set).steps == 1
    # A node whose client-epsilon-budget one more round would pass leaves round 2 before training.
    from flwr_verl.federation.client import PrivacyBudgetExhausted
    from flwr_verl.federation.protocol import ClientLevelRound, FitConfig

    spent = metrics["epsilon_client_level"]
    refusing = clients["0"]
    refusing.client_epsilon_budget = spent * 1.01
    second = FitConfig(server_round=2, local_iterations=1, planned_iterations=2, proximal_mu=0.0,
                       secagg=SecAggBounds(1.0, 64.0), client_level=ClientLevelRound(num_clients=3, min_survivors=2))
    with pytest.raises(PrivacyBudgetExhausted, match=r"client-level epsilon from .* node config "
                                                     r"client-epsilon-budget="):
        refusing.fit(initial, second.to_config())
    key = dataclasses.replace(refusing.data_set, unit=ddp.PRIVACY_UNIT)
    assert refusing.ledger.account(key).rounds == 1 and refusing.ledger.account(refusing.data_set).steps == 1
