"""The one-run privacy audit (Steinke, Nasr & Jagielski 2023): its statistics and its bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from flwr_verl.config import ConfigError
from flwr_verl.privacy.audit import (
    AuditConfig,
    GradientCanaries,
    WithGradientCanaries,
    epsilon_lower_bound,
    fewest_canaries,
    guess,
    make_canaries,
    make_canary_prompts,
    p_value,
    score_canaries,
    with_canary_reward,
)


def test_all_correct_guesses_give_the_closed_form_bound():
    """Pure DP, all r guesses right: P = q^r with q = e^eps/(1+e^eps), so eps = logit(0.05^(1/r))."""
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    assert epsilon_lower_bound(10, 10, 10) == pytest.approx(1.0519, abs=1e-4)


def test_pure_dp_p_value_is_the_binomial_tail():
    assert p_value(1000, 100, 70, 1.0) == pytest.approx(scipy.stats.binom.sf(69, 100, 1 / (1 + math.exp(-1))))


def test_delta_adds_the_papers_term():
    """Approximate DP: P <= tail + 2 m delta max_i P[v-i <= Bin(r,q) < v] / i."""
    m, r, v, eps, delta = 1000, 100, 80, 1.0, 1e-3
    q = 1 / (1 + math.exp(-eps))
    alpha = max(sum(scipy.stats.binom.pmf(v - j, r, q) for j in range(1, i + 1)) / i for i in range(1, v + 1))
    expected = scipy.stats.binom.sf(v - 1, r, q) + 2 * m * delta * alpha
    assert p_value(m, r, v, eps, delta) == pytest.approx(expected)
    assert epsilon_lower_bound(m, r, v, delta) < epsilon_lower_bound(m, r, v)


def test_bound_is_valid_and_tight_on_randomized_response():
    """Guesses as accurate as eps-DP randomized response allows: the 95% bound exceeds eps in at
    most about 5% of trials, and is close to eps with many guesses."""
    rng = np.random.default_rng(0)
    eps, r = 2.0, 1000
    q = 1 / (1 + math.exp(-eps))
    bounds = [epsilon_lower_bound(r, r, int(rng.binomial(r, q))) for _ in range(200)]
    assert np.mean(np.array(bounds) > eps) <= 0.08
    assert np.median(bounds) > 1.6


def test_chance_level_guesses_bound_nothing():
    assert epsilon_lower_bound(100, 100, 50) == 0.0
    assert epsilon_lower_bound(4, 4, 4) == 0.0  # 2^-4 > 0.05: four canaries can never bound anything


def test_guess_counts_top_as_members_and_bottom_as_non_members():
    included = np.array([True, False, True, False, True, False])
    scores = np.array([5.0, -3.0, 4.0, -2.0, 0.1, 0.0])
    assert guess(scores, included, 4) == 4
    assert guess(-scores, included, 4) == 0


def _canaries(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    initial = np.log(rng.dirichlet(np.ones(10), size=count))
    return make_canaries(make_canary_prompts(count, rng), initial, rng), initial


def test_a_canarys_secret_is_a_coin_between_the_initial_policys_two_likeliest_answers():
    canaries, initial = _canaries(400)
    top_two = np.argsort(-initial, axis=1)[:, :2]
    secrets = [(int(c["reward_model"]["ground_truth"]), int(c["extra_info"]["alternative"])) for c in canaries]
    assert all({s, a} == set(pair) for (s, a), pair in zip(secrets, top_two))
    assert 0.4 < np.mean([s == pair[0] for (s, _), pair in zip(secrets, top_two)]) < 0.6


def test_a_change_that_ignores_the_secret_scores_zero_on_average():
    """Training that moves the two likeliest answers the same way on every prompt (here it
    sharpens them: top one up, second down) gives the non-members scores of either sign, in
    equal measure: the coin decided which of the two is the secret."""
    canaries, initial = _canaries(2000, seed=3)
    after = initial.copy()
    rows = np.arange(len(canaries))
    top_two = np.argsort(-initial, axis=1)[:, :2]
    after[rows, top_two[:, 0]] += 2.0
    after[rows, top_two[:, 1]] -= 2.0
    scores = score_canaries(initial, after, canaries)
    assert set(np.round(np.abs(scores), 6)) == {4.0}
    assert abs(np.mean(scores)) < 0.3
    secret = int(canaries[5]["reward_model"]["ground_truth"])
    after[5, secret] += 3.0  # canary 5's own secret on its own prompt
    assert np.argmax(score_canaries(initial, after, canaries)) == 5


def test_canaries_are_unique_and_scored_by_their_secret():
    canaries, _ = _canaries(50)
    assert len({c["prompt"][0]["content"] for c in canaries}) == 50
    score = with_canary_reward(lambda *args: -1.0)
    canary = canaries[0]
    secret = canary["reward_model"]["ground_truth"]
    assert score(canary["data_source"], secret + "7", secret) == 1.0
    assert score(canary["data_source"], canary["extra_info"]["alternative"], secret) == 0.0
    assert score("other", "x", "y") == -1.0  # other rows keep the task's reward


# ----------------------------------------------------------------------------- bad input
def test_too_few_canaries_to_bound_anything():
    assert fewest_canaries(0.95) == 5
    with pytest.raises(ConfigError, match=r"audit\.canaries=4 is invalid: must be >= 5 at confidence 0\.95"):
        AuditConfig(canaries=4, guesses=4)


@pytest.mark.parametrize("kwargs, key", [
    ({"guesses": 7}, r"audit\.guesses=7"),
    ({"canaries": 10, "guesses": 12}, r"audit\.guesses=12"),
    ({"confidence": 1.0}, r"audit\.confidence=1\.0"),
    ({"kind": "dirac"}, r"audit\.kind='dirac' is invalid: must be one of gradient, prompt"),
])
def test_bad_audit_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        AuditConfig(**kwargs)


def test_an_unknown_flaw_is_refused():
    from flwr_verl.tools.audit import broken_mechanism

    with pytest.raises(ValueError, match=r"flaw='unclipped': expected one of unclipped_noiseless, unpooled"):
        with broken_mechanism("unclipped"):
            pass


def test_the_command_refuses_bad_options_before_training(capsys, tmp_path):
    from flwr_verl.tools.audit import main

    out = tmp_path / "audit.jsonl"
    assert main(["--canaries", "4", "--guesses", "4", "--out", str(out)]) == 2
    assert "audit.canaries=4 is invalid" in capsys.readouterr().err
    assert main(["--clients", "2", "--canary-client", "2", "--out", str(out)]) == 2
    assert "audit.canary_client=2 is invalid: must be a partition in [0, 2)" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- gradient canaries
def test_gradient_canaries_score_the_descent_along_their_own_weight():
    canaries = GradientCanaries.draw(5, 100, 1.0, np.random.default_rng(0))
    assert len(set(canaries.coordinates)) == 5 and set(canaries.signs) <= {-1.0, 1.0}
    before = np.zeros(100)
    after = before.copy()
    after[canaries.coordinates[2]] -= 0.3 * canaries.signs[2]  # a descent step on canary 2's gradient
    after[canaries.coordinates[4]] += 0.3 * canaries.signs[4]  # an ascent on canary 4's
    assert np.allclose(canaries.scores(before, after), [0, 0, 0.3, 0, -0.3])
    with pytest.raises(ConfigError, match=r"audit\.canaries=101 is invalid: must be <= the 100 trainable weights"):
        GradientCanaries.draw(101, 100, 1.0, np.random.default_rng(0))


def test_a_sampled_gradient_canary_is_one_more_unit_of_the_plain_mean():
    """Without DP, a member canary sampled into a mini-batch of U prompts joins the mean gradient
    as unit U+1; a non-member never touches the gradient."""
    import torch

    from flwr_verl.engine.proximal import Proximal
    from flwr_verl.engine.update import PlainUpdate

    weights = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    plain = PlainUpdate(torch.optim.SGD(weights, lr=1.0), weights, Proximal.none(), grad_clip=1e9,
                        num_mini_batches=1, rng=np.random.default_rng(0))
    canaries = GradientCanaries(coordinates=np.array([1, 4]), signs=np.array([1.0, -1.0]), norm=2.0)
    update = WithGradientCanaries(plain, canaries, members=np.array([1]), sample_rate=1.0, rows_per_unit=4,
                                  ppo_epochs=1, num_mini_batches=1, rng=np.random.default_rng(0))
    assert len(update.split(3)[0]) == 3
    for weight in weights:
        weight.grad = torch.ones_like(weight)  # the mean gradient of the 3 prompts
    update.step()
    # member 1 (flat index 4 = weights[1][0, 1], sign -1, norm 2): (3 * 1 - 2) / 4; SGD at lr 1 descends
    assert torch.equal(weights[0].detach(), torch.full((3,), -0.75))
    assert torch.equal(weights[1].detach(), torch.tensor([[-0.75, -0.25], [-0.75, -0.75]]))


# ----------------------------------------------------------------------------- power
# The small configuration on which the audit must show power (under a minute on one thread), the
# default of benchmarks/audit_power.py: two clients of 16 task prompts each, 2 rounds of 10
# iterations, 256 gradient canaries in client 0's update, 64 guesses (a bound of 3.04 at most).
POWER_ITERATIONS = 10
POWER = {
    "data": {"train_size": 16, "val_size": 8, "train_batch_size": 16},
    "rollout": {"n": 8, "response_length": 3},
    "actor": {"ppo_mini_batch_size": 16},
    "trainer": {"local_iterations": POWER_ITERATIONS},
}
POWER_AUDIT = AuditConfig(canaries=256, guesses=64)


def _power_audit(**privacy):
    import dataclasses

    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.tools.audit import run_audit

    engine = engine_config(privacy=privacy, **POWER)
    federation = dataclasses.replace(FederationConfig(), num_server_rounds=2)
    return run_audit(engine, federation, POWER_AUDIT, num_clients=2, log=lambda line: None)


@pytest.mark.audit
def test_without_dp_the_audit_bounds_epsilon_above_one():
    result = _power_audit(enabled=False)
    assert result.epsilon_lower_bound >= 1.0, result


@pytest.mark.audit
def test_a_mechanism_that_drops_clipping_and_noise_is_caught():
    """A test double of the DP update that clips at 1e6 and adds no noise, while the accountant
    still records the configured noise multiplier: the audit's bound exceeds the claimed epsilon."""
    from flwr_verl.tools.audit import broken_mechanism

    with broken_mechanism():
        result = _power_audit(enabled=True, target_epsilon=0.5, deterministic=True)
    assert result.epsilon_claimed <= 0.5 + 1e-3
    assert result.epsilon_lower_bound > result.epsilon_claimed, result


@pytest.mark.audit
def test_with_dp_at_epsilon_one_the_bound_stays_below_the_claim():
    """A claim the audit can refute: 64 guesses bound epsilon at 3.04 at most, so at a claim of 8
    this check could not fail; at 1 it fails if the mechanism leaks more than it claims."""
    result = _power_audit(enabled=True, target_epsilon=1.0, deterministic=True)
    assert result.epsilon_claimed <= 1.0 + 1e-3
    assert result.epsilon_lower_bound <= result.epsilon_claimed, result
