"""Stage ``reward_model``: a reward model learned from preference pairs, one client's part.

**Data.** TRL's preference format: parquet rows with ``prompt``, ``chosen`` and ``rejected``,
either plain text (three strings) or conversational (``prompt`` a list of messages, ``chosen``
and ``rejected`` lists of assistant messages). A malformed row fails when loaded, with the file,
the row and the field. Pairs that share a prompt form one **privacy unit**: the prompt with all
its pairs (``PreferenceUnit``). With the embedded task (no files) the pairs are the arithmetic
problems of the split: chosen is the correct sum, rejected a near miss; the model never sees
the rule.

**Model.** The base model (``model.path``, or the embedded one) as an
``AutoModelForSequenceClassification`` with one label, LoRA-adapted with PEFT
``task_type="SEQ_CLS"`` and ``modules_to_save=["score"]``: the adapter and the score head
train, the base stays frozen. A response is read as the stage-2 scorer reads it
(``reward_model.conversation_text``, the score at the last attended token), so the model is
trained on exactly what it later scores.

**Objective.** Bradley-Terry, -log sigmoid(r(chosen) - r(rejected)) (``bradley_terry_loss``):
each unit's loss is the mean over its pairs, the mini-batch loss the mean over units. One
forward pass holds every chosen and rejected sequence of the mini-batch, so Opacus's per-row
gradients are exact; they are pooled per unit (``privacy.pool_rows``) before clipping. One
local iteration is the policy's: Poisson-sample units at q = ``data.train_batch_size`` / N,
``actor.ppo_epochs`` passes over ``train_batch_size / ppo_mini_batch_size`` mini-batches, so
the accounting (``privacy.IterationMechanism``), FedProx, SecAgg+ and the run directory are
the same as for the policy.

**Evaluation.** Pairwise accuracy on held-out pairs (their prompts are in no training split):
the share of pairs with r(chosen) > r(rejected); ``reward`` is the mean of
sigmoid(r(chosen) - r(rejected)). In the training summary, ``reward_*`` is the training
pairs' accuracy and ``pg_loss`` the Bradley-Terry loss.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flwr_verl import embedded
from flwr_verl.config import ConfigError, DataConfig, EngineConfig, ModelConfig
from flwr_verl.engine.data import DataError, load_stage_units, read_parquet_units, trl_prompt, trl_response
from flwr_verl.engine.evaluation import Evaluation
from flwr_verl.engine.models import (
    AdapterSet,
    ModelLoadError,
    lora_config,
    model_dtype,
    resolve_model_path,
    select_device,
    with_lora,
)
from flwr_verl.engine.reward_model import SCORE_HEAD, conversation_text, sequence_scores
from flwr_verl.privacy.dpsgd import unit_means
from flwr_verl.stages import Stage
from flwr_verl.stages.supervised import UnitLoss, UnitTrainer

REWARD_MODEL_ROLE = "reward_model"  # the adapter's name in the run directory and the AdapterSet


# ----------------------------------------------------------------------------- data
@dataclass
class PreferenceUnit:
    """One privacy unit: a prompt and all its (chosen, rejected) responses."""

    data_source: str
    prompt: list[dict]  # messages
    pairs: list[tuple[str, str]]


def preference_units(records: list[dict], source: str) -> list[PreferenceUnit]:
    """TRL-format preference rows grouped into units by prompt (first appearance order)."""
    units: dict[str, PreferenceUnit] = {}
    for index, record in enumerate(records):
        where = f"{source} row {index}"
        for field in ("prompt", "chosen", "rejected"):
            if record.get(field) is None:
                raise DataError(f"{where}: missing field {field!r} (TRL's preference format: prompt, chosen, "
                                "rejected)")
        prompt = trl_prompt(record["prompt"], where)
        pair = (trl_response(record["chosen"], where, "chosen"), trl_response(record["rejected"], where, "rejected"))
        key = json.dumps(prompt, sort_keys=True)
        data_source = record.get("data_source") if isinstance(record.get("data_source"), str) else "preference"
        units.setdefault(key, PreferenceUnit(data_source, prompt, [])).pairs.append(pair)
    return list(units.values())


def load_preference_files(files: str) -> list[PreferenceUnit]:
    return read_parquet_units(files, preference_units)


def near_misses(answer: int, count: int, rng: random.Random) -> list[int]:
    """``count`` distinct wrong answers close to ``answer``: off by one or ten, or digits swapped."""
    candidates = {answer + 1, answer - 1, answer + 10, answer - 10, int(str(answer)[::-1])} - {answer}
    candidates = sorted(c for c in candidates if c >= 0)
    return rng.sample(candidates, min(count, len(candidates)))


# Embedded demo: near misses per problem; 5 is every one there is (+-1, +-10, digits swapped). The
# privacy unit is the prompt with all its pairs, so more pairs cost no epsilon. Chosen on the tune
# split under DP (one client, 1536 prompts, epsilon 8, 60 iterations of 64): pairwise accuracy
# 0.57 against 0.53 with 2.
PAIRS_PER_PROMPT = 5


def arithmetic_units(num_prompts: int, seed: int, split: str) -> list[PreferenceUnit]:
    """The embedded demo's pairs: ``num_prompts`` problems of ``split``, chosen the correct sum,
    rejected near misses."""
    rng = random.Random(f"{seed}-{split}-pairs")
    problems = embedded.sample_problems(split, num_prompts, rng)
    return [PreferenceUnit(embedded.DATA_SOURCE, [{"role": "user", "content": prompt}],
                           [(answer, str(wrong)) for wrong in near_misses(int(answer), PAIRS_PER_PROMPT, rng)])
            for prompt, answer in problems]


def load_units(config: DataConfig, split: str, seed: int, partition_id: int = 0,
               num_partitions: int = 1) -> list[PreferenceUnit]:
    """One client's preference units for ``split``, partitioned as prompts are (``data.load_rows``)."""
    return load_stage_units(config, split, seed, partition_id, num_partitions, stage="reward_model",
                            read_files=load_preference_files, arithmetic=arithmetic_units,
                            file_format="TRL-format preference")


