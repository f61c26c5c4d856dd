"""Only the needed work: the engine imports without Opacus and verl's Ray driver; the
no-grad log-prob passes run only when something reads them, and the on-policy update's own
log-probs equal the recomputed ones exactly; rewards decoded in one batch score as verl's
row-by-row reward manager; the restated ray_trainer functions give verl's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_verl.config import ADV_ESTIMATORS
from flwr_verl.embedded import compute_score
from flwr_verl.engine._verl import AlgoConfig, DataProto, KLControlConfig, core_algos, verl_F
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.forward import response_logits
from flwr_verl.engine.rewards import make_reward_manager
from flwr_verl.engine.trainer import LocalPPOTrainer

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("opacus", "pandas", "datasets", "fastapi", "uvicorn", "torchdata", "pydantic", "aiohttp",
         "verl.trainer.ppo.ray_trainer", "verl.workers.reward_manager")


def test_engine_imports_neither_opacus_nor_verls_driver():
    probe = ("import json, sys\nimport flwr_verl.federation.client, flwr_verl.engine.trainer\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- log-prob passes
def forward_lengths(trainer: LocalPPOTrainer) -> list[int]:
    """The sequence lengths of the base model's forward passes: generation's pass over the
    prompts but their last token (the shared prompt cache), its one-token steps, then the policy
    passes, each a pass over the prompts and one over the responses on their cache
    (``forward.response_logits``)."""
    lengths: list[int] = []
    trainer.policy.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    return lengths


ON_POLICY = {"actor": {"ppo_mini_batch_size": 8}}  # one mini-batch of the 8 prompts


@pytest.mark.parametrize("overrides, expected, kl", [
    (ON_POLICY, 1, False),  # the update only
    ({**ON_POLICY, "actor": {"ppo_mini_batch_size": 8, "use_kl_loss": True}}, 2, True),  # + reference
    ({**ON_POLICY, "algorithm": {"use_kl_in_reward": True}}, 3, True),  # + old (read by the penalty) + reference
    ({}, 3, False),  # two mini-batches: old + two updates
    ({"actor": {"ppo_mini_batch_size": 8, "ppo_epochs": 2}}, 3, False),  # two epochs: old + two updates
    ({**ON_POLICY, "model": {"lora_dropout": 0.1}}, 2, False),  # dropout: old + update
], ids=["on-policy", "kl-loss", "kl-in-reward", "mini-batches", "epochs", "dropout"])
def test_log_prob_passes_run_only_when_read(tiny_config, overrides, expected, kl):
    config = tiny_config(**overrides)
    trainer = LocalPPOTrainer(config, load_rows(config.data, "train", seed=0))
    lengths = forward_lengths(trainer)
    (metrics,) = trainer.fit(1).metrics
    prompt_length, response_length = lengths[0] + 1, config.rollout.response_length
    assert lengths.count(prompt_length + response_length) == 0, lengths  # no pass computes a row whole
    policy_passes = sum(pair == (prompt_length, response_length) for pair in zip(lengths, lengths[1:]))
    assert policy_passes == expected, lengths
    assert ("kl" in metrics) == kl, metrics


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"temperature": 1.3, "top_k": 5},
                                      {"temperature": 0.8, "top_p": 0.7}], ids=["temperature", "top-k", "top-p"])
def test_on_policy_old_log_probs_equal_recomputed_ones_exactly(tiny_config, monkeypatch, sampling):
    """The update reuses its own log-probs as the old ones: they are bit-identical to a separate
    no-grad pass at the rollout weights."""
    import flwr_verl.engine.trainer as trainer_module

    config = tiny_config(rollout=sampling, **ON_POLICY)
    trainer = LocalPPOTrainer(config, load_rows(config.data, "train", seed=0))
    assert not trainer.log_prob_passes.old  # the reuse is what is tested
    rollout_weights = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    rollouts, used = [], {}
    generate = trainer_module.generate
    monkeypatch.setattr(trainer_module, "generate", lambda *a, **k: rollouts.append(generate(*a, **k)) or rollouts[-1])
    policy_loss = trainer.policy_loss_fn
    trainer.policy_loss_fn = lambda **kwargs: used.update(kwargs) or policy_loss(**kwargs)
    trainer.fit(1)

    trainer.policy.load_state_dict(rollout_weights, strict=False)
    batch = rollouts[0].batch
    trainer.policy.eval()
    with torch.no_grad():
        logits = response_logits(trainer.policy, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                 batch["responses"].shape[1], config.rollout.n)
    logits = logits / config.rollout.temperature
    recomputed = verl_F.logprobs_from_logits(logits, batch["responses"])  # what the old-log-prob pass computes
    assert torch.equal(used["old_log_prob"], recomputed)
    assert not used["old_log_prob"].requires_grad


# ----------------------------------------------------------------------------- rewards
def test_batched_decoding_scores_as_verls_row_by_row_manager(tiny_config):
    from verl.workers.reward_manager import NaiveRewardManager

    config = tiny_config(rollout={"n": 4, "response_length": 8})
    trainer = LocalPPOTrainer(config, load_rows(config.data, "train", seed=0))
    torch.manual_seed(0)
    batch = trainer_rollout(trainer)
    manager = make_reward_manager(trainer.tokenizer, compute_score)
    reference = NaiveRewardManager(trainer.tokenizer, num_examine=0, compute_score=manager.compute_score)
    ours, verls = manager(batch, return_dict=True), reference(batch, return_dict=True)
    assert torch.equal(ours["reward_tensor"], verls["reward_tensor"])
    assert ours["reward_tensor"].sum() > 0, "degenerate batch: no response scored"
    assert dict(ours["reward_extra_info"]) == dict(verls["reward_extra_info"])


def trainer_rollout(trainer: LocalPPOTrainer) -> DataProto:
    from flwr_verl.engine.rollout import generate

    config = trainer.config
    return generate(trainer.policy, trainer.tokenizer, trainer.train_rows[:16], config.rollout,
                    config.data.max_prompt_length)


# ----------------------------------------------------------------------------- ray_trainer's functions
def random_batch(seed: int, rows: int = 8, length: int = 5, n: int = 4) -> DataProto:
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, length, generator=generator) > 0.2).long()
    mask[:, 0] = 1
    return DataProto.from_single_dict({
        "responses": torch.randint(0, 9, (rows, length), generator=generator),
        "attention_mask": torch.cat([torch.ones(rows, 3, dtype=torch.long), mask], 1),
        "response_mask": mask,
        "token_level_scores": torch.randn(rows, length, generator=generator) * mask,
        "old_log_probs": -torch.rand(rows, length, generator=generator),
        "ref_log_prob": -torch.rand(rows, length, generator=generator),
        "values": torch.randn(rows, length, generator=generator),
        "reward_baselines": torch.randn(rows, generator=generator),
        "uid": np.repeat(np.arange(rows // n), n).astype(object),
    })


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_restated_driver_functions_match_verls(estimator):
    from verl.trainer.ppo import ray_trainer

    config = AlgoConfig(adv_estimator=estimator, kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.1))
    results = []
    for module in (sys.modules["flwr_verl.engine._verl"], ray_trainer):
        batch = random_batch(seed=1)
        assert torch.equal(module.compute_response_mask(batch), batch.batch["response_mask"])
        controller = core_algos.get_kl_controller(config.kl_ctrl)
        batch, metrics = module.apply_kl_penalty(batch, controller, "low_var_kl")
        batch = module.compute_advantage(batch, estimator, gamma=0.9, lam=0.8, num_repeat=4, config=config)
        results.append((batch.batch, metrics, controller.value))
    ours, verls = results
    for key in ("token_level_rewards", "advantages", "returns"):
        assert torch.equal(ours[0][key], verls[0][key]), key
    assert ours[1:] == verls[1:]
