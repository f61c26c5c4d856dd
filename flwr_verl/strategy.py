"""FedProx for LoRA adapters, as a Flower ``Strategy`` that works with or without SecAgg+.

What the server does each round:

1. ``configure_fit``: sample clients and send them the global adapter, ``proximal_mu``, the
   round number, the local iteration count and the SecAgg+ bounds; each client adds
   mu/2 * ||theta - theta_global||^2 to its objective (mu = 0 is FedAvg).
2. ``aggregate_fit``: form the num_examples-weighted mean of the client *updates* (under
   SecAgg+ that mean arrives already aggregated, identical in every ``FitRes``: the server never
   sees one client's update), treat it as a pseudo-gradient and take one server-optimizer step:
   ``sgd`` with lr 1 is FedAvg/FedProx, ``momentum`` is FedAvgM, ``adam`` is FedAdam.
3. Aggregate the clients' metrics: num_examples-weighted means, and the maximum epsilon.
4. ``configure_evaluate``/``aggregate_evaluate``: greedy reward on the clients' held-out prompts.

Faults, and what the strategy does about them:

- A client that fails (its fit raised, it timed out, its node died) is a failure of the round:
  logged with the client's own one-line reason and recorded in the round's ``failures``. Its
  update is never aggregated. The round goes on with the other clients.
- A round in which nothing can be aggregated raises ``RoundFailed`` carrying the clients'
  messages: the run ends with that error, and the global adapter stays what it was after the
  last completed round (which the run directory holds).
- A result with NaN or infinity (or, under SecAgg+, a non-finite aggregate) is rejected, never
  applied to the global adapter.
- A client that refused a round for its privacy budget, or that reports that one more round
  would exceed it (``epsilon_next > epsilon_budget``), is not sampled again. When fewer than
  ``min-fit-clients`` clients can still train, ``configure_fit`` raises ``StopFederation`` and
  the server ends the run normally after the last completed round.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.app import Error
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.criterion import Criterion
from flwr.server.strategy import Strategy
from flwr.server.strategy.aggregate import aggregate

from flwr_verl.config import FederationConfig, FlwrVerlError

Failures = list[tuple[ClientProxy, FitRes] | BaseException]
MAX_METRICS = ("epsilon_total", "epsilon_round")  # the federation is as private as its least private client
SUM_METRICS = ("bytes_received", "bytes_sent")


STATUS_BUDGET = "privacy_budget_exhausted"  # what flwr_verl.client reports when it refuses a round
MAX_REASON = 400  # characters of one client's failure reason kept in logs and errors


class RoundFailed(FlwrVerlError, RuntimeError):
    """No client update could be aggregated in a round."""


class StopFederation(Exception):
    """Not an error: too few clients can still train (privacy budgets spent); end the run after
    the last completed round."""


def describe_failure(failure: tuple[ClientProxy, FitRes] | BaseException) -> str:
    """One line per failed client: its own reason, without Flower's wrapping or a traceback."""
    if isinstance(failure, BaseException):
        error = failure.args[0] if failure.args else failure
        text = (f"{error.reason or ''} (Flower error code {error.code})" if isinstance(error, Error)
                else f"{type(failure).__name__}: {failure}")
    else:
        proxy, res = failure
        text = f"client {proxy.cid}: {res.status.code.name} {res.status.message}"
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def describe_failures(failures: Failures) -> list[str]:
    """``describe_failure`` for each failed client once (Flower's SecAgg+ workflow lists a client
    that failed in the fit stage twice, with the same error object)."""
    seen: set[int] = set()
    out = []
    for failure in failures:
        key = id(failure.args[0]) if isinstance(failure, BaseException) and failure.args else id(failure)
        if key not in seen:
            seen.add(key)
            out.append(describe_failure(failure))
    return out


class _Not(Criterion):
    def __init__(self, excluded: set[str]) -> None:
        self.excluded = excluded

    def select(self, client: ClientProxy) -> bool:
        return client.cid not in self.excluded