# ----------------------------------------------------------------------------- model
@dataclass
class RewardModelTrainee:
    """The reward model being trained: LoRA + score head on a frozen sequence classifier."""

    tokenizer: object
    model: torch.nn.Module
    device: torch.device

    @property
    def adapters(self) -> AdapterSet:
        return AdapterSet({REWARD_MODEL_ROLE: self.model})


def build_reward_model_trainee(config: ModelConfig, seed: int = 0) -> RewardModelTrainee:
    """``model.path`` as a one-label sequence classifier with fresh LoRA adapters and a trainable
    score head (seeded: every process builds the same initial adapter)."""
    from peft import TaskType
    from transformers import AutoModelForSequenceClassification

    from flwr_verl.engine.models import load_tokenizer

    torch.manual_seed(seed)
    device = select_device(config.device)
    path = resolve_model_path(config)
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "right"  # scores are read at the last attended token
    try:
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=model_dtype(config),
                                                                  local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"model.path={str(path)!r} has no sequence-classification variant for a reward "
                             f"model (stage='reward_model'): {error}") from error
    if not isinstance(getattr(base, SCORE_HEAD, None), torch.nn.Module):
        raise ModelLoadError(f"model.path={str(path)!r}: {type(base).__name__} has no '{SCORE_HEAD}' head")
    base.config.pad_token_id = tokenizer.pad_token_id
    model = with_lora(base, config, lora_config(config, TaskType.SEQ_CLS, modules_to_save=[SCORE_HEAD]))
    return RewardModelTrainee(tokenizer=tokenizer, model=model.to(device), device=device)


def check_unit_lengths(trainee: RewardModelTrainee, units: list[PreferenceUnit]) -> None:
    """Every prompt plus response must fit the model's positions: an error names the longest."""
    config = trainee.model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is None or not units:
        return
    texts = [conversation_text(unit.prompt, response, trainee.tokenizer)
             for unit in units for pair in unit.pairs for response in pair]
    lengths = [len(ids) for ids in trainee.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if max(lengths) > limit:
        raise ConfigError(f"model.path: a preference prompt plus response takes {max(lengths)} tokens, more than the "
                          f"model's {limit} positions ({texts[int(np.argmax(lengths))][:80]!r}...); shorten the data")


# ----------------------------------------------------------------------------- objective
def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, unit_of_pair: torch.Tensor,
                       num_units: int) -> torch.Tensor:
    """Mean over units of each unit's mean -log sigmoid(r_chosen - r_rejected) over its pairs.

    Args: ``chosen``, ``rejected`` (P,) scores of the P pairs; ``unit_of_pair`` (P,) ids in
    [0, num_units). Safe under DP: a unit's term depends on its own pairs alone."""
    return unit_means(-torch.nn.functional.logsigmoid(chosen - rejected), unit_of_pair, num_units).mean()


