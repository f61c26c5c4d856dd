"""A learned reward model per client (``flwr_verl.engine.reward_model``): scores, combination, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from flwr_verl.config import ConfigError
from flwr_verl.embedded import arithmetic_rows, build_tokenizer
from flwr_verl.engine.reward_model import LearnedReward, load_reward_model, rank_in_group
from flwr_verl.engine.rollout import generate
from flwr_verl.federation.protocol import FitConfig, FitReport
from tests.reward_models import other_tokenizer, save_classifier

ROWS = arithmetic_rows(4, seed=3)


@pytest.fixture(scope="module")
def policy(tiny_config):
    from flwr_verl.engine.models import build_models

    config = tiny_config()
    return config, build_models(config.model, with_critic=False)


def _rollout(config, models):
    torch.manual_seed(0)
    return generate(models.policy, models.tokenizer, ROWS, config.rollout, config.data.max_prompt_length)


@pytest.mark.parametrize("which", ["same", "other"])
def test_scores_equal_a_direct_forward_at_the_last_token(policy, reward_model_dirs, which):
    """Each response's score is what a plain AutoModelForSequenceClassification forward of its
    unpadded prompt + response gives, on the last response token; with the ``other`` reward
    model the response is re-encoded by a different tokenizer, through its chat template."""
    config, models = policy
    directory = reward_model_dirs[which]
    batch = _rollout(config, models)
    scores = LearnedReward(load_reward_model(str(directory), models.device), models.tokenizer,
                           dataclasses.replace(config.reward_model, micro_batch_size=3))(batch)

    reference = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    mask = batch.batch["response_mask"]
    assert mask.sum(-1).min() < mask.shape[1]  # some responses end early: the last-token position varies
    for i, row in enumerate(r for r in ROWS for _ in range(config.rollout.n)):  # n adjacent rows per prompt
        length = int(mask[i].sum())
        response = models.tokenizer.decode(batch.batch["responses"][i, :length], skip_special_tokens=True)
        messages = row["prompt"] + [{"role": "assistant", "content": response}]
        text = (tokenizer.apply_chat_template(messages, tokenize=False) if which == "other"
                else "<s>" + row["prompt"][0]["content"] + response + "</s>")
        with torch.no_grad():
            expected = reference(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
        assert scores[i, length - 1].item() == pytest.approx(expected.item(), abs=1e-5)
        assert torch.count_nonzero(scores[i]) <= 1  # nothing anywhere else


def test_add_combines_the_rule_reward_with_its_weight(policy, reward_model_dirs):
    from flwr_verl.embedded import compute_score
    from flwr_verl.engine.rewards import make_reward_manager

    config, models = policy
    batch = _rollout(config, models)
    rule = make_reward_manager(models.tokenizer, compute_score)
    model = load_reward_model(str(reward_model_dirs["same"]), models.device)
    replace = LearnedReward(model, models.tokenizer, config.reward_model)(batch)
    added = LearnedReward(model, models.tokenizer,
                          dataclasses.replace(config.reward_model, combine="add", rule_weight=0.5), rule=rule)(batch)
    torch.testing.assert_close(added, replace + 0.5 * rule(batch))


def test_a_client_trains_against_its_node_reward_model_under_dp(tiny_config, reward_model_dirs):
    """The node's ``reward-model-path`` overrides the run config's path; fit runs under DP and
    reports the reward model's time (training metrics sent in the clear, for the test)."""
    from flwr_verl.federation.client import VerlClient, with_node_reward_model

    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "metrics": "clear"},
                         reward_model={"enable": True},
                         trainer={"local_iterations": 1})
    config, key = with_node_reward_model(config, str(reward_model_dirs["other"]))
    assert (config.reward_model.model.path, key) == (str(reward_model_dirs["other"]), "node config reward-model-path")
    client = VerlClient(config, arithmetic_rows(32, seed=1), [], reward_model_key=key)
    instructions = FitConfig(server_round=1, local_iterations=1, planned_iterations=1, proximal_mu=0.0)
    update, _, metrics = client.fit(client.get_parameters({}), instructions.to_config())
    report = FitReport.from_metrics(metrics)
    assert any(abs(a).max() > 0 for a in update)
    assert report.training.time_reward > 0 and report.privacy.epsilon_run > 0


# ----------------------------------------------------------------------------- bad input
def test_enabled_without_a_path_names_the_keys(tiny_config):
    from flwr_verl.federation.client import VerlClient

    with pytest.raises(ConfigError, match=r"reward_model.model.path.*reward-model-path"):
        VerlClient(tiny_config(reward_model={"enable": True}), arithmetic_rows(32, seed=1), [])


def test_a_missing_directory_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"node config reward-model-path=.*existing local reward-model directory"):
        load_reward_model(str(tmp_path / "nope"), torch.device("cpu"), key="node config reward-model-path")


def test_a_causal_lm_is_not_a_reward_model(model_path):
    with pytest.raises(ConfigError, match=r"reward_model.model.path=.*not a reward model.*LlamaForCausalLM"):
        load_reward_model(str(model_path), torch.device("cpu"))


