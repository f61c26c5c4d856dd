"""The policy forward that computes each prompt once for its n responses (``flwr_verl/engine/forward.py``)."""

from __future__ import annotations

import pytest
import torch

from flwr_verl.config import engine_config
from flwr_verl.engine.data import task_rows
from flwr_verl.engine.forward import response_logits
from flwr_verl.engine.models import build_models
from flwr_verl.engine.rollout import generate

N = 4


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    built = build_models(engine_config().model, with_critic=False, seed=0)
    with torch.no_grad():  # adapters off their zero init, so that they take part in the forward
        for param in built.policy.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    return built


@pytest.fixture(scope="module")
def rows():
    """Prompts of different lengths, so that a batch of them is left-padded."""
    rows = task_rows("arithmetic", 64, seed=0, split="train")
    return sorted(rows, key=lambda row: len(row["prompt"][0]["content"]))[::16][:4]


@pytest.fixture(scope="module")
def policy_and_batch(models, rows):
    config = engine_config()
    batch = generate(models.policy, models.tokenizer, rows, config.rollout, config.data.max_prompt_length, n=N)
    assert (batch.batch["attention_mask"][:, 0] == 0).any(), "the batch should be left-padded"
    return models.policy, batch.batch


def full_logits(policy, batch) -> torch.Tensor:
    responses = batch["responses"].shape[1]
    logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"]).logits
    return logits[:, -responses - 1:-1]


def shared_logits(policy, batch, n: int = N) -> torch.Tensor:
    return response_logits(policy, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                           batch["responses"].shape[1], n)


def test_shared_prompt_logits_equal_the_full_forward(policy_and_batch):
    policy, batch = policy_and_batch
    policy.eval()
    with torch.no_grad():
        want, got = full_logits(policy, batch), shared_logits(policy, batch)
    assert got.shape == want.shape == (*batch["responses"].shape, want.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shared_prompt_gradients_equal_the_full_forward(policy_and_batch):
    policy, batch = policy_and_batch
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))

    def gradient(logits):
        log_probs = logits.log_softmax(-1).gather(-1, batch["responses"][..., None]).squeeze(-1)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad((log_probs * weights).sum(), params)])

    want, got = gradient(full_logits(policy, batch)), gradient(shared_logits(policy, batch))
    assert want.norm() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("case", ["shuffled rows", "n = 1"])
def test_rows_not_grouped_by_prompt_take_the_full_forward(policy_and_batch, case):
    policy, batch = policy_and_batch
    if case == "shuffled rows":
        order = torch.randperm(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(2))
        batch, n = {key: batch[key][order] for key in ("input_ids", "attention_mask", "position_ids", "responses")}, N
    else:
        n = 1
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(shared_logits(policy, batch, n), full_logits(policy, batch), rtol=0, atol=0)


def test_generation_on_the_shared_prompt_cache_samples_the_same_tokens(models, rows):
    """Left-padded prompts of different lengths, sampled at temperature 1: the same responses
    with each prompt computed once as with every repeated prompt computed whole."""
    config = engine_config()

    def responses(shared: bool) -> torch.Tensor:
        torch.manual_seed(5)
        return generate(models.policy, models.tokenizer, rows, config.rollout, config.data.max_prompt_length, n=N,
                        shared_prompt_cache=shared).batch["responses"]

    plain, shared = responses(False), responses(True)
    assert torch.equal(shared, plain)
    assert len({tuple(r.tolist()) for r in plain}) > len(rows), "degenerate check: every prompt's responses are equal"
