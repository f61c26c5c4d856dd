"""Stage ``dpo``: direct preference optimisation of the LoRA policy on preference pairs, one
client's part (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is
Secretly a Reward Model"). Its final adapter is a policy, and, through its implicit reward, a
verifier for a later ``policy`` stage.

**Data.** Stage ``reward_model``'s: TRL's preference format (``prompt``, ``chosen``,
``rejected``; standard or conversational) or the embedded task's pairs (``preference.load_units``).
A prompt with all its pairs is one **privacy unit** (``preference.PreferenceUnit``).

**Sequences.** As stage ``sft`` reads a response (``sft.response_batch``): the prompt as the
policy sees it when it generates, cut from the left to ``data.max_prompt_length`` tokens, then
the response and EOS. A response's log-probability log pi(y|x) is the sum over its tokens and EOS.
The chosen and rejected responses of a mini-batch's units go through one forward pass.

**Reference.** The same LoRA policy with its adapter disabled (``peft``'s ``disable_adapter``),
as TRL's ``DPOTrainer`` does for a new adapter: no second model in memory. The base is frozen, so
each unit's reference log-probabilities are computed once, the first time the trainer sees it, and
kept (TRL's ``precompute_ref_log_probs``, lazily): later steps and evaluations run the policy's
pass alone. With
``model.init_adapter`` set (e.g. a stage-sft adapter) the reference is still the base: the
policy starts from the SFT adapter, and DPO's KL term anchors it at the base model.

**Losses** (``DPO_LOSSES``, each (P,) per pair from the log-ratios h = log pi - log pi_ref of the
chosen (w) and rejected (l) responses, as TRL 1.16's ``DPOTrainer`` computes them):

- ``sigmoid`` (DPO): -log sigmoid(beta (h_w - h_l));
- ``ipo`` (Azar et al., 2023): ((h_w / |y_w| - h_l / |y_l|) - 1 / (2 beta))^2, length-normalised
  as TRL and the IPO authors do;
- ``cdpo`` (conservative DPO, Mitchell 2023: labels flipped with probability epsilon =
  ``dpo.label_smoothing``): -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d);
- ``robust`` (Chowdhury et al., 2024, TRL's ``robust``): cdpo's terms debiased,
  (-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps).

With ``dpo.sft_weight`` w > 0 each pair's loss adds w times the chosen response's negative
log-likelihood per token, -log pi(y_w|x) / |y_w| (``chosen_nll``; RPO, Pang et al., 2024,
"Iterative Reasoning Preference Optimization"; TRL's ``loss_type=[loss, "sft"]`` with
``loss_weights=[1, w]``). DPO's losses move only the margin between chosen and rejected, and both
may fall; this term raises the chosen response itself, which is what the policy's likelihood
scores as a verifier. TRL averages over all chosen tokens of a batch; here over each pair's, so
that a unit's loss depends on its own pairs alone (the same when the chosen responses are equally
long).

**Objective under DP.** Each unit's loss is the mean over its pairs, the mini-batch loss the mean
over units: a unit's term depends on its own pairs alone, so Opacus's per-row gradients, pooled
per unit (``privacy.pool_rows``), are each unit's gradient. The reference pass runs without
gradients, so it adds nothing to what DP-SGD clips. The loop, the accounting, FedProx, SecAgg+
and the run directory are the other stages' (``supervised.UnitTrainer``).

**Evaluation.** On held-out pairs (their prompts are in no training split): ``accuracy`` is the
share of pairs whose implicit reward beta h ranks chosen above rejected, a tie counting half
(``pairwise_accuracy``), ``reward`` the mean of
sigmoid(beta (h_w - h_l)). In the training summary ``pg_loss`` is the loss (with its SFT term) and
``reward_mean`` the training pairs' accuracy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flwr_verl.config import ConfigError, DPOConfig, EngineConfig
from flwr_verl.engine.evaluation import Evaluation
from flwr_verl.engine.models import Models, build_models
from flwr_verl.privacy.dpsgd import unit_means
from flwr_verl.stages import Stage
from flwr_verl.stages.policy import policy_models
from flwr_verl.stages.preference import PreferenceUnit, load_units
from flwr_verl.stages.sft import ResponseBatch, response_batch, response_log_probs, response_sequences
from flwr_verl.stages.supervised import UnitLoss, UnitTrainer


# ----------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class PairLogRatios:
    """log pi(y|x) - log pi_ref(y|x) of each pair's chosen and rejected response, their token
    counts (response tokens and EOS), and the chosen response's log pi(y|x), (P,) each."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_log_prob: torch.Tensor


