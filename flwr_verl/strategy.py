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
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy
from flwr.server.strategy.aggregate import aggregate

from flwr_verl.config import FederationConfig, FlwrVerlError

Failures = list[tuple[ClientProxy, FitRes] | BaseException]
MAX_METRICS = ("epsilon_total", "epsilon_round")  # the federation is as private as its least private client
SUM_METRICS = ("bytes_received", "bytes_sent")


class RoundFailed(FlwrVerlError, RuntimeError):
    """No client update could be aggregated in a round."""


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
        sample_size = max(int(num_available * self.config.fraction_fit), self.config.min_fit_clients)
        clients = client_manager.sample(num_clients=sample_size, min_num_clients=self.config.min_available_clients)
        return [(client, FitIns(parameters, config)) for client in clients]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: Failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        round_number = server_round + self.round_offset
        messages = [str(f) if isinstance(f, BaseException) else f"{f[0].cid}: {f[1].status.message}"
                    for f in failures]
        for message in messages:
            log(WARNING, "round %s: client failure: %s", round_number, message)
        contributing = [(proxy, res) for proxy, res in results if res.num_examples > 0]
        for _, res in results:
            if "privacy_history" in res.metrics:
                self.privacy_ledger[str(res.metrics["partition_id"])] = json.loads(str(res.metrics["privacy_history"]))
        if not contributing:
            refused = [str(res.metrics.get("status")) for _, res in results]
            raise RoundFailed(f"round {round_number}: no client update to aggregate "
                              f"(answers: {refused}; failures: {messages})")
        if self.secure_aggregation:
            # SecAgg+ hands every FitRes the same, already weighted, mean.
            mean_update = parameters_to_ndarrays(contributing[0][1].parameters)
        else:
            mean_update = aggregate([(parameters_to_ndarrays(r.parameters), r.num_examples) for _, r in contributing])
        self._server_step(mean_update)

        metrics = aggregate_metrics([(r.num_examples, r.metrics) for _, r in contributing])
        metrics.update(num_clients=len(contributing), num_failures=len(failures),
                       num_refused=len(results) - len(contributing))
        self.round_record = {"round": round_number, "fit": metrics, "failures": messages,
                             "update_max_abs": float(max(np.abs(u).max() for u in mean_update))}
        log(INFO, "round %s: reward %.3f -> %.3f, kl %.4f, epsilon %s", round_number,
            metrics.get("reward_before", math.nan), metrics.get("reward_after", math.nan),
            metrics.get("kl", math.nan), f"{metrics['epsilon_total']:.2f}" if "epsilon_total" in metrics else "off")
        return ndarrays_to_parameters(self.global_arrays), metrics

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
        if self.on_round_end:
            self.on_round_end(record["round"], record)