def test_a_two_label_classifier_is_not_a_reward_model(tmp_path):
    directory = save_classifier(tmp_path / "two", build_tokenizer(), num_labels=2)
    with pytest.raises(ConfigError, match=r"not a reward model.*num_labels=2"):
        load_reward_model(str(directory), torch.device("cpu"))


def test_a_tokenizer_without_pad_or_eos_is_refused(tmp_path):
    directory = save_classifier(tmp_path / "nopad", other_tokenizer(), arch="gpt2")
    other_tokenizer(special_tokens=False).save_pretrained(directory)  # replaced by one with no special tokens
    with pytest.raises(ConfigError, match=r"no pad token and no EOS"):
        load_reward_model(str(directory), torch.device("cpu"))


def test_a_reward_model_too_short_for_prompt_plus_response_is_refused(tmp_path, tiny_config):
    from flwr_verl.federation.client import VerlClient

    directory = save_classifier(tmp_path / "short", build_tokenizer(), max_positions=8)
    config = tiny_config(reward_model={"enable": True, "model.path": str(directory)})
    with pytest.raises(ConfigError, match=r"holds 8 positions.*rollout.response_length=6"):
        VerlClient(config, arithmetic_rows(32, seed=1), [])


def test_bad_combine_and_micro_batch_are_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="reward_model.combine='mean'.*replace, add"):
        tiny_config(reward_model={"combine": "mean"})
    with pytest.raises(ConfigError, match="reward_model.micro_batch_size=0"):
        tiny_config(reward_model={"micro_batch_size": 0})


# ----------------------------------------------------------------------------- a DPO policy as the verifier
def _prefer_first_response(config, batch, directory):
    """A stand-in for a stage-dpo adapter that prefers the rollout's first response: the policy's
    adapter after 30 Adam steps up log pi(response 0 | prompt 0), saved as a run saves its
    ``adapters/final/policy``."""
    from flwr_verl.engine._verl import verl_F
    from flwr_verl.engine.models import build_models

    models = build_models(config.model, with_critic=False)
    rows = slice(0, 1)
    tensors = batch.batch
    params = [p for p in models.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    response = tensors["responses"][rows]
    for _ in range(30):
        logits = models.policy(input_ids=tensors["input_ids"][rows], attention_mask=tensors["attention_mask"][rows],
                               position_ids=tensors["position_ids"][rows]).logits[:, -response.shape[1] - 1:-1]
        loss = -(verl_F.logprobs_from_logits(logits, response) * tensors["response_mask"][rows]).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    models.adapters.save(directory)
    return directory / "policy"


def _response_log_prob(model, batch, row: int) -> float:
    """log pi(response | prompt) of one rollout row, from a plain forward of its unpadded tokens."""
    from flwr_verl.engine._verl import verl_F

    tensors = batch.batch
    prompt_length = tensors["input_ids"].shape[1] - tensors["responses"].shape[1]
    prompt = tensors["input_ids"][row, :prompt_length][tensors["attention_mask"][row, :prompt_length].bool()]
    length = int(tensors["response_mask"][row].sum())
    response = tensors["responses"][row, :length]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1:-1]
    return verl_F.logprobs_from_logits(logits[None], response[None]).sum().item()


@pytest.fixture(scope="module")
def verifier(policy, tmp_path_factory):
    from flwr_verl.engine.reward_model import load_dpo_verifier

    config, models = policy
    batch = _rollout(config, models)
    directory = _prefer_first_response(config, batch, tmp_path_factory.mktemp("dpo"))
    return batch, load_dpo_verifier(str(directory), config.model, models.device)


@pytest.mark.parametrize("score,normalize", [("implicit", False), ("likelihood", False), ("implicit", True)])
def test_the_dpo_verifier_scores_its_implicit_reward_or_its_likelihood_on_the_last_token(policy, verifier, score,
                                                                                         normalize):
    """``implicit``: beta (log pi_dpo - log pi_ref), the reference being the adapter disabled;
    ``likelihood``: log pi_dpo; either per response token with ``length_normalize``. The batched
    scores (each prompt computed once for its responses, in micro-batches of whole groups) equal
    a plain forward of each unpadded row, on the row's last response token."""
    config, models = policy
    batch, model = verifier
    reward = dataclasses.replace(config.reward_model, enable=True, kind="implicit", score=score, beta=0.5,
                                 length_normalize=normalize, micro_batch_size=3)
    scores = LearnedReward(model, models.tokenizer, reward, group=config.rollout.n)(batch)
    mask = batch.batch["response_mask"]
    for row in range(len(mask)):
        length = int(mask[row].sum())
        dpo = _response_log_prob(model.model, batch, row)
        with model.model.disable_adapter():
            reference = _response_log_prob(model.model, batch, row)
        expected = 0.5 * (dpo - reference) if score == "implicit" else dpo
        expected = expected / length if normalize else expected
        assert scores[row, length - 1].item() == pytest.approx(expected, abs=1e-4)
        assert torch.count_nonzero(scores[row]) <= 1


