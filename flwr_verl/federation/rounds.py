"""A round as the server reads it: the errors that end a round or the run, each client's failure
and refusal named by its node, the reports' summary, the preflight's verdict, and the arithmetic
checks on an aggregate (``FedProxAdapters`` in ``strategy`` calls these each round)."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from logging import INFO, WARNING

import numpy as np
from flwr.app import Error
from flwr.common import FitRes, NDArrays, log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.criterion import Criterion
from flwr.server.strategy.aggregate import aggregate, aggregate_median, aggregate_trimmed_avg

from flwr_verl.config import FederationConfig, FlwrVerlError
from flwr_verl.federation.protocol import FitReport, PreflightReport, PrivacyReport, ProtocolError, TrainingSummary
from flwr_verl.federation.secagg import MIN_CLIENTS, infeasible_coordinates
from flwr_verl.privacy.distributed_dp import SkellamPlan, feasible_mean_norm
from flwr_verl.privacy.dpsgd import DP_METRICS

Failures = list[tuple[ClientProxy, FitRes] | BaseException]
# An error reply, as ``wire.NodeNamedErrors`` names it, "node <node id>: <reason>", and its reason
# as ``mods.concise_errors`` writes it, "client <id>: <error>" (or "partition <i>: <error>", the
# partition id being the default client id). Only the node id identifies: the server wrote it.
NODE_ERROR = re.compile(r"^node (?P<node_id>\d+): (?P<reason>.*)$", re.S)
CLIENT_ERROR = re.compile(r"^(?:client|partition) (?P<client_id>\S+): (?P<error>.*?)(?: \(Flower error code \d+\))?$",
                          re.S)
BUDGET_REFUSAL = "PrivacyBudgetExhausted: "
MAX_REASON = 400  # characters of one client's failure reason kept in logs and errors


class RoundFailed(FlwrVerlError, RuntimeError):
    """No client update could be aggregated in a round."""


class NoReply(Exception):
    """A sampled node sent no reply before the deadline."""


class PreflightFailed(RoundFailed):
    """A client cannot train with this config on its own data; found before any training."""


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


def budget_spent(round_number: int, refused: int, sampled: int, completed_round: int) -> str:
    """Why the run stops when the sampled clients refused for their privacy budget: one message
    whether they refused in the clear (status ``STATUS_BUDGET``) or by leaving SecAgg+."""
    return (f"round {round_number}: {refused} of {sampled} sampled clients refused to train: their privacy budget "
            f"is spent; stopping after round {completed_round}")


def refused_nodes(messages: list[str]) -> dict[str, str]:
    """The nodes (Flower node ids, as the ``ClientProxy.cid``) whose failure line is a refusal for
    their privacy budget (``client.PrivacyBudgetExhausted``, under SecAgg+), each with its line."""
    refused = {}
    for message in messages:
        node = NODE_ERROR.match(message)
        error = CLIENT_ERROR.match(node["reason"]) if node else None
        if error and error["error"].startswith(BUDGET_REFUSAL):
            refused[node["node_id"]] = message
    return refused


def weighted_mean(pairs: list[tuple[int, float]]) -> float:
    """num_examples-weighted mean of the finite values (plain mean if every weight is 0)."""
    pairs = [(n, v) for n, v in pairs if math.isfinite(v)]
    if not pairs:
        return math.nan
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total else float(np.mean([v for _, v in pairs]))


def fednova_rescale(mean_update: NDArrays, reports: list[tuple[int, FitReport]]) -> NDArrays:
    """FedNova's server step (Wang et al. 2020, for local SGD): each client i sent its update
    divided by its local iterations tau_i (``FitConfig.normalize_update``), so the weighted mean
    is sum_i p_i Delta_i / tau_i, with p_i = n_i / sum n. Scaled by the effective iteration count
    tau_eff = sum_i p_i tau_i, every client moves the global adapter in proportion to its data,
    not to its iterations, while the step keeps the size of the clients' mean work. Under SecAgg+
    the division happens before masking and the server needs only the sum and the iteration
    counts, which travel in the clear; SecAgg+'s rounding error is scaled by tau_eff with the
    mean. (With AdamW and FedProx's term locally, tau_i is FedNova's
    plain-SGD normaliser, an approximation of the paper's a_i for those local optimizers.)"""
    tau_eff = weighted_mean([(n, float(r.iterations)) for n, r in reports])
    if not math.isfinite(tau_eff) or tau_eff <= 0:
        raise ProtocolError(f"aggregation='fednova' needs the contributing clients' local iterations; "
                            f"their weighted mean is {tau_eff}")
    return [u * tau_eff for u in mean_update]


def summarize_fit(reports: list[tuple[int, FitReport]], privacy: dict[str, PrivacyReport]) -> dict[str, float]:
    """A round's fit metrics: weighted means of the training summaries and of the local
    iterations run, byte sums, and epsilon.

    ``epsilon_run`` is the maximum of this run's epsilon over the latest ``privacy`` report of
    every node seen in this run (not only this round's), when nodes send it
    (``protocol.PrivacyReport``): the run is as private as its least private node, and the figure
    never decreases. What each data set has spent over all runs stays on its node. An infinite
    epsilon (a fit run without noise) is reported as infinity, never dropped.
    """
    out: dict[str, float] = {
        "bytes_received": float(sum(r.bytes_received for _, r in reports)),
        "bytes_sent": float(sum(r.bytes_sent for _, r in reports)),
        "iterations": weighted_mean([(n, float(r.iterations)) for n, r in reports]),
    }
    trained = [(n, r.training) for n, r in reports if r.training is not None]
    for name in (f.name for f in dataclasses.fields(TrainingSummary)) if trained else ():
        out[name] = weighted_mean([(n, getattr(t, name)) for n, t in trained])
    if trained:  # the round waits for its slowest client: what a framework's overhead is measured against
        out["time_fit_max"] = max(t.time_fit for _, t in trained)
        out["time_fit_sum"] = sum(t.time_fit for _, t in trained)
    noised = [(n, r.training_dp) for n, r in reports if r.training_dp is not None]  # privacy.metrics = "dp"
    for name in DP_METRICS if noised else ():
        out[f"dp_{name}"] = weighted_mean([(n, getattr(t, name)) for n, t in noised])
    if epsilons := [p.epsilon_run for p in privacy.values() if p.epsilon_run is not None]:
        out["epsilon_run"] = max(epsilons)
    return out


def check_feasible(round_number: int, mean: NDArrays, num_clients: int, clipping_range: float, precision: float,
                   plan: SkellamPlan | None) -> None:
    """Fail the round when the unmasked aggregate is outside what honest clients can send.

    Every honest client checks its update against the SecAgg+ clipping range c before masking
    (``secagg.check_update``), so the weighted mean of honest updates lies in [-c, c] up to
    SecAgg+'s rounding (``secagg.precision``), and under client-level DP its L2 norm within
    ``distributed_dp.feasible_mean_norm``. A client that skips its own checks can put anything
    in its masked vector (NaN quantizes to an arbitrary integer); SecAgg+ hides who. Inside the
    range nothing can be told apart from honest updates (``strategy``'s module docstring says
    what that leaves possible)."""
    if plan is not None:  # client-level DP
        norm = float(np.sqrt(sum(float(np.sum(np.square(a))) for a in mean)))
        bound = feasible_mean_norm(plan, num_clients)
        problem = (None if norm <= bound else
                   f"its L2 norm {norm:.4g} exceeds {bound:.4g}, the most that {num_clients} clipped, noised "
                   "client updates reach")
    else:
        outside, nonfinite, largest = infeasible_coordinates(mean, clipping_range + precision)
        problem = (None if not outside else
                   f"{outside} of {sum(a.size for a in mean)} coordinates are outside +-{clipping_range:g} "
                   f"(secagg.clipping-range, which every honest client checks; {nonfinite} not finite, largest "
                   f"finite |value| {largest:.4g})")
    if problem:
        raise RoundFailed(f"round {round_number}: the securely aggregated update of {num_clients} clients is not "
                          f"one that honest clients can send: {problem}. At least one node sent an update it did "
                          "not check (faulty or malicious; SecAgg+ hides which). The global adapter is left "
                          "unchanged")


def aggregate_in_the_clear(results: list[tuple[NDArrays, int]], kind: str, trim_fraction: float) -> NDArrays:
    """``aggregation``: the num_examples-weighted mean (``mean``, ``fednova``), or a robust
    statistic that ignores the weights (Flower's ``aggregate_median``, Yin et al. 2018, and
    ``aggregate_trimmed_avg`` at ``trim-fraction`` per side)."""
    if kind == "median":
        return aggregate_median(results)
    if kind == "trimmed_mean":
        return aggregate_trimmed_avg(results, trim_fraction)
    return aggregate(results)


def check_preflight(round_number: int, results: list, failures: list) -> dict[str, str]:
    """The name each replying node gives itself (node id -> client-id), once every client can
    train; else raise ``PreflightFailed`` with one line per distinct client error, naming the nodes, or
    when two nodes claim one ``client-id``. A node that did not answer in time only gets a
    warning: the rounds' own fault handling (dropouts, deadlines) deals with it, while an error
    it did report would recur each round."""
    silent = [f for f in failures if isinstance(f, NoReply)]
    failures = [f for f in failures if not isinstance(f, NoReply)]
    for failure in silent:
        log(WARNING, "preflight: %s", failure)
    by_error: dict[str, list[str]] = {}
    for message in describe_failures(failures):
        node = NODE_ERROR.match(message)
        reason = node["reason"] if node else message
        match = CLIENT_ERROR.match(reason)
        names = [match["client_id"]] if match else []
        names += [f"(node {node['node_id']})"] if node else []
        by_error.setdefault(match["error"] if match else reason, []).append(" ".join(names) or "?")
    claims: dict[str, list[str]] = {}
    client_ids: dict[str, str] = {}
    unfit = len(failures)
    for proxy, res in results:
        try:
            report = PreflightReport.from_metrics(getattr(res, "properties", None) or res.metrics)
        except ProtocolError as error:
            by_error.setdefault(f"unreadable preflight reply: {error}", []).append(f"node {proxy.cid}")
            unfit += 1
            continue
        client_ids[proxy.cid] = report.client_id
        claims.setdefault(report.client_id, []).append(proxy.cid)
    for name, nodes in claims.items():
        if len(nodes) > 1:
            unfit += len(nodes)
            by_error.setdefault(
                f"nodes {', '.join(sorted(nodes))} all claim client-id={name!r}; a client-id labels one node, "
                "so give each node its own (node config client-id)", []).append(name)
    if not by_error:
        log(INFO, "preflight: %s clients ready", len(results))
        return client_ids
    lines = [f"clients {', '.join(sorted(who))}: {error}" for error, who in by_error.items()]
    raise PreflightFailed(f"round {round_number}: preflight: {unfit} of "
                          f"{len(results) + len(failures)} clients cannot train; nothing was trained:\n  "
                          + "\n  ".join(lines))


class NotIn(Criterion):
    """Flower's sampling criterion for every client but the ``excluded`` node ids."""

    def __init__(self, excluded: set[str]) -> None:
        self.excluded = excluded

    def select(self, client: ClientProxy) -> bool:
        return client.cid not in self.excluded


def describe_fit(metrics: dict[str, float]) -> str:
    """A round's training metrics and epsilon, as its log line says them."""
    epsilon = metrics.get("epsilon_run")
    kl = metrics.get("kl", math.nan)  # nan when no KL term ran the reference pass
    training = (f"reward {metrics['reward_before']:.3f} -> {metrics['reward_after']:.3f}"
                + ("" if math.isnan(kl) else f", kl {kl:.4f}")
                if "reward_before" in metrics else
                f"noised reward {metrics['dp_reward_mean']:.3f}, response length {metrics['dp_response_length']:.1f}"
                if "dp_reward_mean" in metrics else "training metrics not sent")
    return f"{training}, epsilon {'not sent' if epsilon is None else f'{epsilon:.2f} in this run'}"


def wait_for_clients(client_manager: ClientManager, config: FederationConfig, round_number: int, completed_round: int,
                     *, secure: bool) -> None:
    """Wait up to ``connect-timeout`` for ``min-available-clients`` connected clients, then fail
    with what to change (Flower's own ``sample`` would wait 24 hours without a word)."""
    count = config.min_available_clients
    deadline = time.monotonic() + config.connect_timeout
    # On a Grid, num_available() refreshes the node list; wait_for alone sees it every 5 s.
    while (connected := client_manager.num_available()) < count and time.monotonic() < deadline:
        client_manager.wait_for(count, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    if connected >= count:
        return
    if secure and connected < MIN_CLIENTS:
        # Lowering min-*-clients cannot help here, and a resumed run keeps secagg.enabled.
        more = ("bring SuperNodes back and run again with resume=true to continue after round "
                f"{completed_round}" if completed_round else "start more SuperNodes")
        fix = (f"SecAgg+ cannot run with {connected} clients (Flower's SecAgg+ needs at least {MIN_CLIENTS}): "
               f"{more}, or start a new run with secagg.enabled=false")
    else:
        fix = "start more SuperNodes, or lower min-available-clients and min-fit-clients"
    raise RoundFailed(
        f"round {round_number}: only {connected} of "
        f"min-available-clients={count} SuperNodes connected after connect-timeout={config.connect_timeout:g} "
        f"s; {fix}.")