def aggregate_metrics(metrics: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
    """Weighted means of numeric metrics (weights: num_examples); max for epsilon; sums for bytes."""
    keys = {k for _, m in metrics for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out: dict[str, Scalar] = {}
    for key in sorted(keys - {"partition_id"}):
        pairs = [(n, float(m[key])) for n, m in metrics if key in m and math.isfinite(float(m[key]))]
        if not pairs:
            continue
        if key in MAX_METRICS:
            out[key] = max(v for _, v in pairs)
        elif key in SUM_METRICS:
            out[key] = sum(v for _, v in pairs)
        else:
            total = sum(n for n, _ in pairs)
            out[key] = sum(n * v for n, v in pairs) / total if total else float(np.mean([v for _, v in pairs]))
    return out


class FedProxAdapters(Strategy):
    """FedProx over adapter updates, with an optional server optimizer; SecAgg+-compatible."""

    def __init__(self, config: FederationConfig, initial_arrays: NDArrays, *, local_iterations: int,
                 secure_aggregation: dict[str, Scalar] | None = None, round_offset: int = 0,
                 privacy_ledger: dict[str, list] | None = None, server_optimizer_state: dict | None = None,
                 on_round_end: Callable[[int, dict], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.local_iterations = local_iterations
        self.secure_aggregation = secure_aggregation  # SecAgg+ bounds sent to clients, None when off
        self.round_offset = round_offset  # rounds already done before a resume
        self.privacy_ledger = dict(privacy_ledger or {})
        self.on_round_end = on_round_end
        self.weights = [torch.tensor(a, dtype=torch.float64) for a in initial_arrays]
        self.optimizer = self._make_server_optimizer()
        if server_optimizer_state:
            self.optimizer.load_state_dict(server_optimizer_state)
        self.round_record: dict = {}
        self.last_completed_round = round_offset  # the round the global adapter comes from
        self.exhausted: dict[str, str] = {}  # client cid -> why it is no longer sampled (privacy budget)
        self._round_start = time.perf_counter()

    def __repr__(self) -> str:
        return f"FedProxAdapters(mu={self.config.proximal_mu}, server_optimizer={self.config.server_optimizer})"

    def _make_server_optimizer(self) -> torch.optim.Optimizer:
        for w in self.weights:
            w.requires_grad_(True)
        lr, kind = self.config.server_learning_rate, self.config.server_optimizer
        if kind == "adam":
            return torch.optim.Adam(self.weights, lr=lr, betas=(0.9, 0.99), eps=1e-9)
        return torch.optim.SGD(self.weights, lr=lr, momentum=self.config.server_momentum if kind == "momentum" else 0)

    @property
    def global_arrays(self) -> NDArrays:
        return [w.detach().numpy().astype(np.float32) for w in self.weights]

    # ------------------------------------------------------------------ fit
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.global_arrays)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self._round_start = time.perf_counter()
        config: dict[str, Scalar] = {
            "server_round": server_round + self.round_offset,
            "proximal_mu": self.config.proximal_mu,
            "local_iterations": self.local_iterations,
            "planned_iterations": self.local_iterations * (self.config.num_server_rounds),
            "privacy_ledger": json.dumps(self.privacy_ledger),
            "fail_partition": self.config.inject_failure_partition,
        }
        if self.secure_aggregation:
            config.update(self.secure_aggregation)
        num_available = client_manager.num_available()
        eligible = num_available - len(self.exhausted.keys() & set(client_manager.all()))
        if self.exhausted and eligible < self.config.min_fit_clients:
            raise StopFederation(
                f"only {eligible} of {num_available} clients can train another round within their privacy "
                f"budget (min-fit-clients={self.config.min_fit_clients}); stopping after round "
                f"{self.last_completed_round}. Exhausted: {sorted(self.exhausted.values())}")
        sample_size = max(int(eligible * self.config.fraction_fit), self.config.min_fit_clients)  # <= eligible
        clients = client_manager.sample(num_clients=sample_size, min_num_clients=self.config.min_available_clients,
                                        criterion=_Not(set(self.exhausted)) if self.exhausted else None)
        return [(client, FitIns(parameters, config)) for client in clients]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: Failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        round_number = server_round + self.round_offset
        messages = describe_failures(failures)
        for _, res in results:
            if "privacy_history" in res.metrics:
                owner = str(res.metrics.get("client_id", res.metrics.get("partition_id")))
                self.privacy_ledger[owner] = json.loads(str(res.metrics["privacy_history"]))
        self._note_budgets(results)
        refused = [(p, r) for p, r in results if r.metrics.get("status") == STATUS_BUDGET]
        contributing = [(p, r) for p, r in results if r.num_examples > 0 and r.metrics.get("status") != STATUS_BUDGET]
        if not self.secure_aggregation:  # in the clear: check every update (clients already refuse non-finite ones)
            finite = [all(np.isfinite(a).all() for a in parameters_to_ndarrays(r.parameters)) for _, r in contributing]
            messages += [f"client {p.cid} (partition {r.metrics.get('partition_id', '?')}): non-finite update "
                         "rejected" for (p, r), ok in zip(contributing, finite) if not ok]
            contributing = [pair for pair, ok in zip(contributing, finite) if ok]
        for message in messages:
            log(WARNING, "round %s: client failure: %s", round_number, message)
        if not contributing:
            if refused and len(refused) == len(results) and not messages:
                raise StopFederation(f"round {round_number}: every sampled client refused to train: its privacy "
                                     f"budget is spent; stopping after round {self.last_completed_round}")
            raise RoundFailed(f"round {round_number}: no client update to aggregate; "
                              f"{len(refused)} refused for their privacy budget, {len(messages)} failed: "
                              + ("; ".join(messages) or "no failure reported"))
        if self.secure_aggregation:
            # SecAgg+ hands every FitRes the same, already weighted, mean.
            mean_update = parameters_to_ndarrays(contributing[0][1].parameters)
            if not all(np.isfinite(a).all() for a in mean_update):
                raise RoundFailed(f"round {round_number}: the securely aggregated update is not finite; "
                                  "the global adapter is left unchanged")
        else:
            mean_update = aggregate([(parameters_to_ndarrays(r.parameters), r.num_examples) for _, r in contributing])
        self._server_step(mean_update)

        metrics = aggregate_metrics([(r.num_examples, r.metrics) for _, r in contributing])
        metrics.update(num_clients=len(contributing), num_failures=len(messages), num_refused=len(refused))
        self.round_record = {"round": round_number, "fit": metrics, "failures": messages,
                             "clients": sorted(int(r.metrics.get("partition_id", -1)) for _, r in contributing),
                             "update_max_abs": float(max(np.abs(u).max() for u in mean_update))}
        log(INFO, "round %s: reward %.3f -> %.3f, kl %.4f, epsilon %s, %s clients, %s failed, %s refused",
            round_number, metrics.get("reward_before", math.nan), metrics.get("reward_after", math.nan),
            metrics.get("kl", math.nan), f"{metrics['epsilon_total']:.2f}" if "epsilon_total" in metrics else "off",
            len(contributing), len(messages), len(refused))
        return ndarrays_to_parameters(self.global_arrays), metrics

    def _note_budgets(self, results: list[tuple[ClientProxy, FitRes]]) -> None:
        """Stop sampling clients that refused, or that one more round would take past their budget."""
        for proxy, res in results:
            m = res.metrics
            budget, after_next = float(m.get("epsilon_budget", 0.0) or 0.0), float(m.get("epsilon_next", 0.0) or 0.0)
            if m.get("status") == STATUS_BUDGET or (budget and after_next > budget):
                why = (f"partition {m.get('partition_id', '?')}: epsilon {float(m.get('epsilon_total', 0.0)):.3g} "
                       f"spent, {after_next:.3g} after one more round > budget {budget:g}")
                if proxy.cid not in self.exhausted:
                    log(INFO, "privacy budget: %s; not sampled again", why)
                self.exhausted[proxy.cid] = why

    def _server_step(self, mean_update: NDArrays) -> None:
        """The mean update is a descent direction: its negative is the pseudo-gradient."""
        for weight, update in zip(self.weights, mean_update, strict=True):
            weight.grad = -torch.as_tensor(np.asarray(update), dtype=torch.float64)
        self.optimizer.step()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        every = self.config.evaluate_every
        if not every or self.config.fraction_evaluate == 0 or server_round % every:
            return []
        num_available = client_manager.num_available()
        sample_size = max(int(num_available * self.config.fraction_evaluate), self.config.min_evaluate_clients)
        clients = client_manager.sample(num_clients=sample_size, min_num_clients=self.config.min_available_clients)
        return [(client, EvaluateIns(parameters, {"server_round": server_round + self.round_offset}))
                for client in clients]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list) -> tuple[float | None, dict[str, Scalar]]:
        for failure in failures:
            log(WARNING, "round %s: evaluation failure: %s", server_round + self.round_offset,
                describe_failure(failure))
        results = [(p, r) for p, r in results if r.num_examples > 0]
        if not results:
            return None, {}
        loss = sum(r.num_examples * r.loss for _, r in results) / sum(r.num_examples for _, r in results)
        metrics = aggregate_metrics([(r.num_examples, r.metrics) for _, r in results])
        self.round_record["evaluate"] = metrics
        log(INFO, "round %s: held-out greedy reward %.3f", server_round + self.round_offset,
            metrics.get("reward", math.nan))
        return loss, metrics

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return None  # no central data: the server holds none of the clients' prompts

    # ------------------------------------------------------------------ bookkeeping
    def finish_round(self, server_round: int) -> None:
        """Called by the server workflow once a round (fit and evaluate) is over."""
        record = self.round_record
        if record.get("round") != server_round + self.round_offset:
            raise RoundFailed(f"round {server_round + self.round_offset}: no update was aggregated "
                              "(under SecAgg+: too few clients completed the protocol; see the clients' logs)")
        record["seconds"] = time.perf_counter() - self._round_start
        self.last_completed_round = record["round"]
        if self.on_round_end:
            self.on_round_end(record["round"], record)