DPOLoss = Callable[[PairLogRatios, float, float], torch.Tensor]  # (ratios, beta, label_smoothing) -> (P,)
DPO_LOSSES: dict[str, DPOLoss] = {}


def register_dpo_loss(name: str) -> Callable[[DPOLoss], DPOLoss]:
    """Add a preference loss to ``DPO_LOSSES`` under ``name`` (``dpo.loss`` picks it). Every loss
    here is per pair, so safe under DP when pooled per unit."""
    def register(fn: DPOLoss) -> DPOLoss:
        DPO_LOSSES[name] = fn
        return fn
    return register


@register_dpo_loss("sigmoid")
def sigmoid_loss(ratios: PairLogRatios, beta: float, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * (ratios.chosen - ratios.rejected))


@register_dpo_loss("ipo")
def ipo_loss(ratios: PairLogRatios, beta: float, label_smoothing: float) -> torch.Tensor:
    delta = ratios.chosen / ratios.chosen_tokens.clamp(min=1) - ratios.rejected / ratios.rejected_tokens.clamp(min=1)
    return (delta - 1 / (2 * beta)) ** 2


@register_dpo_loss("cdpo")
def conservative_loss(ratios: PairLogRatios, beta: float, label_smoothing: float) -> torch.Tensor:
    margin = beta * (ratios.chosen - ratios.rejected)
    return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


@register_dpo_loss("robust")
def robust_loss(ratios: PairLogRatios, beta: float, label_smoothing: float) -> torch.Tensor:
    margin = beta * (ratios.chosen - ratios.rejected)
    return (-(1 - label_smoothing) * F.logsigmoid(margin) + label_smoothing * F.logsigmoid(-margin)) \
        / (1 - 2 * label_smoothing)


def chosen_nll(ratios: PairLogRatios) -> torch.Tensor:
    """The chosen response's negative log-likelihood per token, -log pi(y_w|x) / |y_w|, (P,): the
    SFT term that ``dpo.sft_weight`` adds to every loss."""
    return -ratios.chosen_log_prob / ratios.chosen_tokens.clamp(min=1)


def pair_loss(ratios: PairLogRatios, dpo: DPOConfig) -> torch.Tensor:
    """Each pair's loss, (P,): ``dpo.loss``, plus ``dpo.sft_weight`` times ``chosen_nll``."""
    loss = DPO_LOSSES[dpo.loss](ratios, dpo.beta, dpo.label_smoothing)
    return loss + dpo.sft_weight * chosen_nll(ratios) if dpo.sft_weight else loss


# ----------------------------------------------------------------------------- sequences
def pair_examples(units: Sequence[PreferenceUnit]) -> tuple[list[tuple[list[dict], str]], list[int]]:
    """The rows of one forward pass: every chosen response of ``units`` (pair by pair, unit by
    unit), then every rejected one in the same order; and each row's unit (0..U-1)."""
    chosen = [(i, (unit.prompt, c)) for i, unit in enumerate(units) for c, _ in unit.pairs]
    rejected = [(i, (unit.prompt, r)) for i, unit in enumerate(units) for _, r in unit.pairs]
    rows = chosen + rejected
    return [example for _, example in rows], [i for i, _ in rows]