def test_group_rank_orders_each_prompts_responses_from_0_to_1_with_ties_sharing_their_mean_rank():
    scores = torch.tensor([-30.0, -2.0, -3.0, -2.5, 1.0, 1.0, 0.5, 7.0, 2.0, 2.0, 9.0])
    uid = np.array([0, 0, 0, 0, 1, 1, 2, 3, 3, 3, 3], dtype=object)
    ranks = rank_in_group(scores, uid)
    # an outlier (-30) is only the lowest rank: the other three keep their order evenly spaced
    torch.testing.assert_close(ranks[:4], torch.tensor([0.0, 1.0, 1 / 3, 2 / 3]))
    torch.testing.assert_close(ranks[4:7], torch.tensor([0.5, 0.5, 0.5]))  # a tie, and a group of one
    torch.testing.assert_close(ranks[7:], torch.tensor([2 / 3, 1 / 6, 1 / 6, 1.0]))


def test_group_rank_scores_each_verifier_response_by_its_rank_among_its_prompts_responses(policy, verifier):
    config, models = policy
    batch, model = verifier
    reward = dataclasses.replace(config.reward_model, enable=True, kind="implicit", score="likelihood")
    lengths = batch.batch["response_mask"].sum(-1).long()
    rows = torch.arange(len(lengths))
    raw = LearnedReward(model, models.tokenizer, reward, group=config.rollout.n)(batch)[rows, lengths - 1]
    ranked = LearnedReward(model, models.tokenizer, dataclasses.replace(reward, group_rank=True),
                           group=config.rollout.n)(batch)
    torch.testing.assert_close(ranked[rows, lengths - 1], rank_in_group(raw, batch.non_tensor_batch["uid"]))
    assert len(set(batch.non_tensor_batch["uid"])) == len(ROWS) and ranked[rows, lengths - 1].max() == 1.0


def test_the_implicit_reward_is_positive_for_what_the_dpo_adapter_learned_to_prefer_and_scales_with_beta(
        policy, verifier):
    config, models = policy
    batch, model = verifier
    lengths = batch.batch["response_mask"].sum(-1).long()

    def implicit(beta: float) -> torch.Tensor:
        reward = dataclasses.replace(config.reward_model, enable=True, kind="implicit", score="implicit", beta=beta)
        token_level = LearnedReward(model, models.tokenizer, reward, group=config.rollout.n)(batch)
        return token_level[torch.arange(len(lengths)), lengths - 1]

    once, twice = implicit(0.1), implicit(0.2)
    assert once[0] > 0 and once[0] > once[1:].max()  # the preferred response, above every other
    torch.testing.assert_close(twice, 2 * once)


def test_a_client_trains_against_a_dpo_verifier_under_dp(tiny_config, verifier):
    from flwr_verl.federation.client import VerlClient

    _, model = verifier
    config = tiny_config(privacy={"enabled": True, "noise_multiplier": 1.0, "metrics": "clear"},
                         reward_model={"enable": True, "kind": "implicit", "model.path": model.path},
                         trainer={"local_iterations": 1})
    client = VerlClient(config, arithmetic_rows(32, seed=1), [])
    instructions = FitConfig(server_round=1, local_iterations=1, planned_iterations=1, proximal_mu=0.0)
    update, _, metrics = client.fit(client.get_parameters({}), instructions.to_config())
    assert any(abs(a).max() > 0 for a in update) and FitReport.from_metrics(metrics).privacy.epsilon_run > 0


def test_a_dpo_verifier_path_that_is_no_policy_adapter_names_the_key_and_the_kind(policy, tmp_path,
                                                                                 reward_model_dirs):
    from flwr_verl.engine.reward_model import load_dpo_verifier

    config, models = policy
    with pytest.raises(ConfigError, match=r"reward_model.model.path=.*reward_model.kind='implicit'.*adapter_config"):
        load_dpo_verifier(str(tmp_path / "nope"), config.model, models.device)
    from peft import LoraConfig, get_peft_model

    classifier = save_classifier(tmp_path / "classifier", build_tokenizer(), arch="llama")
    seq_cls = get_peft_model(AutoModelForSequenceClassification.from_pretrained(classifier),
                             LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"]))
    seq_cls.save_pretrained(tmp_path / "seq_cls")
    with pytest.raises(ConfigError, match=r"task_type=.*SEQ_CLS.*reward_model.kind='classifier'"):
        load_dpo_verifier(str(tmp_path / "seq_cls"), config.model, models.device)


def test_bad_verifier_settings_are_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="reward_model.kind='dpo'.*classifier, implicit"):
        tiny_config(reward_model={"kind": "dpo"})
    with pytest.raises(ConfigError, match="reward_model.score='margin'.*implicit, likelihood"):
        tiny_config(reward_model={"score": "margin"})
    with pytest.raises(ConfigError, match="reward_model.beta=0.0"):
        tiny_config(reward_model={"beta": 0.0})
