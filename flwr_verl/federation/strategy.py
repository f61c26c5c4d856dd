"""FedProx for LoRA adapters, as a Flower ``Strategy`` that works with or without SecAgg+.

What the server does each round:

1. ``configure_fit``: sample clients and send each the global adapter and a
   ``protocol.FitConfig``: ``proximal_mu``, the round number, the local iteration count and the
   SecAgg+ bounds; no privacy history (each node's own ledger is the truth, ``ledger.py``). Each
   client adds mu/2 * ||theta - theta_global||^2 to its objective (mu = 0 is
   FedAvg) and answers with its update and a ``protocol.FitReport``.
2. ``aggregate_fit``: form the num_examples-weighted mean of the client *updates* (under
   SecAgg+ that mean arrives already aggregated, identical in every ``FitRes``: the server never
   sees one client's update), treat it as a pseudo-gradient and take one server-optimizer step:
   ``sgd`` with lr 1 is FedAvg/FedProx, ``momentum`` is FedAvgM (Hsu et al. 2019), ``adam`` is
   FedAdam (Reddi et al. 2021), each with its own default learning rate. With
   ``aggregation = "fednova"`` clients send their update divided by the local iterations they
   ran and the mean is scaled by the mean iteration count (FedNova, Wang et al. 2020;
   ``rounds.fednova_rescale``), so a client with more iterations does not dominate. With
   ``compression.density < 1`` every client sent the same round-seeded coordinates only
   (``compression.py``): the mean of those is scattered back, the rest get no update this round.
   With SecAgg+ off, ``aggregation = "median"`` or ``"trimmed_mean"`` replaces the mean by a
   robust coordinate-wise statistic (Flower's ``aggregate_median``, ``aggregate_trimmed_avg``).
3. Aggregate the clients' reports: num_examples-weighted means of the training metrics (when
   clients send them: ``privacy.metrics``); this run's epsilon, the maximum over every node's
   latest report, when nodes send it (``protocol.PrivacyReport``). Every per-client record is
   keyed by Flower's node id, which SuperNode authentication binds to the node's key, never by
   the ``client_id`` a node gives itself (any node can claim one; two nodes claiming one are
   refused by the preflight).
4. ``configure_evaluate``/``aggregate_evaluate``: greedy reward on the clients' held-out prompts.

Faults, and what the strategy does about them:

- A client that fails (its fit raised, it timed out, its node died) is a failure of the round:
  logged with the client's own one-line reason and recorded in the round's ``failures``. Its
  update is never aggregated. The round goes on with the other clients.
- A round in which nothing can be aggregated raises ``RoundFailed`` carrying the clients'
  messages: the run ends with that error, and the global adapter stays what it was after the
  last completed round (which the run directory holds).
- In the clear, a result with NaN or infinity is rejected, never applied to the global adapter.
- Under SecAgg+ the server cannot see one update, only what n of them sum to. Honest clients
  check their update against the clipping range before masking, so the unmasked mean of honest
  updates lies within it (and, under client-level DP, within a norm bound): an aggregate outside
  fails the round with ``RoundFailed`` (``rounds.check_feasible``) and the global adapter stays as it
  was. A malicious update *inside* the range cannot be told apart: range proofs (RoFL, Lycklama
  et al. 2023; ACORN, Bell et al. 2023) would bound each masked update, and are not in Flower.
  A reported ``num_examples`` above ``secagg.max-weight`` is not counted.
- A client that refused a round for its privacy budget, or that reports that one more round
  would exceed it (``PrivacyReport.fits_next_round``), is not sampled again (its node id is
  remembered in ``state_dict()``, so a resumed run does not sample it either). This only saves
  a round trip: the node's own ledger refuses the round anyway. When fewer than
  ``min-fit-clients`` clients can still train, ``configure_fit`` raises ``StopFederation`` and
  the server ends the run normally after the last completed round.

State that outlives a round (global weights, server optimizer, client labels, exhausted
nodes, the last round's record) is ``state_dict()`` / ``load_state_dict()``, which the server
checkpoints (``checkpoint.py``) after every aggregated round.
"""