def sequence_log_probs(model: torch.nn.Module, batch: ResponseBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log pi(response + EOS | prompt) and its token count, (R,) each."""
    log_prob, mask = response_log_probs(model, batch)
    return (log_prob * mask).sum(-1), mask.sum(-1)


def reference_log_probs(model, batch: ResponseBatch) -> torch.Tensor:
    """Each row's log pi_ref(response + EOS | prompt): the policy with its adapter disabled, (R,)."""
    with torch.no_grad(), model.disable_adapter():
        return sequence_log_probs(model, batch)[0]


def pair_log_ratios(model, batch: ResponseBatch, reference: torch.Tensor | None = None) -> PairLogRatios:
    """The policy's log-ratios to its adapter-disabled self (the reference) on ``batch``'s rows
    (``pair_examples``: P chosen, then P rejected); ``reference``: those rows' reference
    log-probabilities when known (``reference_log_probs``). Gradients flow through the policy's
    pass only."""
    policy, tokens = sequence_log_probs(model, batch)
    if reference is None:
        reference = reference_log_probs(model, batch)
    ratio = policy - reference
    pairs = len(ratio) // 2
    return PairLogRatios(ratio[:pairs], ratio[pairs:], tokens[:pairs], tokens[pairs:], policy[:pairs])


def pairwise_accuracy(margin: torch.Tensor) -> float:
    """The share of pairs a score ranks right, from each pair's margin score(chosen) -
    score(rejected), (P,): a tie counts half, as a score that cannot tell two responses apart is
    right half the time (the untrained policy's implicit reward ties every pair)."""
    return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean().item()


# ----------------------------------------------------------------------------- the local trainer
class LocalDPOTrainer(UnitTrainer):
    """DPO on one client's preference units, updating only the policy's LoRA weights, in the
    fixed-data loop of ``supervised.UnitTrainer`` (so ``VerlClient`` runs it as any stage)."""

    def __init__(self, config: EngineConfig, train_units: list[PreferenceUnit], *,
                 models: Models | None = None) -> None:
        models = models or build_models(config.model, with_critic=False, seed=config.trainer.seed)
        super().__init__(config, train_units, models, models.policy)
        self.tokenizer = models.tokenizer
        self._reference: dict[int, tuple[PreferenceUnit, torch.Tensor]] = {}  # id -> (unit, (2, pairs))

    def _ratios(self, units: Sequence[PreferenceUnit]) -> tuple[PairLogRatios, torch.Tensor]:
        examples, unit_of_row = pair_examples(units)
        batch = response_batch(examples, unit_of_row, len(units), self.tokenizer, self.config.data.max_prompt_length,
                               self.models.device)
        return pair_log_ratios(self.model, batch, self._cached_reference(units, batch)), batch.unit_of_row

    def _cached_reference(self, units: Sequence[PreferenceUnit], batch: ResponseBatch) -> torch.Tensor:
        """The reference log-probabilities of ``units``' rows (``pair_examples``' order), computed
        for the units not seen before and kept: the base never changes."""
        missing = [u for u in units if self._reference.get(id(u), (None,))[0] is not u]
        if missing:
            examples, unit_of_row = pair_examples(missing)
            fresh = reference_log_probs(self.model, response_batch(
                examples, unit_of_row, len(missing), self.tokenizer, self.config.data.max_prompt_length,
                self.models.device)).view(2, -1)
            start = 0
            for unit in missing:
                self._reference[id(unit)] = (unit, fresh[:, start: start + len(unit.pairs)].clone())
                start += len(unit.pairs)
        cached = [self._reference[id(u)][1] for u in units]
        return torch.cat([torch.cat([c[0] for c in cached]), torch.cat([c[1] for c in cached])]).to(batch.input_ids.device)

    def unit_loss(self, units: list[PreferenceUnit]) -> UnitLoss:
        ratios, unit_of_row = self._ratios(units)
        unit_of_pair = unit_of_row[: len(ratios.chosen)]
        loss = unit_means(pair_loss(ratios, self.config.dpo), unit_of_pair, len(units)).mean()
        return UnitLoss(loss, unit_of_row, {"pg_loss": loss.item(),
                                            "reward_mean": (ratios.chosen > ratios.rejected).float().mean().item()})

    @torch.no_grad()
    def evaluate(self, units: list[PreferenceUnit], micro_batch_size: int = 32) -> Evaluation | None:
        """Pairwise accuracy of the implicit reward (``pairwise_accuracy``) and its mean sigmoid margin
        on held-out ``units``."""
        if not units:
            return None
        self.model.eval()
        margins = []
        for start in range(0, len(units), micro_batch_size):
            ratios, _ = self._ratios(units[start: start + micro_batch_size])
            margins.append(self.config.dpo.beta * (ratios.chosen - ratios.rejected))
        margin = torch.cat(margins)
        return Evaluation(reward=torch.sigmoid(margin).mean().item(), accuracy=pairwise_accuracy(margin))


def check_unit_lengths(config: EngineConfig, models: Models, units: list[PreferenceUnit]) -> None:
    """Before any training: every prompt (cut to ``data.max_prompt_length``) plus a response and
    EOS must fit the model's positions."""
    limit = getattr(models.policy.config, "max_position_embeddings", None)
    if limit is None or not units:
        return
    examples, _ = pair_examples(units)
    longest = max(len(ids) for ids, _ in response_sequences(examples, models.tokenizer, config.data.max_prompt_length))
    if longest > limit:
        raise ConfigError(f"data.max_prompt_length={config.data.max_prompt_length}: a preference prompt (cut to that "
                          f"many tokens) plus a response and EOS takes {longest} tokens, more than the model's {limit} "
                          "positions; shorten the responses or lower data.max_prompt_length")


def make_trainer(config: EngineConfig, train_units: list[PreferenceUnit], val_units: list[PreferenceUnit],
                 models: Models):
    check_unit_lengths(config, models, train_units + val_units)
    return LocalDPOTrainer(config, train_units, models=models)


STAGE = Stage(
    build_models=policy_models,
    load_units=load_units,
    unit_trainer=make_trainer,
    prompt_of=lambda unit: unit.prompt,
)
