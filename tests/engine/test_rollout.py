"""The batch ``rollout.generate`` packs, checked on scripted generations with known EOS positions.

The masks and position ids come from verl (``get_response_mask``, ``compute_position_id_with_mask``);
these tests pin the layout that the trainer relies on, whoever computes it.
"""

from __future__ import annotations

import pytest
import torch

from flwr_verl.config import RolloutConfig
from flwr_verl.embedded import arithmetic_rows
from flwr_verl.engine.models import load_tokenizer
from flwr_verl.engine.rollout import generate


class ScriptedModel(torch.nn.Module):
    """``generate`` returns the prompt followed by fixed response tokens (one row per prompt)."""

    def __init__(self, responses: torch.Tensor) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate() reads the device from a parameter
        self.responses = responses

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        assert self.responses.shape == (input_ids.shape[0], self.responses.shape[1]) and (
            self.responses.shape[1] <= max_new_tokens)
        return torch.cat([input_ids, self.responses], dim=1)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


def rollout(tokenizer, scripted: torch.Tensor, response_length: int):
    """Prompts of different lengths, so that left padding is exercised."""
    texts = ["1+2=", "12+3=", "12+34=", "3+45="][: scripted.shape[0]]
    rows = [{**row, "prompt": [{"role": "user", "content": text}]}
            for row, text in zip(arithmetic_rows(len(texts), seed=0), texts)]
    config = RolloutConfig(n=1, response_length=response_length)
    return generate(ScriptedModel(scripted), tokenizer, rows, config, max_prompt_length=64).batch


def test_masks_keep_tokens_up_to_the_first_eos_and_pad_the_rest(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    a, b = 5, 6  # two ordinary token ids
    assert len({eos, pad, a, b}) == 4
    scripted = torch.tensor([
        [a, b, eos, a, eos],  # EOS at 2, then more tokens and a second EOS
        [eos, a, a, a, a],    # EOS first
    ])
    batch = rollout(tokenizer, scripted, response_length=7)  # every row ended early: 2 columns of padding
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    assert batch["responses"].tolist() == [[a, b, eos, pad, pad, pad, pad], [eos, pad, pad, pad, pad, pad, pad]]

    no_eos = rollout(tokenizer, torch.tensor([[a, a, a, a], [a, eos, b, b]]), response_length=4)
    assert no_eos["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]  # no EOS: every token counts


def test_attention_mask_and_positions_follow_prompt_and_response(tokenizer):
    eos = tokenizer.eos_token_id
    batch = rollout(tokenizer, torch.tensor([[5, eos, 5], [5, 5, eos], [eos, 6, 6]]), response_length=3)
    assert torch.equal(batch["attention_mask"][:, -3:], batch["response_mask"])
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    prompt_lengths = batch["attention_mask"][:, :-3].sum(1)
    assert (prompt_lengths > 0).all() and len(set(prompt_lengths.tolist())) > 1  # left padding is exercised
    for row, mask in zip(batch["position_ids"].tolist(), batch["attention_mask"].tolist()):
        first = mask.index(1)  # left padding sits at position 0; real tokens count from 0
        assert row[:first] == [0] * first
        assert [p for p, m in zip(row, mask) if m] == list(range(sum(mask)))


def test_n_responses_per_prompt_are_adjacent_and_share_a_uid(tokenizer):
    rows = arithmetic_rows(2, seed=1)
    scripted = torch.full((4, 3), 5)
    # the scripted model only generates: no shared prompt cache (a forward pass) to build
    batch = generate(ScriptedModel(scripted), tokenizer, rows, RolloutConfig(n=2, response_length=3),
                     max_prompt_length=64, uid_offset=10, shared_prompt_cache=False)
    assert batch.non_tensor_batch["uid"].tolist() == [10, 10, 11, 11]
    assert torch.equal(batch.batch["prompts"][0], batch.batch["prompts"][1])
    assert [r["ground_truth"] for r in batch.non_tensor_batch["reward_model"]] == [
        rows[0]["reward_model"]["ground_truth"]] * 2 + [rows[1]["reward_model"]["ground_truth"]] * 2
