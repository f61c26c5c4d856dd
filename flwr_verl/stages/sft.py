"""Stage ``sft``: supervised fine-tuning of the LoRA policy on (prompt, response) pairs, one
client's part. Its final adapter (``adapters/final/policy``) is what a later ``policy`` stage
starts from (``model.init_adapter``).

**Data.** Parquet rows with ``prompt`` and ``response``, each plain text (or ``prompt`` a list
of messages); TRL's prompt-completion format, ``prompt`` and ``completion`` (plain text, or
conversational: ``prompt`` a list of messages, ``completion`` a list of assistant messages); or
TRL's conversational format: ``messages``, a list of {'role', 'content'} messages whose last is
the assistant's response and whose others are the prompt. In a multi-turn ``messages`` row every
assistant turn is trained on (TRL's assistant-only loss), each after the messages before it;
only the last is evaluated. A malformed row fails when loaded, with the file, the row and the
field. Rows that share a prompt form one **privacy unit** (``SFTUnit``): the prompt with all its
responses (and a conversation's earlier assistant turns). With the embedded task (no
files) the units are the arithmetic problems of the split, the response the correct sum: the
held-out prompts are in no training split.

**Text.** The prompt as the policy sees it when it generates (``data.prompt_text``: the chat
template with its generation prompt, or BOS and the prompt), cut from the left to
``data.max_prompt_length`` tokens as the rollout cuts it, then the response's tokens and EOS:
the sequence the policy would produce. The loss is on the response tokens and EOS only. An
earlier assistant turn is one more such sequence: the messages before it as the prompt, the
turn as the response.

**Objective.** ``sft_loss``: each response's (or assistant turn's) mean negative log-likelihood
over its tokens (verl's ``logprobs_from_logits``), each unit's mean over its responses and
turns, the mean over units. Safe under DP: a unit's term depends on its own responses alone,
and Opacus's per-row gradients are pooled per unit (``privacy.pool_rows``) before clipping.
``actor.loss_agg_mode`` does not apply (verl's ``token-mean`` would couple units). The loop,
the accounting, FedProx, SecAgg+ and the run directory are the other stages'
(``supervised.UnitTrainer``); in the training summary ``pg_loss`` is the SFT loss.

**Evaluation.** On held-out units, round 0 included: ``response_loss``, the mean over units of
the loss above (Flower's evaluation loss), and exact match (``accuracy`` and ``reward``): the
share of prompts whose greedy response (at most ``rollout.response_length`` tokens) equals one
of its references, stripped of surrounding whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from flwr_verl import embedded
from flwr_verl.config import ConfigError, DataConfig, EngineConfig
from flwr_verl.engine._verl import compute_position_id_with_mask, verl_F
from flwr_verl.engine.data import DataError, load_stage_units, prompt_text, read_parquet_units, trl_prompt, trl_response
from flwr_verl.engine.evaluation import Evaluation
from flwr_verl.engine.models import Models, build_models, check_lengths
from flwr_verl.engine.rollout import generate
from flwr_verl.privacy.dpsgd import unit_means
from flwr_verl.stages import Stage
from flwr_verl.stages.policy import policy_models
from flwr_verl.stages.supervised import UnitLoss, UnitTrainer


# ----------------------------------------------------------------------------- data
@dataclass
class SFTUnit:
    """One privacy unit: a prompt and all its reference responses, and, for a multi-turn
    conversation, its earlier assistant turns (trained on, not evaluated)."""

    data_source: str
    prompt: list[dict]  # messages
    responses: list[str]
    earlier_turns: list[tuple[list[dict], str]] = field(default_factory=list)  # (messages before it, content)

    def examples(self) -> list[tuple[list[dict], str]]:
        """Every (prompt messages, response) the unit trains on: its earlier turns, then each
        response to ``prompt``."""
        return [*self.earlier_turns, *((self.prompt, response) for response in self.responses)]

    @property
    def prompt_row(self) -> dict:
        """The prompt as a verl-format row (what ``rollout.generate`` takes), the first reference as
        its ground truth."""
        return {"data_source": self.data_source, "prompt": self.prompt,
                "reward_model": {"ground_truth": self.responses[0]}, "extra_info": {}}


def _conversation(value, where: str) -> tuple[list[dict], str, list[tuple[list[dict], str]]]:
    """TRL's ``messages``: (the prompt's messages, the last message's content: the response, the
    earlier assistant turns that follow at least one message, each with the messages before it)."""
    messages = list(value) if not isinstance(value, (str, dict)) else None
    if (not messages or len(messages) < 2
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages)
            or messages[-1]["role"] != "assistant"):
        raise DataError(f"{where}: field 'messages' must be a list of {{'role', 'content'}} messages: the prompt, "
                        "then the assistant's response as the last")
    earlier = [(trl_prompt(messages[:index], where), message["content"])
               for index, message in enumerate(messages[:-1]) if index and message["role"] == "assistant"]
    return trl_prompt(messages[:-1], where), messages[-1]["content"], earlier


def sft_units(records: list[dict], source: str) -> list[SFTUnit]:
    """SFT rows grouped into units by prompt (first appearance order)."""
    units: dict[str, SFTUnit] = {}
    for index, record in enumerate(records):
        where = f"{source} row {index}"
        earlier: list[tuple[list[dict], str]] = []
        if record.get("messages") is not None:
            prompt, response, earlier = _conversation(record["messages"], where)
        else:
            answer = "completion" if record.get("completion") is not None else "response"  # TRL's, or ours
            for name in ("prompt", answer):
                if record.get(name) is None:
                    raise DataError(f"{where}: missing field {name!r} (SFT rows: prompt and response, TRL's prompt "
                                    "and completion, or TRL's conversational messages)")
            prompt, response = trl_prompt(record["prompt"], where), trl_response(record[answer], where, answer)
        data_source = record.get("data_source") if isinstance(record.get("data_source"), str) else "sft"
        units.setdefault(json.dumps(prompt, sort_keys=True),
                         SFTUnit(data_source, prompt, [], earlier)).responses.append(response)
    return list(units.values())


def load_sft_files(files: str) -> list[SFTUnit]:
    return read_parquet_units(files, sft_units)


def arithmetic_units(num_prompts: int, seed: int, split: str) -> list[SFTUnit]:
    """The embedded demo's SFT data: the policy stage's ``num_prompts`` problems of ``split``
    (``embedded.arithmetic_rows``), each with its correct sum, so both stages report on the same
    held-out prompts."""
    return [SFTUnit(row["data_source"], row["prompt"], [row["reward_model"]["ground_truth"]])
            for row in embedded.arithmetic_rows(num_prompts, seed, split)]


def load_units(config: DataConfig, split: str, seed: int, partition_id: int = 0,
               num_partitions: int = 1) -> list[SFTUnit]:
    """One client's SFT units for ``split``, partitioned as prompts are (``data.load_rows``)."""
    return load_stage_units(config, split, seed, partition_id, num_partitions, stage="sft",
                            read_files=load_sft_files, arithmetic=arithmetic_units,
                            file_format="SFT (prompt and response, or TRL's messages)")