@dataclass
class PairBatch:
    """The sequences of some units' pairs, for one forward pass: rows 0..P-1 chosen, P..2P-1
    rejected; ``unit_of_pair`` maps each pair to its unit (0..U-1 in the order given)."""

    input_ids: torch.Tensor  # (2P, T) right-padded
    attention_mask: torch.Tensor
    unit_of_pair: torch.Tensor  # (P,)
    num_units: int

    @property
    def unit_of_row(self) -> torch.Tensor:
        return torch.cat([self.unit_of_pair, self.unit_of_pair])


def pair_batch(units: Sequence[PreferenceUnit], tokenizer, device: torch.device) -> PairBatch:
    chosen = [conversation_text(u.prompt, c, tokenizer) for u in units for c, _ in u.pairs]
    rejected = [conversation_text(u.prompt, r, tokenizer) for u in units for _, r in u.pairs]
    encoded = tokenizer(chosen + rejected, add_special_tokens=False, padding=True, return_tensors="pt")
    unit_of_pair = torch.tensor([i for i, u in enumerate(units) for _ in u.pairs], device=device)
    return PairBatch(encoded["input_ids"].to(device), encoded["attention_mask"].to(device), unit_of_pair, len(units))


def pair_scores(model: torch.nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores, (P,) each, from one forward pass."""
    scores = sequence_scores(model, batch.input_ids, batch.attention_mask)
    return scores[: len(batch.unit_of_pair)], scores[len(batch.unit_of_pair):]


# ----------------------------------------------------------------------------- the local trainer
class LocalRewardModelTrainer(UnitTrainer):
    """Bradley-Terry on one client's preference units, updating only the LoRA adapter and the
    score head, in the fixed-data loop of ``supervised.UnitTrainer`` (the interface of
    ``trainer.LocalPPOTrainer``, so ``VerlClient`` runs either)."""

    def __init__(self, config: EngineConfig, train_units: list[PreferenceUnit], *,
                 models: RewardModelTrainee | None = None) -> None:
        models = models or build_reward_model_trainee(config.model, seed=config.trainer.seed)
        super().__init__(config, train_units, models, models.model)
        self.tokenizer = models.tokenizer

    def unit_loss(self, units: list[PreferenceUnit]) -> UnitLoss:
        batch = pair_batch(units, self.tokenizer, self.models.device)
        chosen, rejected = pair_scores(self.model, batch)
        loss = bradley_terry_loss(chosen, rejected, batch.unit_of_pair, batch.num_units)
        return UnitLoss(loss, batch.unit_of_row, {"pg_loss": loss.item(),
                                                  "reward_mean": (chosen > rejected).float().mean().item()})

    @torch.no_grad()
    def evaluate(self, units: list[PreferenceUnit], micro_batch_size: int = 64) -> Evaluation | None:
        """Pairwise accuracy and mean sigmoid margin on held-out ``units``; None without any."""
        if not units:
            return None
        self.model.eval()
        margins = []
        for start in range(0, len(units), micro_batch_size):
            chosen, rejected = pair_scores(self.model, pair_batch(units[start: start + micro_batch_size],
                                                                  self.tokenizer, self.models.device))
            margins.append(chosen - rejected)
        margin = torch.cat(margins)
        return Evaluation(reward=torch.sigmoid(margin).mean().item(), accuracy=(margin > 0).float().mean().item())


# ----------------------------------------------------------------------------- export
def export_merged(adapter_dir: Path, out_dir: Path, config: ModelConfig) -> Path:
    """A ready-to-use reward model: the base with the trained adapter merged in and the score
    head saved, plus the tokenizer; ``reward_model.model.path`` takes it as it is."""
    from flwr_verl.engine.models import load_adapter_into, load_tokenizer

    trainee = build_reward_model_trainee(dataclasses.replace(config, device="cpu"))
    load_adapter_into(trainee.model, adapter_dir)
    merged = trainee.model.merge_and_unload()
    out_dir = Path(out_dir)
    merged.save_pretrained(out_dir)
    load_tokenizer(resolve_model_path(config)).save_pretrained(out_dir)
    return out_dir


def make_trainer(config: EngineConfig, train_units: list[PreferenceUnit], val_units: list[PreferenceUnit],
                 models: RewardModelTrainee):
    check_unit_lengths(models, train_units + val_units)
    return LocalRewardModelTrainer(config, train_units, models=models)


STAGE = Stage(  # stage reward_model
    build_models=lambda config: build_reward_model_trainee(config.model, seed=config.trainer.seed),
    load_units=load_units,
    unit_trainer=make_trainer,
    prompt_of=lambda unit: unit.prompt,
)