from __future__ import annotations

import dataclasses
import time
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
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

from flwr_verl.config import ClientLevelConfig, ConfigError, FederationConfig
from flwr_verl.federation.compression import coordinate_mask, round_seed, scatter
from flwr_verl.federation.protocol import (
    STATUS_BUDGET,
    ClientLevelRound,
    EvaluateConfig,
    EvaluateReport,
    FitConfig,
    FitReport,
    PreflightConfig,
    PrivacyReport,
    ProtocolError,
    SecAggBounds,
    SparseRound,
)
from flwr_verl.federation.rounds import (
    Failures,
    NotIn,
    RoundFailed,
    StopFederation,
    aggregate_in_the_clear,
    budget_spent,
    check_feasible,
    check_preflight,
    describe_failure,
    describe_failures,
    describe_fit,
    fednova_rescale,
    refused_nodes,
    summarize_fit,
    wait_for_clients,
    weighted_mean,
)
from flwr_verl.federation.secagg import MAX_CLIENTS, fewest_survivors
from flwr_verl.privacy.distributed_dp import ClientLevelAccount, SkellamPlan, decode_aggregate, plan_round


def server_optimizer(config: FederationConfig, weights: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The server's optimizer over the global adapter's float64 ``weights``: ``sgd`` (FedAvg and
    FedProx at lr 1), ``momentum`` (FedAvgM) or ``adam`` (FedAdam), at
    ``config.effective_server_learning_rate``."""
    lr, kind = config.effective_server_learning_rate, config.server_optimizer
    if kind == "adam":
        return torch.optim.Adam(weights, lr=lr, betas=(0.9, 0.99), eps=1e-9)
    return torch.optim.SGD(weights, lr=lr, momentum=config.server_momentum if kind == "momentum" else 0.0)


def server_step(optimizer: torch.optim.Optimizer, weights: list[torch.Tensor], mean_update: NDArrays) -> None:
    """One server step: the mean update is a descent direction, so its negative is the
    pseudo-gradient."""
    for weight, update in zip(weights, mean_update, strict=True):
        weight.grad = -torch.as_tensor(np.asarray(update), dtype=torch.float64, device="cpu")
    optimizer.step()
    optimizer.zero_grad()


class FedProxAdapters(Strategy):
    """FedProx over adapter updates, with an optional server optimizer; SecAgg+-compatible.

    Args:
        config: the federation's config: sampling fractions and minimums, ``proximal-mu``, the
            server optimizer and its learning rate, evaluation cadence.
        initial_arrays: the initial global adapter (the same seeded LoRA init every client builds).
        local_iterations: RL iterations each client runs per round.
        secure_aggregation: the SecAgg+ bounds clients check their update against; None when
            updates travel in the clear.
        client_level: client-level DP with distributed noise (``distributed_dp.py``; needs
            ``secure_aggregation``). Each round the server tells clients the number sampled and
            the fewest of them an unmasked aggregate can hold (``secagg.fewest_survivors``),
            decodes the secure sum of their noisy integers (the only aggregate it ever holds), and accounts the round's client-level epsilon at
            the sampling rate sampled / eligible clients; None: off.
        frozen_weights: the fingerprint of the weights that never travel (the base model, and the
            LoRA A factors frozen under ``model.lora_freeze_a``: ``AdapterSet.frozen_fingerprint``),
            which the preflight asks every client to match; "": not checked.
        mask_seed: the run's ``trainer.seed``. Under ``compression.density < 1`` each round's
            coordinate mask is drawn from ``round_seed(mask_seed, round)``, which the server
            sends every client (``protocol.SparseRound``) and uses to scatter the mean back.
    """

    def __init__(self, config: FederationConfig, initial_arrays: NDArrays, *, local_iterations: int,
                 secure_aggregation: SecAggBounds | None = None,
                 client_level: ClientLevelConfig | None = None, frozen_weights: str = "",
                 mask_seed: int = 0) -> None:
        super().__init__()
        if client_level is not None and secure_aggregation is None:
            raise ConfigError("privacy.client_level.enabled=true needs secagg.enabled=true: without SecAgg+ the "
                              "server would see each client's lightly noised update")
        self.config = config
        self.client_level = client_level
        self.client_level_account = ClientLevelAccount()
        self._round_plan: tuple[SkellamPlan, float] | None = None  # this round's plan and sampling rate
        self.local_iterations = local_iterations
        self.secure_aggregation = secure_aggregation
        self.frozen_weights = frozen_weights
        self.mask_seed = mask_seed
        self.weights = [torch.tensor(np.asarray(a), dtype=torch.float64, device="cpu", requires_grad=True)
                        for a in initial_arrays]
        self.optimizer = server_optimizer(config, self.weights)
        self.completed_round = 0  # the round the global adapter comes from, counted across resumes
        self.round_offset = 0  # rounds done before this run started (Flower counts from 1 again)
        # Per-client state, keyed by Flower's node id (``ClientProxy.cid``), never by a client's own name:
        self.privacy_reports: dict[str, PrivacyReport] = {}  # node -> its latest report in this run
        self.client_ids: dict[str, str] = {}  # node -> the name it gave itself (labels logs only)
        self.exhausted: dict[str, str] = {}  # node -> why it is no longer sampled (privacy budget)
        self.last_round: dict[str, Any] = {}  # the record of the newest aggregated round
        self._round_start = time.perf_counter()

    def __repr__(self) -> str:
        return f"FedProxAdapters(mu={self.config.proximal_mu}, server_optimizer={self.config.server_optimizer})"

    @property
    def global_arrays(self) -> NDArrays:
        return [w.detach().numpy().astype(np.float32) for w in self.weights]

    def round_number(self, server_round: int) -> int:
        """Flower's round number of this run as a round of the whole (resumed) federation."""
        return server_round + self.round_offset

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-identically: tensors and JSON values."""
        return {
            "round": self.completed_round,
            "weights": [w.detach().clone() for w in self.weights],
            "optimizer": self.optimizer.state_dict(),
            "client_ids": dict(self.client_ids),
            "exhausted": dict(self.exhausted),
            "last_round": self.last_round,
            "client_level_account": self.client_level_account.to_json(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for weight, saved in zip(self.weights, state["weights"], strict=True):
                weight.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.completed_round = self.round_offset = int(state["round"])
        self.client_ids = dict(state["client_ids"])
        self.exhausted = dict(state["exhausted"])
        self.last_round = state["last_round"]
        self.client_level_account = ClientLevelAccount.from_json(state.get("client_level_account", "[]"))

    # ------------------------------------------------------------------ fit
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.global_arrays)

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        self._round_start = time.perf_counter()
        self.wait_for_clients(server_round, client_manager)
        excluded = set(self.exhausted)
        num_available = client_manager.num_available()
        eligible = num_available - len(excluded & set(client_manager.all()))
        if self.exhausted and eligible < self.config.min_fit_clients:
            raise StopFederation(
                f"only {eligible} of {num_available} clients can train another round within their privacy "
                f"budget (min-fit-clients={self.config.min_fit_clients}); stopping after round "
                f"{self.completed_round}. Exhausted: {sorted(self.exhausted.values())}")
        sample_size = max(int(eligible * self.config.fraction_fit), self.config.min_fit_clients)  # <= eligible
        clients = client_manager.sample(num_clients=sample_size, min_num_clients=self.config.min_available_clients,
                                        criterion=NotIn(excluded) if excluded else None)
        if self.secure_aggregation and len(clients) > MAX_CLIENTS:
            raise ConfigError(f"fraction-fit={self.config.fraction_fit} samples {len(clients)} clients; SecAgg+'s "
                              f"modulus holds the sum of at most {MAX_CLIENTS} without wrapping around")
        if self.client_level is not None:  # raises ConfigError, before the round trains, if bits are too few
            secagg = self.config.secagg
            plan = plan_round(self.client_level, sum(w.numel() for w in self.weights), len(clients),
                              fewest_survivors(len(clients), secagg.num_shares, secagg.reconstruction_threshold))
            self._round_plan = (plan, len(clients) / eligible)
        return [(client, FitIns(parameters, self._fit_config(server_round, client).to_config()))
                for client in clients]

    def wait_for_clients(self, server_round: int, client_manager: ClientManager) -> None:
        wait_for_clients(client_manager, self.config, self.round_number(server_round), self.completed_round,
                         secure=self.secure_aggregation is not None)

    def _fit_config(self, server_round: int, client: ClientProxy) -> FitConfig:
        return FitConfig(
            server_round=self.round_number(server_round), local_iterations=self.local_iterations,
            planned_iterations=self.local_iterations * self.config.num_server_rounds,
            proximal_mu=self.config.proximal_mu, secagg=self.secure_aggregation,
            fail_partition=self.config.inject_failure_partition,
            client_level=ClientLevelRound(self._round_plan[0].num_clients, self._round_plan[0].min_survivors)
            if self.client_level is not None else None,
            normalize_update=self.config.aggregation == "fednova",
            sparse=self._sparse_round(self.round_number(server_round)),
        )

    def _sparse_round(self, round_number: int) -> SparseRound | None:
        density = self.config.compression.density
        return SparseRound(density, round_seed(self.mask_seed, round_number)) if density < 1 else None

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: Failures) -> tuple[Parameters | None, dict[str, Scalar]]:
        round_number = self.round_number(server_round)
        messages = describe_failures(failures)
        if self.client_level is not None and results:  # SecAgg+ released the noisy sum: spent, applied or not
            self.client_level_account.record(*self._round_plan)
        reports: list[tuple[ClientProxy, FitRes, FitReport]] = []
        for proxy, res in results:
            try:
                reports.append((proxy, res, FitReport.from_metrics(res.metrics)))
            except ProtocolError as error:
                messages.append(f"client {proxy.cid}: unreadable report: {error}")
        for proxy, _, report in reports:
            self._note(proxy, report)
        self.note_refusals(messages)  # under SecAgg+ a refusing client leaves the round with an error
        refused = [r for _, _, r in reports if r.status == STATUS_BUDGET]
        contributing = [(p, res, r) for p, res, r in reports if res.num_examples > 0 and r.status != STATUS_BUDGET]
        if self.secure_aggregation:  # the one thing the server can check of each weight
            largest = self.secure_aggregation.max_weight
            messages += [f"client {self.label(p)}: num_examples={res.num_examples} exceeds secagg.max-weight="
                         f"{largest:g}; its result is not counted" for p, res, _ in contributing
                         if res.num_examples > largest]
            contributing = [c for c in contributing if c[1].num_examples <= largest]
        else:  # in the clear: check every update (honest clients already refuse non-finite ones)
            finite = [all(np.isfinite(a).all() for a in parameters_to_ndarrays(res.parameters))
                      for _, res, _ in contributing]
            messages += [f"client {self.label(p)}: non-finite update rejected"
                         for (p, _, r), ok in zip(contributing, finite) if not ok]
            contributing = [c for c, ok in zip(contributing, finite) if ok]
        for message in messages:
            log(WARNING, "round %s: client failure: %s", round_number, message)
        if not contributing:
            if refused and len(refused) == len(results) and not messages:
                raise StopFederation(budget_spent(round_number, len(refused), len(results), self.completed_round))
            raise RoundFailed(f"round {round_number}: no client update to aggregate; "
                              f"{len(refused)} refused for their privacy budget, {len(messages)} failed: "
                              + ("; ".join(messages) or "no failure reported"))
        if self.secure_aggregation:
            # SecAgg+ hands every FitRes the same, already weighted, mean.
            mean_update = parameters_to_ndarrays(contributing[0][1].parameters)
            if self.client_level is not None:  # the secure sum of noisy integers, decoded
                plan = self._round_plan[0]
                mean_update = decode_aggregate(mean_update, len(results), plan, round_number,
                                               [tuple(w.shape) for w in self.weights])
            check_feasible(round_number, mean_update, len(results), self.secure_aggregation.clipping_range,
                           self.config.secagg.precision, self._round_plan[0] if self.client_level else None)
        else:
            mean_update = aggregate_in_the_clear([(parameters_to_ndarrays(res.parameters), res.num_examples)
                                                  for _, res, _ in contributing],
                                                 self.config.aggregation, self.config.trim_fraction)
        if sparse := self._sparse_round(round_number):  # the mean of the round's coordinates, back in place
            shapes = [tuple(w.shape) for w in self.weights]
            indices = coordinate_mask(sparse.seed, sum(w.numel() for w in self.weights), sparse.density)
            if len(mean_update) != 1 or mean_update[0].shape != indices.shape:
                raise RoundFailed(f"round {round_number}: compression.density={sparse.density} expects one vector of "
                                  f"{indices.size} coordinates, the aggregate has shapes "
                                  f"{[a.shape for a in mean_update]}; the global adapter is left unchanged")
            mean_update = scatter(mean_update[0], indices, shapes)
        if self.config.aggregation == "fednova":
            mean_update = fednova_rescale(mean_update, [(res.num_examples, r) for _, res, r in contributing])
        server_step(self.optimizer, self.weights, mean_update)

        metrics = summarize_fit([(res.num_examples, r) for _, res, r in contributing], self.privacy_reports)
        metrics.update(num_clients=len(contributing), num_failures=len(messages), num_refused=len(refused))
        if self.client_level is not None:
            metrics["epsilon_client_level"] = self.client_level_account.epsilon(self.client_level.delta)
            log(INFO, "round %s: client-level epsilon %.3f at delta %g (%s of %s sampled clients survived)",
                round_number, metrics["epsilon_client_level"], self.client_level.delta, len(results),
                self._round_plan[0].num_clients)
        self.completed_round = round_number
        self.last_round = {"round": round_number, "fit": metrics, "failures": messages,
                           "clients": sorted(r.partition_id for _, _, r in contributing),
                           "iterations": {p.cid: r.iterations for p, _, r in contributing},  # by node id
                           "update_max_abs": float(max(np.abs(u).max() for u in mean_update)),
                           "seconds": time.perf_counter() - self._round_start,
                           "finished_at": time.time()}  # Unix time: rounds apart, with everything between
        log(INFO, "round %s: %s, %s clients, %s failed, %s refused", round_number, describe_fit(metrics),
            len(contributing), len(messages), len(refused))
        log(INFO, "round %s: local iterations per client: %s", round_number,
            ", ".join(f"{self.label(p)} {r.iterations}" for p, _, r in contributing))
        return ndarrays_to_parameters(self.global_arrays), metrics

    def label(self, proxy: ClientProxy) -> str:
        """How logs name a node: the name it gave itself, and the node id that identifies it."""
        name = self.client_ids.get(proxy.cid)
        return f"{name} (node {proxy.cid})" if name is not None else f"node {proxy.cid}"

    def _note(self, proxy: ClientProxy, report: FitReport) -> None:
        """Keep the node's privacy report, and stop sampling a node that refused, or that says one
        more round would take it past its budget."""
        self.client_ids.setdefault(proxy.cid, report.client_id)
        privacy = report.privacy
        if privacy is None:
            return
        self.privacy_reports[proxy.cid] = privacy
        if report.status == STATUS_BUDGET or not privacy.fits_next_round:
            why = f"client {self.label(proxy)}: one more round would pass its privacy budget"
            if proxy.cid not in self.exhausted:
                log(INFO, "privacy budget: %s; not sampled again", why)
            self.exhausted[proxy.cid] = why

    def note_refusals(self, messages: list[str]) -> dict[str, str]:
        """Stop sampling the nodes whose failure is a refusal for their privacy budget; return them."""
        refused = refused_nodes(messages)
        for cid, message in refused.items():
            if cid not in self.exhausted:
                log(INFO, "privacy budget: %s; not sampled again", message)
            self.exhausted.setdefault(cid, message)
        return refused

    # ------------------------------------------------------------------ preflight
    def configure_preflight(self, server_round: int,
                            client_manager: ClientManager) -> list[tuple[ClientProxy, GetPropertiesIns]]:
        """Every connected client, once the federation is large enough, gets a ``PreflightConfig``."""
        self.wait_for_clients(server_round, client_manager)
        ins = GetPropertiesIns(self._preflight_config().to_config())
        return [(proxy, ins) for proxy in client_manager.all().values()]

    def _preflight_config(self) -> PreflightConfig:
        return PreflightConfig(self.secure_aggregation, self.frozen_weights)

    def evaluation_can_carry_preflight(self) -> bool:
        """Whether the initial evaluation reaches every connected client (``fraction-evaluate=1``),
        so that it can carry the preflight instead of a message of its own."""
        return self.config.fraction_evaluate == 1.0

    def check_preflight(self, server_round: int, results: list, failures: list) -> None:
        """Raise ``PreflightFailed`` unless every replying client can train (``rounds.check_preflight``);
        keep the name each node gives itself, for logs."""
        self.client_ids.update(check_preflight(self.round_number(server_round), results, failures))

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager,
                           preflight: bool = False) -> list[tuple[ClientProxy, EvaluateIns]]:
        """The round's evaluation (none when ``evaluate-every`` skips it). With ``preflight``
        (``evaluation_can_carry_preflight``), it first waits for the federation, as the
        preflight does, and asks every client for the preflight's checks too."""
        if preflight:
            self.wait_for_clients(server_round, client_manager)
        every = self.config.evaluate_every
        if not every or self.config.fraction_evaluate == 0 or server_round % every:
            return []
        # Evaluation changes nothing: it goes to whoever is connected, without waiting for more.
        num_available = client_manager.num_available()
        sample_size = min(num_available, max(int(num_available * self.config.fraction_evaluate),
                                             self.config.min_evaluate_clients))
        if sample_size < self.config.min_evaluate_clients:
            log(WARNING, "round %s: evaluating on the %s connected clients (min-evaluate-clients=%s)",
                self.round_number(server_round), num_available, self.config.min_evaluate_clients)
        clients = client_manager.sample(num_clients=sample_size, min_num_clients=sample_size)
        config = EvaluateConfig(self.round_number(server_round), self._preflight_config() if preflight else None)
        return [(client, EvaluateIns(parameters, config.to_config())) for client in clients]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list) -> tuple[float | None, dict[str, Scalar]]:
        round_number = self.round_number(server_round)
        for failure in failures:
            log(WARNING, "round %s: evaluation failure: %s", round_number, describe_failure(failure))
        results = [(p, r) for p, r in results if r.num_examples > 0]
        if not results:
            return None, {}
        loss = sum(r.num_examples * r.loss for _, r in results) / sum(r.num_examples for _, r in results)
        reports = [(r.num_examples, EvaluateReport.from_metrics(r.metrics)) for _, r in results]
        metrics = {name: weighted_mean([(n, getattr(report, name)) for n, report in reports])
                   for name in (f.name for f in dataclasses.fields(EvaluateReport))
                   if all(getattr(report, name) is not None for _, report in reports)}  # optional ones: all or none
        log(INFO, "round %s: held-out greedy reward %.3f, accuracy %.3f%s", round_number, metrics["reward"],
            metrics["accuracy"], f", response loss {metrics['response_loss']:.4f}" if "response_loss" in metrics else "")
        return loss, metrics

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return None  # no central data: the server holds none of the clients' prompts
