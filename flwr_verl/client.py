"""The Flower client: a ``NumPyClient`` that runs the local RL engine on one organisation's data.

Each round the server sends the global adapter weights. ``fit`` loads them, runs
``trainer.local_iterations`` RL iterations with FedProx's term anchored at them, and returns the
*update* (new minus global adapter weights), in float64 under SecAgg+. SecAgg+'s rounding error
scales with its clipping range, and updates fit a smaller range than weights: at the same range
both aggregate equally accurately (2.9e-9 vs 2.8e-9 max error, ``benchmarks/secagg_overhead.py``),
at a range fitted to the updates the error shrinks with it. The update is also what the server's
optimizer needs (its pseudo-gradient). Only adapter arrays ever leave the client.

The instructions arrive as a ``protocol.FitConfig`` and the report leaves as a
``protocol.FitReport``. Per-client state that must outlive one message (the ``PrivacyAccount``)
lives in the Flower ``Context.state``, merged each round with the server's copy of this client's
own account; models are cached per process, since Flower builds a fresh client for every message.

What a client refuses to send, and says why (each a ``FlwrVerlError`` that the ClientApp's
``concise_errors`` mod turns into a one-line error reply naming the partition):

- parameters of the wrong count or shape (another model's adapter): ``AdapterShapeError`` with
  the expected and received shapes, before anything is trained;
- an update with NaN or infinity: ``NonFiniteUpdate``;
- an update that SecAgg+ would clip: ``UpdateOutOfRange``.

A round that would spend more than the client's epsilon budget is refused, not failed: a zero
update with weight 0 and status ``STATUS_BUDGET``; under SecAgg+ the client leaves the round
instead (``PrivacyBudgetExhausted``), so that every participant the server unmasks is a real
contributor. After every fit the client also reports
``epsilon_next`` (what one more round would bring it to), so the strategy stops
sampling it before it has to refuse. The budget is ``privacy.epsilon_budget`` from the run
config, or the node's own ``epsilon-budget`` from its node config when that is stricter: the
data owner can always spend less of its data's privacy than the federation's config allows.

Node config keys read here: ``partition-id`` and ``num-partitions`` (which share of the data
this node trains on), ``epsilon-budget`` (above), and ``client-id``: the name under which the
server's privacy ledger keeps this client's accounting (default: the partition id). Set it when
organisations bring their own data (``partition-id=0 num-partitions=1`` on every node), so that
their ledgers do not collide.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context
from flwr.client import NumPyClient

from flwr_verl.config import ConfigError, EngineConfig, FlwrVerlError
from flwr_verl.data import Row, load_rows
from flwr_verl.models import Models, build_models, check_lengths
from flwr_verl.privacy import IterationMechanism, PrivacyAccount, noise_for_target_epsilon, sample_rate
from flwr_verl.protocol import (
    STATUS_BUDGET,
    STATUS_OK,
    FitConfig,
    FitReport,
    PreflightConfig,
    PrivacyReport,
    TrainingSummary,
)
from flwr_verl.rewards import PROMPT_KEY, checked, resolve_compute_score
from flwr_verl.secagg import check_update, exact_update
from flwr_verl.trainer import LocalPPOTrainer

STATE_KEY = "flwr_verl"
NODE_EPSILON_BUDGET = "epsilon-budget"  # node-config key: this node's own budget, when stricter than the run's
NODE_CLIENT_ID = "client-id"  # node-config key: this client's name in the server's privacy ledger
NODE_DEIDENTIFY_CORPUS = "deidentify-corpus-file"  # node-config key: this node's protected text (deidentify.py)

_MODELS: dict[str, Models] = {}
_ROWS: dict[str, list[Row]] = {}


class NonFiniteUpdate(FlwrVerlError, ValueError):
    """Local training produced NaN or infinity; the update is not sent."""


class PrivacyBudgetExhausted(FlwrVerlError, RuntimeError):
    """Under SecAgg+, a round that would pass the client's epsilon budget: the client leaves the
    protocol instead of taking part with weight 0. A zero-weight participant still counts towards
    the reconstruction threshold, so the server could unmask a "sum" of fewer real contributors
    than the threshold promises (one client's exact update, when all others refuse)."""


def cached_models(config: EngineConfig) -> Models:
    """One set of models per process and model config (Flower re-creates clients per message)."""
    key = repr((config.model, config.needs_critic, config.trainer.seed))
    if key not in _MODELS:
        _MODELS[key] = build_models(config.model, config.needs_critic, seed=config.trainer.seed)
    return _MODELS[key]


def cached_rows(config: EngineConfig, split: str, partition_id: int, num_partitions: int) -> list[Row]:
    key = repr((config.data, split, partition_id, num_partitions, config.trainer.seed))
    if key not in _ROWS:
        _ROWS[key] = load_rows(config.data, split, config.trainer.seed, partition_id, num_partitions)
    return _ROWS[key]


def preflight_reward(compute_score, rows: list[Row]) -> None:
    """Score an empty response to the first prompt once, before any training: a reward function
    that raises or returns something other than a finite number fails here with a ``RewardError``
    naming the function, not after the first rollout."""
    if not rows:
        return
    row = rows[0]
    checked(compute_score)(row["data_source"], "", row["reward_model"]["ground_truth"],
                           {**row.get("extra_info", {}), PROMPT_KEY: row["prompt"][-1]["content"]})


def summarize_training(iterations: list[dict[str, float]], seconds: float) -> TrainingSummary:
    """One fit's iteration metrics as the report's summary (iterations without prompts, empty
    Poisson draws, carry no training metrics)."""
    trained = [m for m in iterations if m.get("prompts", 0) > 0] or [{}]

    def mean(key: str) -> float:
        return float(np.mean([m.get(key, math.nan) for m in trained]))

    return TrainingSummary(
        reward_before=trained[0].get("reward_mean", math.nan), reward_after=trained[-1].get("reward_mean", math.nan),
        reward_mean=mean("reward_mean"), kl=mean("kl"), response_length=mean("response_length"),
        pg_loss=mean("pg_loss"), time_fit=seconds,
        **{f"time_{phase}": float(sum(m.get(f"time_{phase}", 0.0) for m in iterations))
           for phase in ("rollout", "reward", "log_prob", "advantage", "update")},
    )


def _nbytes(arrays: list[np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays))


class VerlClient(NumPyClient):
    """Federated RLHF client: verl PPO on LoRA adapters, under Opacus DP, exchanging adapter updates."""

    def __init__(self, config: EngineConfig, train_rows: list[Row], val_rows: list[Row], *,
                 partition_id: int = 0, models: Models | None = None, state: ConfigRecord | None = None,
                 compute_score=None, client_id: str | None = None) -> None:
        self.config = config
        self.partition_id = partition_id
        self.client_id = str(partition_id) if client_id is None else str(client_id)
        self.train_rows, self.val_rows = train_rows, val_rows
        privacy = config.privacy
        if privacy.enabled and train_rows and privacy.delta >= 1 / len(train_rows):
            raise ConfigError(f"privacy.delta={privacy.delta} is invalid for {len(train_rows)} private prompts: "
                              f"it must be below 1/N = {1 / len(train_rows):.3g} (at delta >= 1/N a mechanism may "
                              "publish one prompt outright and still meet the guarantee)")
        compute_score = checked(compute_score or resolve_compute_score(config.custom_reward_function, config.data),
                                config.custom_reward_function.clip)
        preflight_reward(compute_score, train_rows or val_rows)
        models = models or cached_models(config)
        check_lengths(config, models, train_rows + val_rows)
        self.trainer = LocalPPOTrainer(config, train_rows, models=models, compute_score=compute_score)
        self.adapters = self.trainer.models.adapters
        self.state = state if state is not None else ConfigRecord()

    # ------------------------------------------------------------------ Flower API
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return self.adapters.get_arrays()

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """The preflight (``protocol.PreflightConfig``): building this client already loaded its
        model and data and scored one response; here the batch sizes and SecAgg+ bounds are
        checked against its own data. Any problem raises, and reaches the server as one line."""
        instructions = PreflightConfig.from_config(config)
        sample_rate(self.config.data.train_batch_size, len(self.train_rows))
        if instructions.secagg and len(self.train_rows) > instructions.secagg.max_weight:
            raise ConfigError(f"secagg.max-weight={instructions.secagg.max_weight:g} is invalid: this client has "
                              f"{len(self.train_rows)} training prompts, and SecAgg+ would overflow a larger weight; "
                              "raise secagg.max-weight to at least every client's number of prompts")
        return {"status": STATUS_OK}

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        start = time.perf_counter()
        instructions = FitConfig.from_config(config)
        self.adapters.set_arrays(parameters)  # AdapterShapeError names expected and received shapes
        if instructions.fail_partition == self.partition_id:  # fault injection for tests
            raise RuntimeError(f"injected failure in partition {self.partition_id}")
        iterations = instructions.local_iterations
        account = self._account(instructions)
        mechanism = self._mechanism(instructions)
        report = FitReport(status=STATUS_OK, partition_id=self.partition_id, client_id=self.client_id,
                           bytes_received=_nbytes(parameters), bytes_sent=0)

        budget = self.config.privacy.epsilon_budget
        if mechanism is not None and budget and account.after(mechanism, iterations).epsilon(
                self.config.privacy.delta) > budget:
            refusal = dataclasses.replace(report, status=STATUS_BUDGET,
                                          privacy=self._privacy_report(account, account, mechanism, iterations))
            if instructions.secagg:
                raise PrivacyBudgetExhausted(
                    f"one more round would spend epsilon {refusal.privacy.epsilon_next:.3g} > budget {budget:g}; "
                    "leaving the SecAgg+ round")
            # In the clear: a zero update with zero weight, which every aggregation ignores.
            return [np.zeros_like(p) for p in parameters], 0, refusal.to_metrics()

        result = self.trainer.fit(
            iterations, anchor=parameters[: len(self.trainer.policy_params)], proximal_mu=instructions.proximal_mu,
            noise_multiplier=mechanism.noise_multiplier if mechanism else None,
            seed=self.config.trainer.seed + 100_003 * instructions.server_round + 7919 * self.partition_id,
        )
        spent = account
        if result.mechanism is not None:  # spent whether or not the update is sent: record it first
            spent = account.after(result.mechanism, result.iterations)
            self.state["privacy_account"] = spent.to_json()
        # SecAgg+ quantizes in the dtype it receives: float64 keeps its 2e-9 steps (float32 alone
        # would cost ~1e-7), at no cost on the wire, where masked int64 vectors travel either way.
        new = self.adapters.get_arrays()
        update = (exact_update(new, parameters) if instructions.secagg
                  else [n - old for n, old in zip(new, parameters)])
        if bad := [name for name, a in zip(self.adapters.names, update) if not np.isfinite(a).all()]:
            raise NonFiniteUpdate(f"the local update has NaN or inf in {len(bad)} of {len(update)} arrays "
                                  f"(first: {bad[0]}); not sent. Lower actor.lr or check the reward function")
        if instructions.secagg:
            check_update(update, len(self.train_rows), instructions.secagg.clipping_range,
                         instructions.secagg.max_weight)
        report = dataclasses.replace(
            report, bytes_sent=_nbytes(update),
            privacy=self._privacy_report(account, spent, result.mechanism, iterations) if result.mechanism else None,
            training=summarize_training(result.metrics, time.perf_counter() - start),
        )
        return update, len(self.train_rows), report.to_metrics()

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        self.adapters.set_arrays(parameters)
        result = self.trainer.evaluate(self.val_rows)
        if result is None:
            return 0.0, 0, {}
        return 1.0 - result.reward, len(self.val_rows), result.to_metrics()

    # ------------------------------------------------------------------ privacy state
    def _account(self, instructions: FitConfig) -> PrivacyAccount:
        """This client's privacy account: its own record (Flower's ``Context.state``) merged
        with the server's copy of it, which survives the node's restarts."""
        saved = self.state.get("privacy_account")
        own = PrivacyAccount.from_json(str(saved)) if saved else PrivacyAccount(self.config.privacy.accountant)
        return own.merge(instructions.privacy_account) if instructions.privacy_account else own

    def _mechanism(self, instructions: FitConfig) -> IterationMechanism | None:
        """What one local iteration will spend; None without privacy."""
        privacy = self.config.privacy
        if not privacy.enabled:
            return None
        q = sample_rate(self.config.data.train_batch_size, len(self.train_rows))
        sigma = (noise_for_target_epsilon(privacy, q, instructions.planned_iterations, self.config.actor.ppo_epochs)
                 if privacy.target_epsilon else privacy.noise_multiplier)
        return IterationMechanism(sigma, q, self.config.actor.ppo_epochs)

    def _privacy_report(self, before: PrivacyAccount, after: PrivacyAccount, mechanism: IterationMechanism,
                        iterations: int) -> PrivacyReport:
        delta = self.config.privacy.delta
        total = after.epsilon(delta)
        return PrivacyReport(
            account=after, epsilon_total=total, epsilon_round=total - before.epsilon(delta),
            epsilon_next=after.after(mechanism, iterations).epsilon(delta),
            epsilon_budget=self.config.privacy.epsilon_budget, noise_multiplier=mechanism.noise_multiplier,
            delta=delta,
        )


def client_from_context(context: Context, config: EngineConfig) -> VerlClient:
    """Build the client for this node: its partition (and optionally its own epsilon budget)
    come from ``node_config``."""
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    config = with_node_budget(config, context.node_config.get(NODE_EPSILON_BUDGET))
    config = with_node_corpus(config, context.node_config.get(NODE_DEIDENTIFY_CORPUS))
    if STATE_KEY not in context.state.config_records:
        context.state.config_records[STATE_KEY] = ConfigRecord()
    return VerlClient(
        config,
        cached_rows(config, "train", partition_id, num_partitions),
        cached_rows(config, "val", partition_id, num_partitions),
        partition_id=partition_id, state=context.state.config_records[STATE_KEY],
        client_id=context.node_config.get(NODE_CLIENT_ID),
    )


def with_node_budget(config: EngineConfig, budget: Any) -> EngineConfig:
    """``config`` with the stricter of its epsilon budget and the node's own ``epsilon-budget``."""
    if budget is None:
        return config
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"node config {NODE_EPSILON_BUDGET}={budget!r} is invalid: must be a number > 0")
    federation_budget = config.privacy.epsilon_budget
    strictest = min(float(budget), federation_budget) if federation_budget > 0 else float(budget)
    return dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, epsilon_budget=strictest))


def with_node_corpus(config: EngineConfig, corpus_file: Any) -> EngineConfig:
    """``config`` with the node's own ``deidentify-corpus-file`` as ``deidentify.corpus_file``:
    each organisation protects its own text, at a path on its own machine."""
    if corpus_file is None:
        return config
    if not isinstance(corpus_file, str):
        raise ConfigError(f"node config {NODE_DEIDENTIFY_CORPUS}={corpus_file!r} is invalid: must be a path string")
    return dataclasses.replace(config, deidentify=dataclasses.replace(config.deidentify, corpus_file=corpus_file))
