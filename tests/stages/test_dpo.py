"""Stage ``dpo``: the losses against TRL's ``DPOTrainer``, the reference, DP independence, the
config's refusals, and held-out pairwise accuracy rising."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flwr_verl.config import DPO_LOSS_NAMES, ConfigError, DPOConfig, parse_run_config
from flwr_verl.engine.models import build_models
from flwr_verl.stages.dpo import DPO_LOSSES, LocalDPOTrainer, PairLogRatios, pair_examples, pair_loss
from flwr_verl.stages.preference import PreferenceUnit, load_units
from tests.unit_independence import assert_units_are_independent

DPO = {"stage": "dpo", "privacy.enabled": True, "privacy.noise_multiplier": 1.0, "privacy.deterministic": True,
       "data.train_size": 64, "data.val_size": 32, "data.train_batch_size": 16, "actor.ppo_mini_batch_size": 8}
# TRL's own venv (``../shared/peer``'s recipe; ``.ci/run`` builds it): TRL pins other versions
# than the project, so its side runs as a subprocess of that python.
TRL_PYTHON = Path(os.environ.get("FLWR_VERL_TRL_PYTHON",
                                 Path.home() / ".cache" / "flwr-verl" / "venv-trl" / "bin" / "python"))
TRL_SIDE = Path(__file__).resolve().parents[1] / "peer" / "trl_dpo_loss.py"


def dpo_config(**overrides):
    return parse_run_config({**DPO, **overrides}).engine


@pytest.fixture(scope="module")
def models():
    config = dpo_config()
    return build_models(config.model, with_critic=False, seed=config.trainer.seed)


# (loss, beta, label_smoothing, sft_weight)
LOSS_CASES = [("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.0, 0.0), ("ipo", 0.1, 0.0, 0.0), ("ipo", 1.0, 0.0, 0.0),
              ("robust", 0.1, 0.2, 0.0), ("robust", 0.3, 0.0, 0.0), ("sigmoid", 0.5, 0.0, 1.0),
              ("ipo", 0.1, 0.0, 0.3)]


def log_prob_case(loss_type: str, beta: float, label_smoothing: float, sft_weight: float) -> dict:
    """Per-token log-probs of 6 pairs whose responses differ in length (the completion masks
    differ, so IPO's length normalisation is exercised) and their reference sums. With an SFT
    term the chosen responses are equally long: TRL averages it over the batch's chosen tokens,
    ``chosen_nll`` over each pair's, and the two agree only then."""
    generator = torch.Generator().manual_seed(len(loss_type) + int(100 * beta))
    pairs, width = 6, 7
    mask = (torch.rand(2 * pairs, width, generator=generator) > 0.4).long()
    mask[:, 0] = 1
    if sft_weight:
        mask[:pairs] = 1
    per_token = -3 * torch.rand(2 * pairs, width, generator=generator, dtype=torch.float64) * mask
    ref_chosen, ref_rejected = (-10 * torch.rand(pairs, generator=generator, dtype=torch.float64) for _ in range(2))
    return {"loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing, "sft_weight": sft_weight,
            "per_token": per_token.tolist(),
            "mask": mask.tolist(), "ref_chosen": ref_chosen.tolist(), "ref_rejected": ref_rejected.tolist()}


@pytest.fixture(scope="module")
def trl_losses() -> list[float]:
    """TRL's loss of each of ``LOSS_CASES``, from one run of its venv's python."""
    if not TRL_PYTHON.exists():
        pytest.skip(f"no TRL venv at {TRL_PYTHON} (set FLWR_VERL_TRL_PYTHON; .ci/run builds it)")
    cases = [log_prob_case(*case) for case in LOSS_CASES]
    done = subprocess.run([str(TRL_PYTHON), str(TRL_SIDE)], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


# ----------------------------------------------------------------------------- losses
def test_the_registry_holds_exactly_the_losses_the_config_allows():
    assert tuple(DPO_LOSSES) == DPO_LOSS_NAMES


@pytest.mark.parametrize("case", range(len(LOSS_CASES)), ids=lambda i: "-".join(map(str, LOSS_CASES[i])))
def test_each_loss_equals_trls_dpo_trainer_on_the_same_log_probs(case, trl_losses):
    """TRL's mean over pairs against ours, on the same log-probs (with the SFT term, TRL's
    ``loss_type=[loss, "sft"]``)."""
    spec = log_prob_case(*LOSS_CASES[case])
    per_token, mask = torch.tensor(spec["per_token"], dtype=torch.float64), torch.tensor(spec["mask"])
    logps, tokens, pairs = per_token.sum(-1), mask.sum(-1).double(), len(spec["ref_chosen"])
    ratios = PairLogRatios(logps[:pairs] - torch.tensor(spec["ref_chosen"], dtype=torch.float64),
                           logps[pairs:] - torch.tensor(spec["ref_rejected"], dtype=torch.float64),
                           tokens[:pairs], tokens[pairs:], logps[:pairs])
    dpo = DPOConfig(beta=spec["beta"], loss=spec["loss_type"], label_smoothing=spec["label_smoothing"],
                    sft_weight=spec["sft_weight"])
    ours = pair_loss(ratios, dpo).mean().item()
    assert ours == pytest.approx(trl_losses[case], abs=1e-6, rel=1e-6)


def test_conservative_dpo_stops_at_the_margin_its_label_smoothing_believes():
    """cDPO (TRL 1.16 has no label-smoothed sigmoid loss to compare with): with labels flipped
    at rate eps, the loss is least at sigmoid(beta * margin) = 1 - eps, a finite margin, where
    plain DPO keeps pushing; at eps = 0 it is DPO's sigmoid loss."""
    beta, eps = 0.5, 0.1
    best = torch.logit(torch.tensor(1 - eps, dtype=torch.float64)) / beta
    margin = torch.tensor([best.item()], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(1, dtype=torch.float64)
    DPO_LOSSES["cdpo"](PairLogRatios(margin, zero, zero + 1, zero + 1, zero), beta, eps).sum().backward()
    assert abs(margin.grad.item()) < 1e-12
    plain = torch.tensor([best.item()], dtype=torch.float64, requires_grad=True)
    DPO_LOSSES["sigmoid"](PairLogRatios(plain, zero, zero + 1, zero + 1, zero), beta, 0.0).sum().backward()
    assert plain.grad.item() < -1e-3  # DPO would still widen the margin
    values = PairLogRatios(torch.tensor([0.3, -1.2]), torch.tensor([0.1, 0.4]), torch.ones(2), torch.ones(2),
                           torch.zeros(2))
    torch.testing.assert_close(DPO_LOSSES["cdpo"](values, 0.2, 0.0), DPO_LOSSES["sigmoid"](values, 0.2, 0.0))


@pytest.mark.parametrize("key, value, message", [
    ("dpo.loss", "kto", "allowed: sigmoid, ipo, cdpo, robust"),
    ("dpo.beta", 0.0, "must be a number > 0"),
    ("dpo.label_smoothing", 0.5, r"must be in \[0, 0.5\)"),
    ("dpo.sft_weight", -0.5, r"must be a number >= 0"),
])
def test_a_bad_dpo_setting_names_the_key_the_value_and_what_is_allowed(key, value, message):
    with pytest.raises(ConfigError, match=rf"{key}={value!r}.*{message}"):
        dpo_config(**{key: value})


def test_label_smoothing_is_refused_where_the_loss_would_ignore_it():
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.1 .*must be 0 with dpo.loss='sigmoid'.*cdpo, robust"):
        dpo_config(**{"dpo.label_smoothing": 0.1})
    assert dpo_config(**{"dpo.loss": "cdpo", "dpo.label_smoothing": 0.1}).dpo.label_smoothing == 0.1


def test_stage_dpo_learns_from_pairs_not_from_a_reward():
    with pytest.raises(ConfigError, match=r"reward_model.enable=True .*stage='dpo'"):
        dpo_config(**{"reward_model.enable": True, "reward_model.model.path": "/nowhere"})


# ----------------------------------------------------------------------------- the trainer
UNITS = [PreferenceUnit("t", [{"role": "user", "content": "12+7="}], [("19", "18")]),
         PreferenceUnit("t", [{"role": "user", "content": "3+40="}], [("43", "44"), ("43", "34")]),
         PreferenceUnit("t", [{"role": "user", "content": "9+9="}], [("18", "17"), ("18", "19"), ("18", "181")])]


def test_one_forward_pass_holds_every_chosen_then_every_rejected_response():
    examples, unit_of_row = pair_examples(UNITS)
    assert [response for _, response in examples] == ["19", "43", "43", "18", "18", "18",
                                                      "18", "44", "34", "17", "19", "181"]
    assert unit_of_row == [0, 1, 1, 2, 2, 2] * 2


def test_the_reference_is_the_policy_with_its_adapter_disabled(models):
    """Fresh LoRA (B = 0) is the base: every log-ratio is 0 and the sigmoid loss is log 2. After
    training the ratios move while the reference (the base) is unchanged."""
    config = dpo_config(**{"privacy.enabled": False, "data.train_batch_size": 3, "actor.ppo_mini_batch_size": 3})
    trainer = LocalDPOTrainer(config, UNITS, models=models)
    ratios, _ = trainer._ratios(UNITS)
    assert torch.equal(ratios.chosen, torch.zeros_like(ratios.chosen))
    assert trainer.unit_loss(UNITS).loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    initial = models.adapters.get_arrays()
    frozen = {n: p.detach().clone() for n, p in models.policy.named_parameters() if not p.requires_grad}
    try:
        trainer.fit(3, seed=0)
        after, _ = trainer._ratios(UNITS)
        assert after.chosen.abs().max() > 0
        assert all(torch.equal(p, frozen[n]) for n, p in models.policy.named_parameters() if n in frozen)
    finally:
        models.adapters.set_arrays(initial)


def test_each_units_reference_is_computed_once_and_matches_a_fresh_pass(models, monkeypatch):
    """The reference log-probabilities are kept per unit: a unit's log-ratios from the cache (in
    another batch, another order) equal those of a fresh reference pass, and a seen unit never
    runs the reference again."""
    from flwr_verl.stages import dpo as stage
    from flwr_verl.stages.sft import response_batch

    config = dpo_config(**{"privacy.enabled": False})
    initial = models.adapters.get_arrays()
    generator = torch.Generator().manual_seed(5)
    passes = []
    fresh_pass = stage.reference_log_probs
    monkeypatch.setattr(stage, "reference_log_probs", lambda model, batch: passes.append(1) or fresh_pass(model, batch))
    try:
        models.adapters.set_arrays([a + 0.05 * torch.randn(a.shape, generator=generator).numpy() for a in initial])
        trainer = LocalDPOTrainer(config, UNITS, models=models)
        trainer._ratios(UNITS[:2])
        assert len(passes) == 1
        cached, _ = trainer._ratios([UNITS[2], UNITS[0], UNITS[1]])
        assert len(passes) == 2  # only UNITS[2] was new
        trainer._ratios(UNITS[::-1])
        assert len(passes) == 2
        examples, unit_of_row = pair_examples([UNITS[2], UNITS[0], UNITS[1]])
        batch = response_batch(examples, unit_of_row, 3, models.tokenizer, config.data.max_prompt_length, models.device)
        fresh = stage.pair_log_ratios(models.policy, batch)
        torch.testing.assert_close(cached.chosen, fresh.chosen, atol=1e-5, rtol=0)
        torch.testing.assert_close(cached.rejected, fresh.rejected, atol=1e-5, rtol=0)
    finally:
        models.adapters.set_arrays(initial)


@pytest.mark.parametrize("sft_weight", [0.0, 1.0], ids=["dpo", "with-sft-term"])
def test_dpo_per_unit_gradients_equal_each_unit_computed_alone(models, sft_weight):
    """Units with 1, 2 and 3 pairs in one forward pass, the adapter moved off zero first (at
    B = 0 the LoRA A factors get no gradient): each unit's pooled Opacus gradient is its loss's
    gradient computed alone, with or without the SFT term. The reference pass adds nothing (it
    runs without gradients)."""
    config = dpo_config(**{"dpo.sft_weight": sft_weight})
    initial = models.adapters.get_arrays()
    generator = torch.Generator().manual_seed(3)
    try:
        models.adapters.set_arrays([a + 0.05 * torch.randn(a.shape, generator=generator).numpy() for a in initial])
        assert_units_are_independent(LocalDPOTrainer(config, UNITS, models=models), UNITS)
    finally:
        models.adapters.set_arrays(initial)


def test_a_short_private_dpo_run_ranks_held_out_pairs_right():
    """DP-DPO (sigma 1.0) on one client's 1024 embedded prompts (5 near misses each), 30
    iterations of 64, then held-out pairs of 128 validation prompts. The fresh adapter is the
    reference, so its implicit reward ties every pair (margin 0, accuracy 0.5: a tie counts half);
    the embedded model's own likelihood already prefers the right sum, and DPO turns that into a
    margin. beta 1.0 and
    lr 6e-3 were chosen on the tune split (0.75 there after 30 iterations; beta 0.1: 0.61)."""
    config = dpo_config(**{"data.train_size": 1024, "data.val_size": 128, "data.train_batch_size": 64,
                           "actor.ppo_mini_batch_size": 64, "actor.lr": 6e-3, "dpo.beta": 1.0})
    trainer = LocalDPOTrainer(config, load_units(config.data, "train", 0))
    held_out = load_units(config.data, "val", 0)
    before = trainer.evaluate(held_out)
    result = trainer.fit(30, seed=0)
    after = trainer.evaluate(held_out)
    assert result.mechanism is not None and result.mechanism.noise_multiplier == 1.0
    assert before.accuracy == 0.5 and before.reward == pytest.approx(0.5)
    assert after.accuracy >= 0.65 and after.reward > 0.5, (before, after)
