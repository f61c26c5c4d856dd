"""The Flower client: a ``NumPyClient`` that runs the local RL engine on one organisation's data.

Each round the server sends the global adapter weights. ``fit`` loads them, runs
``trainer.local_iterations`` RL iterations with FedProx's term anchored at them, and returns the
*update* (new minus global adapter weights), in float64 under SecAgg+. SecAgg+'s rounding error
scales with its clipping range, and updates fit a smaller range than weights: at the same range
both aggregate equally accurately (2.9e-9 vs 2.8e-9 max error, ``benchmarks/secagg_overhead.py``),
at a range fitted to the updates the error shrinks with it. The update is also what the server's
optimizer needs (its pseudo-gradient). Only adapter arrays ever leave the client.

Per-client state that must outlive one message (the DP accountant's history) lives in the
Flower ``Context.state``; models are cached per process, since Flower builds a fresh client for
every message.

What a client refuses to send, and says why (each a ``FlwrVerlError`` that the ClientApp's
``concise_errors`` mod turns into a one-line error reply naming the partition):

- parameters of the wrong count or shape (another model's adapter): ``AdapterShapeError`` with
  the expected and received shapes, before anything is trained;
- an update with NaN or infinity: ``NonFiniteUpdate``;
- an update that SecAgg+ would clip: ``UpdateOutOfRange``.

A round that would spend more than the client's epsilon budget is refused, not failed: a zero
update with weight 0 and ``status = "privacy_budget_exhausted"``. After every fit the client
also reports ``epsilon_next`` (what one more round would bring it to), so the strategy stops
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
import json
import math
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context
from flwr.client import NumPyClient

from flwr_verl.config import ConfigError, EngineConfig, FlwrVerlError
from flwr_verl.data import Row, load_rows
from flwr_verl.models import Models, build_models
from flwr_verl.privacy import History, epsilon, noise_for_target_epsilon, record_iterations, sample_rate
from flwr_verl.rewards import PROMPT_KEY, checked, resolve_compute_score
from flwr_verl.secagg import check_update, exact_update
from flwr_verl.trainer import LocalPPOTrainer

STATE_KEY = "flwr_verl"
STATUS_OK = "ok"
STATUS_BUDGET = "privacy_budget_exhausted"
NODE_EPSILON_BUDGET = "epsilon-budget"  # node-config key: this node's own budget, when stricter than the run's
NODE_CLIENT_ID = "client-id"  # node-config key: this client's name in the server's privacy ledger

_MODELS: dict[str, Models] = {}
_ROWS: dict[str, list[Row]] = {}


class NonFiniteUpdate(FlwrVerlError, ValueError):
    """Local training produced NaN or infinity; the update is not sent."""


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
        compute_score = compute_score or resolve_compute_score(config.custom_reward_function, config.data)
        preflight_reward(compute_score, train_rows or val_rows)
        self.trainer = LocalPPOTrainer(config, train_rows, models=models or cached_models(config),
                                       compute_score=compute_score)
        self.adapters = self.trainer.models.adapters
        self.state = state if state is not None else ConfigRecord()

    # ------------------------------------------------------------------ Flower API
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return self.adapters.get_arrays()

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        start = time.perf_counter()
        self.adapters.set_arrays(parameters)  # AdapterShapeError names expected and received shapes
        if config.get("fail_partition", -1) == self.partition_id:  # fault injection for tests
            raise RuntimeError(f"injected failure in partition {self.partition_id}")
        iterations = int(config.get("local_iterations", self.config.trainer.local_iterations))
        server_round = int(config.get("server_round", 0))
        history = self._privacy_history(config)
        privacy = self.config.privacy
        sigma = self._noise_multiplier(config)
        metrics: dict[str, Any] = {"partition_id": self.partition_id, "client_id": self.client_id,
                                   "bytes_received": _nbytes(parameters)}

        q = sample_rate(self.config.data.train_batch_size, len(self.train_rows)) if privacy.enabled else 0.0
        if privacy.enabled:
            planned = record_iterations(history, sigma, self.config.actor.ppo_epochs, q, iterations)
            spent, would_spend = epsilon(history, privacy.delta, privacy.accountant), \
                epsilon(planned, privacy.delta, privacy.accountant)
            if privacy.epsilon_budget and would_spend > privacy.epsilon_budget:
                # Refuse: a zero update with zero weight, which every aggregation ignores.
                return [np.zeros_like(p) for p in parameters], 0, {
                    **metrics, "status": STATUS_BUDGET, "epsilon_total": spent, "epsilon_round": 0.0,
                    "epsilon_budget": privacy.epsilon_budget, "epsilon_next": would_spend,
                    "privacy_history": json.dumps(history),
                }

        anchor = [torch.as_tensor(a) for a in parameters[: len(self.trainer.policy_params)]]
        result = self.trainer.fit(
            iterations, anchor=anchor, proximal_mu=float(config.get("proximal_mu", 0.0)),
            privacy_history=history, noise_multiplier=sigma,
            seed=self.config.trainer.seed + 100_003 * server_round + 7919 * self.partition_id,
        )
        if privacy.enabled:  # spent whether or not the update is sent: record it first
            self.state["privacy_history"] = json.dumps(result.privacy_history)
        secure = "secagg_clipping_range" in config
        # SecAgg+ quantizes in the dtype it receives: float64 keeps its 2e-9 steps (float32 alone
        # would cost ~1e-7), at no cost on the wire, where masked int64 vectors travel either way.
        update = (exact_update(self.adapters.get_arrays(), parameters) if secure
                  else [new - old for new, old in zip(self.adapters.get_arrays(), parameters)])
        if bad := [name for name, a in zip(self.adapters.names, update) if not np.isfinite(a).all()]:
            raise NonFiniteUpdate(f"the local update has NaN or inf in {len(bad)} of {len(update)} arrays "
                                  f"(first: {bad[0]}); not sent. Lower actor.lr or check the reward function")
        if secure:
            check_update(update, len(self.train_rows), float(config["secagg_clipping_range"]),
                         float(config["secagg_max_weight"]))

        if privacy.enabled:
            total = epsilon(result.privacy_history, privacy.delta, privacy.accountant)
            metrics.update(epsilon_total=total, epsilon_round=total - epsilon(history, privacy.delta,
                                                                              privacy.accountant),
                           noise_multiplier=sigma, privacy_history=json.dumps(result.privacy_history))
            if privacy.epsilon_budget:
                after_next = record_iterations(result.privacy_history, sigma, self.config.actor.ppo_epochs, q,
                                               iterations)
                metrics.update(epsilon_budget=privacy.epsilon_budget,
                               epsilon_next=epsilon(after_next, privacy.delta, privacy.accountant))
        iters = [m for m in result.metrics if m.get("prompts", 0) > 0] or [{}]
        metrics.update(
            status=STATUS_OK,
            reward_before=iters[0].get("reward_mean", math.nan), reward_after=iters[-1].get("reward_mean", math.nan),
            reward_mean=float(np.mean([m.get("reward_mean", math.nan) for m in iters])),
            kl=float(np.mean([m.get("kl", math.nan) for m in iters])),
            response_length=float(np.mean([m.get("response_length", math.nan) for m in iters])),
            pg_loss=float(np.mean([m.get("pg_loss", math.nan) for m in iters])),
            bytes_sent=_nbytes(update),
            time_fit=time.perf_counter() - start,
            **{key: float(sum(m.get(key, 0.0) for m in result.metrics))
               for key in ("time_rollout", "time_reward", "time_log_prob", "time_advantage", "time_update")},
        )
        return update, len(self.train_rows), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        self.adapters.set_arrays(parameters)
        result = self.trainer.evaluate(self.val_rows)
        if not result:
            return 0.0, 0, {}
        return 1.0 - result["reward"], len(self.val_rows), result

    # ------------------------------------------------------------------ privacy state
    def _privacy_history(self, config: dict[str, Any]) -> History:
        """The longer of this client's own record and the server's ledger (which survives restarts)."""
        own = json.loads(str(self.state.get("privacy_history", "[]")))
        ledger = json.loads(str(config.get("privacy_ledger", "{}"))).get(self.client_id, [])
        longest = max([own, ledger], key=lambda h: sum(steps for *_, steps in h))
        return [tuple(entry) for entry in longest]

    def _noise_multiplier(self, config: dict[str, Any]) -> float:
        privacy = self.config.privacy
        if not privacy.enabled or not privacy.target_epsilon:
            return privacy.noise_multiplier
        total_iterations = int(config.get("planned_iterations", self.config.trainer.local_iterations))
        q = sample_rate(self.config.data.train_batch_size, len(self.train_rows))
        return noise_for_target_epsilon(privacy, q, total_iterations, self.config.actor.ppo_epochs)


def client_from_context(context: Context, config: EngineConfig) -> VerlClient:
    """Build the client for this node: its partition (and optionally its own epsilon budget)
    come from ``node_config``."""
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    config = with_node_budget(config, context.node_config.get(NODE_EPSILON_BUDGET))
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
