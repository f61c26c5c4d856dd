"""The local RL engine: verl's PPO family on LoRA adapters, one client, one process.

One iteration, top to bottom (B prompts, n responses each, R = response length):

1. sample B prompt rows (Poisson under DP)
2. rollout: B*n responses                                   -> DataProto (B*n, P+R)
3. reward: the rule through verl's reward contract
   (``rewards.RewardManager``) or a learned reward model
   (``reward_model.LearnedReward``)                          -> token_level_scores (B*n, R)
4. log-probs under the rollout policy and the reference     -> old_log_probs, ref_log_prob (B*n, R)
   (the reference is the same model with the adapter disabled); values for gae (B*n, R).
   Each pass runs only when something reads it (``LogProbPasses``): the reference only for a KL
   term; the old log-probs not when the update is on-policy, where they are the update's own.
5. KL in the reward (verl's apply_kl_penalty), advantages (verl's compute_advantage)
6. ppo_epochs x mini-batches of prompts: verl's policy loss (+ entropy, + KL loss), AdamW on
   adapter weights; DP-SGD through Opacus when privacy is on; FedProx's term when anchored;
   the critic's verl value loss for gae.

Everything RL-specific (estimators, losses, KL, reward contract, DataProto) is verl's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flwr_verl.config import EngineConfig
from flwr_verl.engine._verl import (
    AlgoConfig,
    DataProto,
    KLControlConfig,
    VerlActorConfig,
    apply_kl_penalty,
    compute_advantage,
    core_algos,
    verl_F,
)
from flwr_verl.engine.data import Row
from flwr_verl.engine.evaluation import Evaluation
from flwr_verl.engine.forward import response_logits
from flwr_verl.engine.models import Models, build_models
from flwr_verl.engine.reward_model import DPOVerifier, LearnedReward, RewardModel
from flwr_verl.engine.rewards import make_reward_manager, resolve_compute_score
from flwr_verl.engine.rollout import generate
from flwr_verl.engine.update import PlainUpdate, start_update
from flwr_verl.privacy.deidentify import build_processors
from flwr_verl.privacy.dpsgd import (
    IterationMechanism,
    PrivateUpdate,
    centered_prompt_sum,
    metric_ranges,
)


@dataclass(frozen=True)
class LogProbPasses:
    """Which no-grad forward passes an iteration needs, decided once from the config and model.

    * ``reference``: the adapter-disabled pass, read only by a KL term (``actor.use_kl_loss``,
      ``algorithm.use_kl_in_reward``). Without one the ``kl`` metric is not reported: it would
      cost a forward pass of its own.
    * ``old``: the rollout policy's log-probs. The update is on-policy when it is one epoch of
      one mini-batch through a model without dropout: its only forward runs at the rollout
      weights and computes exactly the log-probs this pass would, so the update uses its own
      (``log_prob.detach()``, as TRL's GRPOTrainer does with one iteration per generation) and
      the pass is skipped, unless the KL penalty in the reward reads them before the update.
      Generation's own logits (``output_logits``) are not used: their KV-cached forward differs
      from a full forward by about 1e-6, not exactly.
    """

    reference: bool
    old: bool

    @classmethod
    def needed(cls, config: EngineConfig, num_mini_batches: int, policy: torch.nn.Module) -> LogProbPasses:
        on_policy = config.actor.ppo_epochs == 1 and num_mini_batches == 1 and not _uses_dropout(policy)
        kl_in_reward = config.algorithm.use_kl_in_reward
        return cls(reference=config.actor.use_kl_loss or kl_in_reward, old=kl_in_reward or not on_policy)


@dataclass
class LocalFit:
    """One fit as a value: its update (private or plain, chosen once when the fit starts), the
    stream of prompt batches, and the critic's optimizer (gae only). ``LocalPPOTrainer.start_fit``
    makes one; ``LocalPPOTrainer.iteration`` takes it."""

    update: PlainUpdate | PrivateUpdate
    batches: Iterator[list[int]]
    critic_optimizer: torch.optim.Optimizer | None

    @property
    def mechanism(self) -> IterationMechanism | None:
        """What one iteration of this fit spends (None without privacy)."""
        return self.update.mechanism


@dataclass
class FitResult:
    """What one call to ``LocalPPOTrainer.fit`` did."""

    metrics: list[dict[str, float]]  # one dict per iteration
    mechanism: IterationMechanism | None  # what each iteration spent; None without privacy

    @property
    def iterations(self) -> int:
        return len(self.metrics)


class LocalPPOTrainer:
    """Runs verl's PPO family on one client's prompts, updating only LoRA adapter weights."""

    def __init__(self, config: EngineConfig, train_rows: list[Row], *, models: Models | None = None,
                 compute_score=None, reward_model: RewardModel | DPOVerifier | None = None) -> None:
        torch.set_num_threads(config.trainer.num_threads)
        self.config = config
        self.train_rows = train_rows
        self.models = models or build_models(config.model, config.needs_critic, seed=config.trainer.seed)
        self.policy, self.critic, self.tokenizer = self.models.policy, self.models.critic, self.models.tokenizer
        self.policy_params = [p for p in self.policy.parameters() if p.requires_grad]  # the LoRA weights
        score = compute_score or resolve_compute_score(config.custom_reward_function, config.data)
        self.reward_fn = make_reward_manager(self.tokenizer, score, config.custom_reward_function.clip)
        # What training optimises: the rule reward, or a learned reward model (reward_model.enable).
        # Evaluation always scores with the rule: the true objective the learned one stands in for.
        self.train_reward = (self.reward_fn if reward_model is None else
                             LearnedReward(reward_model, self.tokenizer, config.reward_model, rule=self.reward_fn,
                                           group=config.rollout.n if config.model.shared_prompt_cache else 1))
        actor, algorithm = config.actor, config.algorithm
        self.actor_config = VerlActorConfig(
            strategy="fsdp", rollout_n=config.rollout.n, ppo_mini_batch_size=actor.ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu=actor.ppo_mini_batch_size, use_torch_compile=False,
            clip_ratio=actor.clip_ratio, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode, entropy_coeff=actor.entropy_coeff,
            use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
            ppo_epochs=actor.ppo_epochs,
        )
        self.algo_config = AlgoConfig(
            gamma=algorithm.gamma, lam=algorithm.lam, adv_estimator=algorithm.adv_estimator,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo, use_kl_in_reward=algorithm.use_kl_in_reward,
            kl_penalty=algorithm.kl_penalty,
            kl_ctrl=KLControlConfig(type=algorithm.kl_ctrl_type, kl_coef=algorithm.kl_coef,
                                    target_kl=algorithm.target_kl, horizon=algorithm.horizon),
        )
        self.kl_ctrl = core_algos.get_kl_controller(self.algo_config.kl_ctrl)
        self.policy_loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss)
        self.num_mini_batches = config.data.train_batch_size // actor.ppo_mini_batch_size
        self.log_prob_passes = LogProbPasses.needed(config, self.num_mini_batches, self.policy)
        # MemFree filter of this organisation's protected text (None when deidentify is off)
        self.logits_processor = build_processors(
            config.deidentify, self.tokenizer, (m["content"] for row in train_rows for m in row["prompt"]))

    # ------------------------------------------------------------------ public API
    def fit(self, iterations: int, *, anchor: Sequence[np.ndarray | torch.Tensor] | None = None,
            proximal_mu: float = 0.0, noise_multiplier: float | None = None, seed: int = 0,
            time_budget_s: float | None = None) -> FitResult:
        """Run ``iterations`` RL iterations (other arguments as in ``start_fit``), or fewer when
        ``time_budget_s`` seconds have passed: no iteration starts after that (the first always
        runs). ``FitResult.iterations`` is what ran."""
        with self.start_fit(anchor=anchor, proximal_mu=proximal_mu, noise_multiplier=noise_multiplier,
                            seed=seed) as fit:
            metrics = run_iterations(lambda: self.iteration(fit), iterations, time_budget_s)
        return FitResult(metrics=metrics, mechanism=fit.mechanism)

    @contextmanager
    def start_fit(self, *, anchor: Sequence[np.ndarray | torch.Tensor] | None = None, proximal_mu: float = 0.0,
                  noise_multiplier: float | None = None, seed: int = 0) -> Iterator[LocalFit]:
        """Set up one fit: a fresh optimizer, FedProx's term anchored at ``anchor`` (the global
        policy adapter as received; default: the current weights), and the private or plain
        update. Under privacy ``noise_multiplier`` overrides ``privacy.noise_multiplier``.
        Opacus is detached from the model when the block ends."""
        cfg = self.config
        torch.manual_seed(seed)  # rollout sampling
        update, batches = start_update(self.policy, self.policy_params, len(self.train_rows), cfg,
                                       rows_per_unit=cfg.rollout.n, anchor=anchor, proximal_mu=proximal_mu,
                                       noise_multiplier=noise_multiplier, seed=seed)
        critic_optimizer = (
            torch.optim.AdamW([p for p in self.critic.parameters() if p.requires_grad], lr=cfg.critic.lr)
            if self.critic is not None else None
        )
        try:
            yield LocalFit(update=update, batches=batches, critic_optimizer=critic_optimizer)
        finally:
            update.close()

    @torch.no_grad()
    def evaluate(self, rows: list[Row]) -> Evaluation | None:
        """Greedy decoding on ``rows``: mean reward, and accuracy (share of rewards >= 1); None
        without rows."""
        if not rows:
            return None
        batch = generate(self.policy, self.tokenizer, rows, self.config.rollout,
                         self.config.data.max_prompt_length, n=1, greedy=True, logits_processor=self.logits_processor)
        scores = self.reward_fn(batch).sum(-1)
        return Evaluation(reward=scores.mean().item(), accuracy=(scores >= 1.0).float().mean().item())

    # ------------------------------------------------------------------ one iteration
    def iteration(self, fit: LocalFit) -> dict[str, float]:
        """One RL iteration of ``fit``: draw prompts, roll out, score, update (module docstring)."""
        cfg, timings = self.config, {}
        rows = [self.train_rows[i] for i in next(fit.batches)]
        if not rows:  # an empty Poisson draw is still a round of (noise-only) DP steps
            for _ in range(cfg.actor.ppo_epochs * self.num_mini_batches):
                fit.update.noise_only_step()
            return {"prompts": 0.0}

        with _timed(timings, "rollout"):
            batch = generate(self.policy, self.tokenizer, rows, cfg.rollout, cfg.data.max_prompt_length,
                             logits_processor=self.logits_processor, shared_prompt_cache=cfg.model.shared_prompt_cache)
        with _timed(timings, "reward"):
            batch.batch["token_level_scores"] = self.train_reward(batch)
            if cfg.algorithm.adv_estimator == "remax":  # baseline: reward of the greedy response
                greedy = generate(self.policy, self.tokenizer, rows, cfg.rollout, cfg.data.max_prompt_length,
                                  n=1, greedy=True, logits_processor=self.logits_processor)
                baseline = self.train_reward(greedy).sum(-1)
                batch.batch["reward_baselines"] = baseline.repeat_interleave(cfg.rollout.n)
        with _timed(timings, "log_prob"):
            if self.log_prob_passes.old:
                batch.batch["old_log_probs"] = self._log_probs(batch)
            if self.log_prob_passes.reference:
                with self.policy.disable_adapter():
                    batch.batch["ref_log_prob"] = self._log_probs(batch)
            if self.critic is not None:
                batch.batch["values"] = self._values(batch)
        metrics: dict[str, float] = {}
        with _timed(timings, "advantage"):
            if cfg.algorithm.use_kl_in_reward:
                batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = compute_advantage(
                batch, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                num_repeat=cfg.rollout.n, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                config=self.algo_config,
            )
        with _timed(timings, "update"):
            metrics.update(self._update(fit, batch, num_units=len(rows)))

        mask = batch.batch["response_mask"].float()
        metrics.update({
            "prompts": float(len(rows)),
            "reward_mean": batch.batch["token_level_scores"].sum(-1).mean().item(),
            "response_length": mask.sum(-1).mean().item(),
            "proximal_term": fit.update.proximal.term(self.policy_params).item(),
            **{f"time_{phase}": seconds for phase, seconds in timings.items()},
        })
        if cfg.privacy.sent_metrics == "dp":  # per-prompt means, clipped, for release_metrics
            per_prompt = {"reward_mean": batch.batch["token_level_scores"].sum(-1), "response_length": mask.sum(-1)}
            ranges = metric_ranges(cfg.custom_reward_function.clip, cfg.rollout.response_length)
            metrics.update({f"dp_sum_{name}": centered_prompt_sum(values.view(len(rows), -1).mean(-1), *ranges[name])
                            for name, values in per_prompt.items()})
        return metrics

    # ------------------------------------------------------------------ forward passes
    def _forward_policy(self, batch: DataProto, with_entropy: bool = False):
        """Log-probs (and entropy) of the response tokens: (rows, R)."""
        responses = batch.batch["responses"]
        group = self.config.rollout.n if self.config.model.shared_prompt_cache else 1
        logits = response_logits(self.policy, batch.batch["input_ids"], batch.batch["attention_mask"],
                                 batch.batch["position_ids"], responses.shape[1], group)
        logits = logits / self.config.rollout.temperature  # (rows, R, V)
        log_prob = verl_F.logprobs_from_logits(logits, responses)
        entropy = verl_F.entropy_from_logits(logits) if with_entropy else None
        return log_prob, entropy

    @torch.no_grad()
    def _log_probs(self, batch: DataProto) -> torch.Tensor:
        self.policy.eval()
        return self._forward_policy(batch)[0]

    def _values(self, batch: DataProto, grad: bool = False) -> torch.Tensor:
        """Critic values at the positions that predict each response token: (rows, R)."""
        responses = batch.batch["responses"]
        with torch.set_grad_enabled(grad):
            values = self.critic(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                                 position_ids=batch.batch["position_ids"]).logits.squeeze(-1)
        return values[:, -responses.shape[1] - 1: -1] * batch.batch["response_mask"]

    # ------------------------------------------------------------------ the update
    def _update(self, fit: LocalFit, batch: DataProto, num_units: int) -> dict[str, float]:
        """ppo_epochs passes; each splits the prompts (units) into the configured mini-batches."""
        n = self.config.rollout.n
        totals: dict[str, list[float]] = defaultdict(list)
        self.policy.train()
        with fit.update.recording():  # under DP, only these forward passes feed per-sample gradients
            for _ in range(self.config.actor.ppo_epochs):
                for units in fit.update.split(num_units):
                    if len(units) == 0:  # an empty mini-batch of a small draw: under DP still a (noise) step
                        fit.update.noise_only_step()
                        continue
                    rows = (units[:, None] * n + np.arange(n)).reshape(-1)  # each unit's n adjacent rows
                    mini_batch = batch.select_idxs(np.sort(rows))
                    for key, value in self._actor_step(fit.update, mini_batch).items():
                        totals[key].append(value)
                    if fit.critic_optimizer is not None:
                        for key, value in self._critic_step(fit.critic_optimizer, mini_batch).items():
                            totals[key].append(value)
        self.policy.eval()
        return {key: float(np.mean(values)) for key, values in totals.items()}

    def _actor_step(self, update: PlainUpdate | PrivateUpdate, mb: DataProto) -> dict[str, float]:
        actor, mask = self.config.actor, mb.batch["response_mask"]
        log_prob, entropy = self._forward_policy(mb, with_entropy=actor.entropy_coeff > 0)
        # on-policy (LogProbPasses): this forward runs at the rollout weights
        old_log_prob = mb.batch["old_log_probs"] if self.log_prob_passes.old else log_prob.detach()
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=mb.batch["advantages"],
            response_mask=mask, loss_agg_mode=actor.loss_agg_mode, config=self.actor_config,
        )
        loss = pg_loss
        if actor.entropy_coeff > 0:
            loss = loss - actor.entropy_coeff * core_algos.agg_loss(entropy, mask, actor.loss_agg_mode)
        if actor.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, mb.batch["ref_log_prob"], actor.kl_loss_type)
            loss = loss + actor.kl_loss_coef * core_algos.agg_loss(kld, mask, actor.loss_agg_mode)
        update.backward(loss)
        step_metrics = update.step()
        if self.log_prob_passes.reference:  # the rollout policy's KL to the reference, at no extra cost
            kl = core_algos.kl_penalty(old_log_prob, mb.batch["ref_log_prob"], "low_var_kl")
            step_metrics["kl"] = verl_F.masked_mean(kl, mask.float()).item()
        return {"pg_loss": pg_loss.item(), "pg_clipfrac": pg_metrics.get("actor/pg_clipfrac", 0.0), **step_metrics,
                **{k.removeprefix("actor/"): v for k, v in pg_metrics.items() if k != "actor/pg_clipfrac"}}

    def _critic_step(self, optimizer: torch.optim.Optimizer, mb: DataProto) -> dict[str, float]:
        critic = self.config.critic
        vpreds = self._values(mb, grad=True)
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, returns=mb.batch["returns"], values=mb.batch["values"],
            response_mask=mb.batch["response_mask"], cliprange_value=critic.cliprange_value,
            loss_agg_mode=self.config.actor.loss_agg_mode,
        )
        vf_loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.critic.parameters() if p.requires_grad], critic.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        return {"vf_loss": vf_loss.item(), "vf_clipfrac": float(vf_clipfrac)}


def run_iterations(iteration: Callable[[], dict[str, float]], iterations: int,
                   time_budget_s: float | None) -> list[dict[str, float]]:
    """The metrics of up to ``iterations`` calls of ``iteration``; none starts once
    ``time_budget_s`` seconds have passed (the first always runs). Shared by every local objective."""
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    metrics: list[dict[str, float]] = []
    while len(metrics) < iterations and (not metrics or deadline is None or time.perf_counter() < deadline):
        metrics.append(iteration())
    return metrics


def _uses_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of ``model`` is random: a dropout module with p > 0 (LoRA's
    dropout is one), or a dropout rate in its config (attention dropout is applied as a function)."""
    dropouts = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
    if any(isinstance(module, dropouts) and module.p > 0 for module in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = config.to_dict().items() if config is not None else ()
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, (int, float))
               and not isinstance(value, bool) and value > 0 for key, value in rates)


@contextmanager
def _timed(timings: dict[str, float], phase: str):
    start = time.perf_counter()
    yield
    timings[phase] = time.perf_counter() - start
