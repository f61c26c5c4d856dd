"""The Flower client: a ``NumPyClient`` that runs the local RL engine on one organisation's data.

Each round the server sends the global adapter weights. ``fit`` loads them, runs
``trainer.local_iterations`` RL iterations with FedProx's term anchored at them, and returns the
*update* (new minus global adapter weights), in float64 under SecAgg+. SecAgg+'s rounding error
scales with its clipping range, and updates fit a smaller range than weights: at the same range
both aggregate equally accurately (2.9e-9 vs 2.8e-9 max error, ``benchmarks/secagg_overhead.py``),
at a range fitted to the updates the error shrinks with it. The update is also what the server's
optimizer needs (its pseudo-gradient). Only adapter arrays ever leave the client.

The instructions arrive as a ``protocol.FitConfig`` and the report leaves as a
``protocol.FitReport``. What must outlive one message and one run (what the data set has spent)
lives in the node's privacy ledger (``ledger.py``); models are cached per process, since Flower
builds a fresh client for every message.

What a client refuses to send, and says why (each a ``FlwrVerlError`` that the ClientApp's
``concise_errors`` mod turns into a one-line error reply naming the partition):

- parameters of the wrong count or shape (another model's adapter): ``AdapterShapeError`` with
  the expected and received shapes, before anything is trained;
- an update with NaN or infinity: ``NonFiniteUpdate``;
- an update that SecAgg+ would clip: ``UpdateOutOfRange``.

A round that would spend more than the client's epsilon budget is refused, not failed: a zero
update with weight 0 and status ``STATUS_BUDGET``; under SecAgg+ the client leaves the round
instead (``PrivacyBudgetExhausted``), so that every participant the server unmasks is a real
contributor. After every fit the client also reports whether one more round would still fit its
budget (``protocol.PrivacyReport``: never the budget itself, nor its ledger), so the strategy
stops sampling it before it has to refuse. The budget is ``privacy.epsilon_budget`` from the run
config, or the node's own ``epsilon-budget`` from its node config when that is stricter: the
data owner can always spend less of its data's privacy than the federation's config allows.

The budget is checked against everything the node's data set has ever spent, in every run: the
node's privacy ledger (``ledger.py``, node config ``privacy-ledger``) records each round's spend
before training, in the transaction that checks the budget, so it is on disk before the update
leaves the node. Nothing the server sends changes it.

Under ``privacy.client_level`` each round is also recorded, before training, as a client-level
spend of the same data set with privacy unit "client" (``PrivacyLedger.spend_client_level``, at
sampling rate 1: the node does not trust the server's sampling). Its budget is the node's
``client-epsilon-budget``, separate from ``epsilon-budget``: the two epsilons protect different
units at different deltas (``privacy.client_level.delta``) and are never added. A round past it
leaves the SecAgg+ round (``PrivacyBudgetExhausted``), as client-level DP always runs under SecAgg+.

Node config keys read here: ``partition-id`` and ``num-partitions`` (which share of the data
this node trains on), ``epsilon-budget`` and ``client-epsilon-budget`` (above), ``privacy-ledger`` (the ledger file), and
``client-id``: the name this client gives itself in reports and error lines (default: the
partition id); the server keys what it keeps per client by Flower's node id, never by it.
``reward-model-path``: this node's own reward model, in place of the run config's
``reward_model.model.path`` when ``reward_model.enable`` is on; it is loaded here and never
leaves the node (``flwr_verl.engine.reward_model``).
``local-iterations`` and ``time-budget-s`` limit this node's local work per round
(``config.LocalBudget``): it runs at most that many of the round's iterations, and starts none
after that many seconds; it reports the iterations it ran (``FitReport.iterations``). The
ledger records the capped count before training, so ``local-iterations`` is accounted exactly,
and a fit that ``time-budget-s`` stops sooner is over-counted, never under-counted. Under
``aggregation = "fednova"`` it sends its update divided by the iterations it ran
(``FitConfig.normalize_update``).

Under ``compression.density < 1`` the client sends only the round's coordinates, the same for
every client (``FitConfig.sparse``, ``compression.py``), and keeps the rest as its error-feedback
residual, added to its next round's update. A ClientApp keeps the residual in Flower's
``Context.state`` (``compression.StateErrorFeedback``): each message runs in a fresh process, and
the SuperNode keeps a run's state from message to message.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.common import log

from flwr_verl.config import ConfigError, EngineConfig, FlwrVerlError, LocalBudget
from flwr_verl.engine.data import Row
from flwr_verl.engine.models import Models, check_lengths
from flwr_verl.engine.reward_model import PATH_KEY, DPOVerifier, RewardModel
from flwr_verl.engine.rewards import PROMPT_KEY, checked, resolve_compute_score
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.federation.compression import ErrorFeedback, StateErrorFeedback, coordinate_mask, with_error_feedback
from flwr_verl.federation.node import (
    NODE_CLIENT_EPSILON_BUDGET,
    NODE_CLIENT_ID,
    NODE_DEIDENTIFY_CORPUS,
    NODE_EPSILON_BUDGET,
    NODE_REWARD_MODEL_PATH,
    cached_models,
    cached_reward_model,
    cached_rows,
    node_client_epsilon_budget,
    node_ledger,
    with_node_budget,
    with_node_corpus,
    with_node_reward_model,
)
from flwr_verl.federation.protocol import (
    STATUS_BUDGET,
    STATUS_OK,
    EvaluateConfig,
    EvaluateReport,
    FitConfig,
    FitReport,
    NoisedTrainingMetrics,
    PreflightConfig,
    PreflightReport,
    PrivacyReport,
    TrainingSummary,
)
from flwr_verl.federation.secagg import check_update, exact_update
from flwr_verl.privacy.distributed_dp import PRIVACY_UNIT as CLIENT_UNIT
from flwr_verl.privacy.distributed_dp import SkellamPlan, encode_update, noise_generator, plan_round
from flwr_verl.privacy.dpsgd import (
    DP_METRICS,
    PRIVACY_UNIT,
    IterationMechanism,
    PrivacyAccount,
    metric_ranges,
    noise_for_target_epsilon,
    release_metrics,
    released_metric_std,
    sample_rate,
)
from flwr_verl.privacy.ledger import IN_MEMORY, DataSetKey, LedgerError, PrivacyLedger, fingerprint_prompts
from flwr_verl.stages import unit_prompts, unit_trainer


class NonFiniteUpdate(FlwrVerlError, ValueError):
    """Local training produced NaN or infinity; the update is not sent."""


class PrivacyBudgetExhausted(FlwrVerlError, RuntimeError):
    """Under SecAgg+, a round that would pass the client's epsilon budget: the client leaves the
    protocol instead of taking part with weight 0. A zero-weight participant still counts towards
    the reconstruction threshold, so the server could unmask a "sum" of fewer real contributors
    than the threshold promises (one client's exact update, when all others refuse)."""


def preflight_reward(compute_score, rows: list[Row]) -> None:
    """Score an empty response to the first prompt once, before any training: a reward function
    that raises or returns something other than a finite number fails here with a ``RewardError``
    naming the function, not after the first rollout."""
    if not rows:
        return
    row = rows[0]
    checked(compute_score)(row["data_source"], "", row["reward_model"]["ground_truth"],
                           {**row.get("extra_info", {}), PROMPT_KEY: row["prompt"][-1]["content"]})


def reported_num_examples(mode: str, num_prompts: int) -> int:
    """The weight this client sends as ``num_examples`` (``privacy.num_examples``): its prompt
    count (``exact``), that count rounded up to a power of two (``bucketed``), or 1 (``fixed``)."""
    if mode == "fixed":
        return 1
    if mode == "bucketed":
        return 1 << max(num_prompts - 1, 0).bit_length()
    return num_prompts


def _nbytes(arrays: list[np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays))


class VerlClient(NumPyClient):
    """Federated RLHF client: verl PPO on LoRA adapters, under Opacus DP, exchanging adapter updates.

    ``ledger`` is the node's privacy ledger (``node_ledger(context)`` in a ClientApp). Without one
    the client keeps its spends in memory for its own lifetime: right for in-process experiments
    that keep one client object, wrong for a ClientApp, which builds a client per message.
    ``run_id`` labels this run's spends in the ledger. ``client_epsilon_budget`` (node config
    ``client-epsilon-budget``; 0: none) bounds the client-level epsilon (``privacy.client_level``)
    that the ledger has recorded for this data set, across runs.
    """

    def __init__(self, config: EngineConfig, train_rows: list[Row], val_rows: list[Row], *,
                 partition_id: int = 0, models: Models | None = None, compute_score=None,
                 client_id: str | None = None, ledger: PrivacyLedger | None = None, run_id: str = "local",
                 reward_model: RewardModel | DPOVerifier | None = None, reward_model_key: str = PATH_KEY,
                 budget: LocalBudget | None = None, error_feedback: ErrorFeedback | None = None,
                 client_epsilon_budget: float = 0.0) -> None:
        self.config = config
        self.client_epsilon_budget = client_epsilon_budget  # client-level DP's, from node config; 0: none
        self.budget = budget or LocalBudget()
        # Sparse uploads' residual (compression.density < 1); without one it lasts as long as this object.
        self.error_feedback = error_feedback or ErrorFeedback()
        self.partition_id = partition_id
        self.client_id = str(partition_id) if client_id is None else str(client_id)
        self.train_rows, self.val_rows = train_rows, val_rows
        # Without a ledger (in-process experiments) spends last as long as this client object.
        self.ledger = ledger or PrivacyLedger(IN_MEMORY)
        self.run_id = run_id
        privacy = config.privacy
        if privacy.enabled and train_rows and privacy.delta >= 1 / len(train_rows):
            raise ConfigError(f"privacy.delta={privacy.delta} is invalid for {len(train_rows)} private prompts: "
                              f"it must be below 1/N = {1 / len(train_rows):.3g} (at delta >= 1/N a mechanism may "
                              "publish one prompt outright and still meet the guarantee)")
        if config.stage != "policy":  # a fixed-data objective (SFT, Bradley-Terry): no rollout, no reward
            self.trainer = unit_trainer(config, train_rows, val_rows, models or cached_models(config))
            self.adapters = self.trainer.models.adapters
            return
        compute_score = checked(compute_score or resolve_compute_score(config.custom_reward_function, config.data),
                                config.custom_reward_function.clip)
        preflight_reward(compute_score, train_rows or val_rows)
        models = models or cached_models(config)
        check_lengths(config, models, train_rows + val_rows)
        if config.reward_model.enable and reward_model is None:
            reward_model = cached_reward_model(config, config.reward_model.model.path, reward_model_key, models.device)
        if reward_model is not None:
            reward_model.check_fits(train_rows + val_rows, config.rollout.response_length)
        self.trainer = LocalPPOTrainer(config, train_rows, models=models, compute_score=compute_score,
                                       reward_model=reward_model)
        self.adapters = self.trainer.models.adapters

    # ------------------------------------------------------------------ Flower API
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return self.adapters.get_arrays()

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """The preflight (``protocol.PreflightConfig``): building this client already loaded its
        model and data and scored one response; here the batch sizes and SecAgg+ bounds are
        checked against its own data. Any problem raises, and reaches the server as one line."""
        self._preflight(PreflightConfig.from_config(config))
        return {"status": STATUS_OK, **PreflightReport(self.client_id).to_metrics()}

    def _preflight(self, instructions: PreflightConfig) -> None:
        sample_rate(self.config.data.train_batch_size, len(self.train_rows))
        weight = reported_num_examples(self.config.privacy.num_examples, len(self.train_rows))
        if instructions.secagg and weight > instructions.secagg.max_weight:
            raise ConfigError(f"secagg.max-weight={instructions.secagg.max_weight:g} is invalid: this client has "
                              f"{len(self.train_rows)} training prompts (weight {weight} with privacy.num_examples="
                              f"{self.config.privacy.num_examples!r}), and SecAgg+ would overflow a larger weight; "
                              "raise secagg.max-weight to at least every client's weight")
        if instructions.frozen_weights and instructions.frozen_weights != (own := self.adapters.frozen_fingerprint):
            weights, verb = (("base model and its frozen LoRA A factors (model.lora_freeze_a)", "differ")
                             if self.config.model.lora_freeze_a else ("base model", "differs"))
            raise ConfigError(
                f"model.path={self.config.model.path or '(embedded)'}: this client's {weights} (sha256 {own[:16]}) "
                f"{verb} from the server's ({instructions.frozen_weights[:16]}). These weights never travel, so "
                "every node must load the same weights: the same model files, model.dtype, trainer.seed and "
                "library versions (torch, transformers, peft)")

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        start = time.perf_counter()
        instructions = FitConfig.from_config(config)
        self.adapters.set_arrays(parameters)  # AdapterShapeError names expected and received shapes
        if instructions.fail_partition == self.partition_id:  # fault injection for tests
            raise RuntimeError(f"injected failure in partition {self.partition_id}")
        iterations = self.budget.iterations_for(instructions.local_iterations)
        mechanism = self._mechanism(instructions)
        report = FitReport(status=STATUS_OK, partition_id=self.partition_id, client_id=self.client_id,
                           bytes_received=_nbytes(parameters), bytes_sent=0)

        plan = self._client_level_plan(parameters, instructions) if self.config.privacy.client_level.enabled else None
        if plan is not None:  # recorded first: a refusal below then over-counts this round, never under-counts
            self._spend_client_level(plan, instructions.server_round)
        budget = self.config.privacy.epsilon_budget
        # Spent before training, in the transaction that checks the budget: see ``ledger.py``.
        spend = self.ledger.spend(
            self.data_set, mechanism, iterations, budget=budget, delta=self.config.privacy.delta,
            accountant=self.config.privacy.accountant, run_id=self.run_id, server_round=instructions.server_round,
        ) if mechanism else None
        if spend and spend.refused:
            refusal = dataclasses.replace(report, status=STATUS_BUDGET,
                                          privacy=self._privacy_report(spend.before, mechanism, iterations))
            log(INFO, "privacy budget: this round would bring %s to epsilon %.3g > budget %g; refused",
                self.data_set.description, spend.before.after(mechanism, iterations).epsilon(self.config.privacy.delta),
                budget)
            if instructions.secagg:
                raise PrivacyBudgetExhausted("one more round would pass this node's epsilon budget; "
                                             "leaving the SecAgg+ round")
            # In the clear: a zero update with zero weight, which every aggregation ignores.
            return [np.zeros_like(p) for p in parameters], 0, refusal.to_metrics()

        result = self.trainer.fit(
            iterations, anchor=parameters[: len(self.trainer.policy_params)], proximal_mu=instructions.proximal_mu,
            noise_multiplier=mechanism.noise_multiplier if mechanism else None,
            seed=self.config.trainer.seed + 100_003 * instructions.server_round + 7919 * self.partition_id,
            time_budget_s=self.budget.seconds,
        )
        # A time budget may stop the fit sooner: the ledger then over-counts, which is safe.
        if mechanism is not None and (result.mechanism != dataclasses.replace(mechanism, metrics_noise_multiplier=0.0)
                                      or result.iterations > iterations):
            raise LedgerError(f"the fit spent {result.iterations} x {result.mechanism}, more than the {iterations} x "
                              f"{mechanism} the ledger recorded; not sent")
        # SecAgg+ quantizes in the dtype it receives: float64 keeps its 2e-9 steps (float32 alone
        # would cost ~1e-7), at no cost on the wire, where masked int64 vectors travel either way.
        new = self.adapters.get_arrays()
        update = (exact_update(new, parameters) if instructions.secagg
                  else [n - old for n, old in zip(new, parameters)])
        if instructions.normalize_update:  # FedNova: the server scales the mean back (strategy.FedProxAdapters)
            update = [u / result.iterations for u in update]
        if bad := [name for name, a in zip(self.adapters.names, update) if not np.isfinite(a).all()]:
            raise NonFiniteUpdate(f"the local update has NaN or inf in {len(bad)} of {len(update)} arrays "
                                  f"(first: {bad[0]}); not sent. Lower actor.lr or check the reward function")
        residual = None
        if instructions.sparse:  # the round's coordinates only; the rest waits in the residual
            indices = coordinate_mask(instructions.sparse.seed, sum(a.size for a in update),
                                      instructions.sparse.density)
            sent, residual = with_error_feedback(update, self.error_feedback.residual, indices)
            update = [sent]
        weight = reported_num_examples(self.config.privacy.num_examples, len(self.train_rows))
        if plan is not None:  # client-level DP: noisy integers of weight 1
            update, weight = self._encode_client_level(update, plan, instructions.server_round), 1
        elif instructions.secagg:
            check_update(update, weight, instructions.secagg.clipping_range, instructions.secagg.max_weight)
        if residual is not None:  # kept only once the update is fit to be sent
            self.error_feedback.residual = residual
        report = dataclasses.replace(
            report, bytes_sent=_nbytes(update), iterations=result.iterations,
            privacy=self._privacy_report(spend.after, mechanism, iterations) if spend else None,
            training=(TrainingSummary.of_fit(result.metrics, time.perf_counter() - start)
                      if self.config.privacy.sent_metrics == "clear" else None),
            training_dp=(self._noised_metrics(result.metrics, instructions)
                         if self.config.privacy.sent_metrics == "dp" and result.iterations else None),
        )
        return update, weight, report.to_metrics()

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        """Held-out greedy evaluation (``protocol.EvaluateConfig``), after the preflight's checks
        when the message carries them."""
        instructions = EvaluateConfig.from_config(config)
        preflight = {}
        if instructions.preflight is not None:
            self._preflight(instructions.preflight)
            preflight = PreflightReport(self.client_id).to_metrics()
        self.adapters.set_arrays(parameters)
        result = self.trainer.evaluate(self.val_rows)
        if result is None:
            return 0.0, 0, preflight
        # The held-out count is this node's data size too: it leaves as the training count does.
        weight = reported_num_examples(self.config.privacy.num_examples, len(self.val_rows))
        return result.loss, weight, {**EvaluateReport.of(result).to_metrics(), **preflight}

    def _client_level_plan(self, parameters: list[np.ndarray], instructions: FitConfig) -> SkellamPlan:
        """The round's ``distributed_dp.SkellamPlan``, known before training (the update has the
        adapter's size). Refused unless the server set up the round for client-level DP."""
        if instructions.client_level is None or not instructions.secagg:
            raise ConfigError("privacy.client_level.enabled=true, but the server's round is not a client-level DP "
                              "round under SecAgg+; the update is not sent")
        return plan_round(self.config.privacy.client_level, sum(a.size for a in parameters),
                          instructions.client_level.num_clients, instructions.client_level.min_survivors)

    def _spend_client_level(self, plan: SkellamPlan, server_round: int) -> None:
        """Record the round's client-level spend in the node's ledger before training, or leave
        the SecAgg+ round (``PrivacyBudgetExhausted``) when it would pass ``client-epsilon-budget``."""
        key = dataclasses.replace(self.data_set, unit=CLIENT_UNIT)
        delta = self.config.privacy.client_level.delta
        spend = self.ledger.spend_client_level(key, plan, budget=self.client_epsilon_budget, delta=delta,
                                               run_id=self.run_id, server_round=server_round)
        if spend.refused:
            raise PrivacyBudgetExhausted(
                f"one more round would bring the client-level epsilon from {spend.epsilon_before:.3g} to more than "
                f"node config {NODE_CLIENT_EPSILON_BUDGET}={self.client_epsilon_budget:g} (at delta {delta:g}); "
                "leaving the SecAgg+ round")

    def _encode_client_level(self, update: list[np.ndarray], plan: SkellamPlan, server_round: int) -> list[np.ndarray]:
        """The update clipped, rotated, rounded and noised (``distributed_dp.encode_update``): what
        SecAgg+ sums."""
        seed = ((self.config.trainer.seed, server_round, self.partition_id)
                if self.config.privacy.deterministic else None)  # None: a key from the OS's CSPRNG
        return encode_update(update, plan, server_round, noise_generator(seed))

    def _noised_metrics(self, iterations: list[dict[str, float]], instructions: FitConfig) -> NoisedTrainingMetrics:
        """``privacy.metrics = "dp"``: the fit's mean reward and response length, noised
        (``privacy.release_metrics``); the ledger recorded their spend with the update's."""
        privacy = self.config.privacy
        ranges = metric_ranges(self.config.custom_reward_function.clip, self.config.rollout.response_length)
        sums = {name: sum(m.get(f"dp_sum_{name}", 0.0) for m in iterations) for name in DP_METRICS}
        seed = ((self.config.trainer.seed, instructions.server_round, self.partition_id, 1)
                if privacy.deterministic else None)  # None: the OS's entropy
        shape = {"noise_multiplier": privacy.metrics_noise_multiplier, "iterations": len(iterations),
                 "batch_size": self.config.data.train_batch_size}
        released = release_metrics(sums, ranges, rng=np.random.default_rng(seed), **shape)
        return NoisedTrainingMetrics(**released, **{
            f"{name}_noise_std": released_metric_std(*ranges[name], num_metrics=len(DP_METRICS), **shape)
            for name in DP_METRICS})

    # ------------------------------------------------------------------ privacy state
    @functools.cached_property
    def data_set(self) -> DataSetKey:
        """What this client's spends are recorded against: its training prompts' hash, the same in
        every stage (``ledger.py``'s key), and the unit (computed on the first fit: evaluation and
        preflight messages do not need it)."""
        return DataSetKey(fingerprint_prompts(unit_prompts(self.config, self.train_rows)), PRIVACY_UNIT,
                          f"{describe_source(self.config)}, partition {self.partition_id}, "
                          f"{len(self.train_rows)} prompts")

    def _mechanism(self, instructions: FitConfig) -> IterationMechanism | None:
        """What one local iteration will spend; None without privacy."""
        privacy = self.config.privacy
        if not privacy.enabled:
            return None
        q = sample_rate(self.config.data.train_batch_size, len(self.train_rows))
        sigma = (noise_for_target_epsilon(privacy, q, instructions.planned_iterations, self.config.actor.ppo_epochs)
                 if privacy.target_epsilon else privacy.noise_multiplier)
        metrics_sigma = privacy.metrics_noise_multiplier if privacy.sent_metrics == "dp" else 0.0
        return IterationMechanism(sigma, q, self.config.actor.ppo_epochs, metrics_sigma)

    def _privacy_report(self, spent: PrivacyAccount, mechanism: IterationMechanism,
                        iterations: int) -> PrivacyReport:
        """What the server learns (``protocol.PrivacyReport``): whether one more round like this
        one fits the budget, and, when the weight already tells it N, this run's epsilon. The
        node's own log has the rest (``flwr-verl ledger show`` has every run)."""
        privacy = self.config.privacy
        budget = privacy.epsilon_budget
        fits = not budget or spent.after(mechanism, iterations).epsilon(privacy.delta) <= budget
        epsilon_run = None
        if privacy.num_examples == "exact":
            runs = [r for r in self.ledger.runs(self.data_set, privacy.accountant) if r.run_id == self.run_id]
            epsilon_run = runs[0].account.epsilon(privacy.delta) if runs else 0.0
        log(INFO, "privacy: %s at epsilon %.3g over every run%s", self.data_set.description,
            spent.epsilon(privacy.delta), f" of budget {budget:g}" if budget else "")
        return PrivacyReport(fits_next_round=fits, epsilon_run=epsilon_run)


def client_from_context(context: Context, config: EngineConfig) -> VerlClient:
    """Build the client for this node: its partition, its privacy ledger (and optionally its own
    epsilon budget) come from ``node_config``."""
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    config = with_node_budget(config, context.node_config.get(NODE_EPSILON_BUDGET))
    config, reward_model_key = with_node_reward_model(config, context.node_config.get(NODE_REWARD_MODEL_PATH))
    budget = LocalBudget.from_node_config(context.node_config)
    client_epsilon_budget = node_client_epsilon_budget(context.node_config.get(NODE_CLIENT_EPSILON_BUDGET))
    config = with_node_corpus(config, context.node_config.get(NODE_DEIDENTIFY_CORPUS))
    return VerlClient(
        config,
        cached_rows(config, "train", partition_id, num_partitions),
        cached_rows(config, config.data.eval_split, partition_id, num_partitions),
        partition_id=partition_id, client_id=context.node_config.get(NODE_CLIENT_ID),
        ledger=node_ledger(context) if config.privacy.enabled or config.privacy.client_level.enabled else None,
        run_id=str(context.run_id), reward_model_key=reward_model_key, budget=budget,
        error_feedback=StateErrorFeedback(context.state),
        client_epsilon_budget=client_epsilon_budget,
    )


def describe_source(config: EngineConfig) -> str:
    """Where the training prompts come from, for ``flwr-verl ledger show``."""
    data = config.data
    return f"files {data.train_files}" if data.train_files else f"task {data.task!r} seed {config.trainer.seed}"