# ----------------------------------------------------------------------------- sequences
def response_sequences(examples: list[tuple[list[dict], str]], tokenizer,
                       max_prompt_length: int) -> list[tuple[list[int], int]]:
    """Each (prompt messages, response) of ``examples`` as (token ids, prompt length): the prompt
    as the rollout encodes it (``data.prompt_text``, cut from the left to ``max_prompt_length``
    tokens), then the response's tokens and EOS."""
    tokenizer.truncation_side = "left"  # as rollout.generate: keep the end of an overlong prompt
    prompts = tokenizer([prompt_text({"prompt": messages}, tokenizer) for messages, _ in examples],
                        add_special_tokens=False, truncation=True, max_length=max_prompt_length)["input_ids"]
    responses = tokenizer([response for _, response in examples], add_special_tokens=False)["input_ids"]
    return [(prompt + response + [tokenizer.eos_token_id], len(prompt)) for prompt, response in zip(prompts, responses)]


@dataclass
class ResponseBatch:
    """The responses of some units, for one forward pass: one row per response, right-padded;
    ``unit_of_row`` maps rows to units (0..U-1 in the order given)."""

    input_ids: torch.Tensor  # (R, T)
    attention_mask: torch.Tensor  # (R, T)
    position_ids: torch.Tensor  # (R, T)
    loss_mask: torch.Tensor  # (R, T): 1 on the response tokens and EOS
    unit_of_row: torch.Tensor  # (R,)
    num_units: int


def response_batch(examples: list[tuple[list[dict], str]], unit_of_row: list[int], num_units: int, tokenizer,
                   max_prompt_length: int, device: torch.device) -> ResponseBatch:
    """``examples`` (prompt messages, response), one row each, right-padded; row i belongs to
    unit ``unit_of_row[i]``."""
    sequences = response_sequences(examples, tokenizer, max_prompt_length)
    shape = (len(sequences), max(len(ids) for ids, _ in sequences))
    input_ids = torch.full(shape, tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, prompt_length: len(ids)] = 1
    return ResponseBatch(input_ids.to(device), attention_mask.to(device),
                         compute_position_id_with_mask(attention_mask).to(device), loss_mask.to(device),
                         torch.tensor(unit_of_row, device=device), num_units)


def unit_batch(units: list[SFTUnit], tokenizer, max_prompt_length: int, device: torch.device) -> ResponseBatch:
    """Every example of ``units`` (``SFTUnit.examples``: its earlier turns and responses), unit by unit."""
    examples = [(i, example) for i, unit in enumerate(units) for example in unit.examples()]
    return response_batch([e for _, e in examples], [i for i, _ in examples], len(units), tokenizer,
                          max_prompt_length, device)


def response_log_probs(model: torch.nn.Module, batch: ResponseBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of each next token, (R, T - 1), and the mask of its response
    tokens and EOS, (R, T - 1), as floats: position t predicts token t + 1."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, :-1]
    log_prob = verl_F.logprobs_from_logits(logits, batch.input_ids[:, 1:])
    return log_prob, batch.loss_mask[:, 1:].to(log_prob)


def response_nll(model: torch.nn.Module, batch: ResponseBatch) -> torch.Tensor:
    """Each row's mean negative log-likelihood of its response tokens and EOS: (R,)."""
    log_prob, mask = response_log_probs(model, batch)
    return -verl_F.masked_mean(log_prob, mask, axis=-1)


def sft_loss(per_response: torch.Tensor, unit_of_row: torch.Tensor, num_units: int) -> torch.Tensor:
    """Mean over units of each unit's mean response loss. Args: ``per_response`` (R,)
    (``response_nll``), ``unit_of_row`` (R,) ids in [0, num_units). Safe under DP: a unit's term
    depends on its own responses alone."""
    return unit_means(per_response, unit_of_row, num_units).mean()


def check_unit_lengths(config: EngineConfig, models: Models, units: list[SFTUnit]) -> None:
    """Before any training: every prompt (cut to ``data.max_prompt_length``) plus its response and
    EOS must fit the model's positions, and so must a greedy evaluation's prompt plus
    ``rollout.response_length`` (``models.check_lengths``)."""
    if not units:
        return
    check_lengths(config, models, [unit.prompt_row for unit in units])
    limit = getattr(models.policy.config, "max_position_embeddings", None)
    examples = [example for unit in units for example in unit.examples()]
    lengths = [len(ids) for ids, _ in response_sequences(examples, models.tokenizer, config.data.max_prompt_length)]
    if limit is not None and max(lengths) > limit:
        raise ConfigError(f"data.max_prompt_length={config.data.max_prompt_length}: a prompt (cut to that many tokens) "
                          f"plus its response and EOS takes {max(lengths)} tokens, more than the model's {limit} "
                          "positions; shorten the responses or lower data.max_prompt_length")


# ----------------------------------------------------------------------------- the local trainer
class LocalSFTTrainer(UnitTrainer):
    """SFT on one client's units, updating only the policy's LoRA weights, in the fixed-data loop
    of ``supervised.UnitTrainer`` (the interface of ``trainer.LocalPPOTrainer``, so ``VerlClient``
    runs either)."""

    def __init__(self, config: EngineConfig, train_units: list[SFTUnit], *, models: Models | None = None) -> None:
        models = models or build_models(config.model, with_critic=False, seed=config.trainer.seed)
        super().__init__(config, train_units, models, models.policy)
        self.tokenizer = models.tokenizer

    def _batch(self, units: list[SFTUnit]) -> ResponseBatch:
        return unit_batch(units, self.tokenizer, self.config.data.max_prompt_length, self.models.device)

    def unit_loss(self, units: list[SFTUnit]) -> UnitLoss:
        batch = self._batch(units)
        loss = sft_loss(response_nll(self.model, batch), batch.unit_of_row, batch.num_units)
        return UnitLoss(loss, batch.unit_of_row, {"pg_loss": loss.item()})

    @torch.no_grad()
    def evaluate(self, units: list[SFTUnit], micro_batch_size: int = 64) -> Evaluation | None:
        """Held-out response loss and greedy exact match on ``units``; None without any."""
        if not units:
            return None
        self.model.eval()
        losses = []
        for start in range(0, len(units), micro_batch_size):
            batch = self._batch(units[start: start + micro_batch_size])
            losses.append(unit_means(response_nll(self.model, batch), batch.unit_of_row, batch.num_units))
        generated = generate(self.model, self.tokenizer, [unit.prompt_row for unit in units], self.config.rollout,
                             self.config.data.max_prompt_length, n=1, greedy=True)
        texts = self.tokenizer.batch_decode(generated.batch["responses"], skip_special_tokens=True)
        exact = float(np.mean([text.strip() in {r.strip() for r in unit.responses} for text, unit in zip(texts, units)]))
        return Evaluation(reward=exact, accuracy=exact, response_loss=torch.cat(losses).mean().item())


def make_trainer(config: EngineConfig, train_units: list[SFTUnit], val_units: list[SFTUnit], models: Models):
    check_unit_lengths(config, models, train_units + val_units)
    return LocalSFTTrainer(config, train_units, models=models)


STAGE = Stage(
    build_models=policy_models,
    load_units=load_units,
    unit_trainer=make_trainer,
    prompt_of=lambda unit: unit.prompt,
)
