"""One federated round on Flower's legacy stack, where every wait has a deadline.

Flower's ``default_fit_workflow`` and ``default_evaluate_workflow`` wait for every sampled node
without a deadline, and ``ClientManager.sample`` waits up to 24 hours for ``min_num_clients``: a
node that died, or a federation smaller than ``min-available-clients``, hangs the run with no
message. The steps here replace them:

- ``exchange``: send the strategy's legacy instructions and collect the replies until a deadline;
  a node that does not answer in time is a failure of the round that names the node.
- ``RoundLoop``: the fit and evaluate steps that ``DefaultWorkflow`` runs each round. Before the
  first round of a run it sends every connected client a preflight (``protocol.PreflightConfig``:
  each checks its model, data, reward function and batch sizes against its own data) and ends
  the run with one line per distinct error if any client cannot train; before the first round of
  a fresh run it evaluates the initial adapter (round 0), and that evaluation carries the
  preflight when it reaches every connected client. After a fit it writes
  the checkpoint at once, before evaluating, so a round whose evaluation never ends is not lost.
  Evaluation goes to whoever is connected, with a deadline.
- Overlap (``overlap-evaluation``, deployments only): a SuperNode runs one message at a time and,
  once it has replied, sleeps 3 s before asking for the next if none is waiting
  (``flwr.supernode.start_client_internal``). A round's evaluation and the next round's first
  message (SecAgg+ setup, or the fit in the clear) need nothing from each other, so the server
  pushes the evaluation, returns, and pushes the next round's first message at once: each node
  finds it waiting when its evaluation is done. That first stage's deadline grows by what the
  evaluation may still take (``grid.QueuedGrid``), and the round's record is written, in order,
  once the next round's fit has ended (or failed), before that round's checkpoint. Not in simulation: Flower's simulation may run
  two messages for one node at once, and it keeps the node state of whichever ends last, which
  could lose SecAgg+'s.
- ``CheckedSecAggPlusWorkflow``: Flower's SecAgg+ fit, except that a halted protocol fails the
  round with the reason instead of passing silently. Its own deadline is ``secagg.timeout``.

Every message of a round, both ways and every SecAgg+ stage, is measured as it is serialized
(``wire.MeteredGrid``); the round's ``metrics.jsonl`` record holds the figures under ``wire``
(the preflight and the initial evaluation go into round 0's record).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from logging import INFO, WARNING

import flwr.compat.common.recorddict_compat as compat
from flwr.common import Code, Message, MessageType, log
from flwr.common.constant import MessageTypeLegacy
from flwr.server import Grid, LegacyContext
from flwr.server.client_proxy import ClientProxy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from flwr_verl.config import FederationConfig
from flwr_verl.federation.grid import PollingGrid, QueuedGrid
from flwr_verl.federation.rounds import NoReply, RoundFailed, StopFederation, budget_spent, describe_failures
from flwr_verl.federation.rundir import RunDirectory
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.federation.wire import MeteredGrid, NodeNamedErrors, WireMeter

# Legacy instructions to Flower's records and replies back, per message type.
CONVERTERS = {
    MessageType.TRAIN: (partial(compat.fitins_to_recorddict, keep_input=True),
                        partial(compat.recorddict_to_fitres, keep_input=False)),
    MessageType.EVALUATE: (partial(compat.evaluateins_to_recorddict, keep_input=True),
                           compat.recorddict_to_evaluateres),
    MessageTypeLegacy.GET_PROPERTIES: (compat.getpropertiesins_to_recorddict, compat.recorddict_to_getpropertiesres),
}


@dataclass
class Sent:
    """Legacy instructions pushed to the nodes, whose replies are collected by ``collect``."""

    grid: PollingGrid  # what they were pushed through: their replies are pulled (metered, named) through it
    message_type: str
    addressee: dict[str, ClientProxy]  # message id -> the client it went to
    timeout: float
    pushed_at: float  # time.monotonic()

    @property
    def deadline(self) -> float:
        """When the replies are due (``time.monotonic()``)."""
        return self.pushed_at + self.timeout


def send(grid: PollingGrid, instructions: list[tuple[ClientProxy, object]], message_type: str, server_round: int,
         timeout: float) -> Sent:
    """Push each ``(proxy, FitIns | EvaluateIns | GetPropertiesIns)``; the replies are due within
    ``timeout`` seconds."""
    to_recorddict, _ = CONVERTERS[message_type]
    messages = [Message(content=to_recorddict(ins), dst_node_id=proxy.node_id, message_type=message_type,
                        group_id=str(server_round)) for proxy, ins in instructions]
    pushed_at = time.monotonic()
    ids = grid.push_messages(messages)
    # Replies are matched by the message they answer, not by sender: the SuperLink itself sends
    # the "node unavailable" error for a node that died.
    return Sent(grid, message_type, dict(zip(ids, (proxy for proxy, _ in instructions), strict=True)), timeout,
                pushed_at)


def collect(sent: Sent) -> tuple[list, list]:
    """The replies to ``sent`` once all have arrived, or whichever arrived by its deadline, as
    ``(results, failures)`` as the legacy strategy API expects them. On a
    ``wire.NodeNamedErrors`` grid every error names its node."""
    _, from_recorddict = CONVERTERS[sent.message_type]
    replies = sent.grid.receive(list(sent.addressee), sent.deadline)
    results, failures = [], []
    for reply in replies:
        proxy = sent.addressee[reply.metadata.reply_to_message_id]
        if reply.has_content():
            res = from_recorddict(reply.content)
            (results if res.status.code == Code.OK else failures).append((proxy, res))
        else:
            failures.append(Exception(reply.error))
    answered = {reply.metadata.reply_to_message_id for reply in replies}
    failures += [NoReply(f"node {proxy.node_id} sent no {sent.message_type} reply within {sent.timeout:g} s")
                 for message_id, proxy in sent.addressee.items() if message_id not in answered]
    return results, failures


def exchange(grid: PollingGrid, instructions: list[tuple[ClientProxy, object]], message_type: str,
             server_round: int, timeout: float) -> tuple[list, list]:
    """``send``, then ``collect``: the replies within ``timeout`` seconds."""
    return collect(send(grid, instructions, message_type, server_round, timeout))


@dataclass
class SentEvaluation:
    """A round's evaluation on its way: what ``RoundLoop`` still needs to record it."""

    sent: Sent
    server_round: int
    preflight: bool  # it carries the preflight: any client error ends the run


@dataclass
class OverlappedRound:
    """A round whose evaluation runs ahead of the next round's first message
    (``overlap-evaluation``): recorded once that next round's fit has ended."""

    record: dict  # the strategy's record of the round's fit
    evaluation: SentEvaluation
    wire: WireMeter  # the round's own traffic


FIRST_ROUND = 1  # Flower's number of a run's first round: the preflight belongs to it


class RoundLoop:
    """The fit and evaluate steps that ``DefaultWorkflow`` runs each round, with deadlines.

    Args:
        strategy: the federation's strategy; its ``state_dict()`` is what gets checkpointed.
        run: the run directory that receives checkpoints and ``metrics.jsonl`` records.
        federation: cadences (``evaluate-every``, ``save-every``), deadlines (``fit-timeout``,
            ``evaluate-timeout``) and ``overlap-evaluation``.
        secure_fit: the SecAgg+ fit workflow; None fits in the clear.
    """

    def __init__(self, strategy: FedProxAdapters, run: RunDirectory, federation: FederationConfig,
                 secure_fit: SecAggPlusWorkflow | None) -> None:
        self.strategy, self.run, self.federation, self.secure_fit = strategy, run, federation, secure_fit
        self.saved_round = strategy.completed_round
        self.wire = WireMeter()
        self.overlapped: OverlappedRound | None = None  # the last round, while its evaluation runs ahead

    def fit(self, grid: Grid, legacy: LegacyContext) -> None:
        grid = NodeNamedErrors(MeteredGrid(grid, self.wire))
        current = current_round(legacy)
        # How long an overlapped evaluation may still run ahead of this round's first message.
        queued_s = max(0.0, self.overlapped.evaluation.sent.deadline - time.monotonic()) if self.overlapped else 0.0
        try:
            if current == FIRST_ROUND:  # the first round of this run, fresh or resumed
                self.first_round(grid, legacy)
            if self.secure_fit is not None:
                self.secure_fit(QueuedGrid(grid, queued_s) if queued_s else grid, legacy)
            else:
                self._plain_fit(grid, legacy, current, queued_s)
        finally:  # the previous round's record, however this fit ended, and before this round's checkpoint:
            if self.overlapped:  # resume restores a checkpoint's own record, not the one before it
                overlapped, self.overlapped = self.overlapped, None
                self.record(overlapped.record, overlapped.evaluation, overlapped.wire)
        state = self.strategy.state_dict()
        round_number = self.strategy.round_number(current)
        if state["round"] != round_number:
            raise RoundFailed(f"round {round_number}: no update was aggregated "
                              "(under SecAgg+: too few clients completed the protocol; see the clients' logs)")
        last = round_number == self.federation.num_server_rounds
        if last or round_number % self.federation.save_every == 0:  # checkpoint first: resume trusts it
            self.save(state, final=last)

    def first_round(self, grid: Grid, legacy: LegacyContext) -> None:
        """Before round 1 of this run: the preflight, then (fresh runs) the evaluation of the
        initial adapter as round 0. When that evaluation reaches every connected client it carries
        the preflight: one message per node instead of two."""
        fresh = self.strategy.completed_round == 0 and bool(self.federation.evaluate_every)
        carried = fresh and self.strategy.evaluation_can_carry_preflight()
        if not carried:
            self.preflight(grid, legacy)
        if not fresh:
            return
        evaluation = self.evaluate_round(grid, legacy, 0, preflight=carried)
        self.run.append_metrics({"round": 0, "evaluate": evaluation, "wire": self.wire.take()})
        if "accuracy" in evaluation:
            log(INFO, "round 0/%s: held-out accuracy %.3f before training", self.federation.num_server_rounds,
                evaluation["accuracy"])

    def preflight(self, grid: Grid, legacy: LegacyContext) -> None:
        """Before anything trains, every connected client checks the config against its own
        data; problems end the run with one line per distinct error."""
        instructions = self.strategy.configure_preflight(FIRST_ROUND, legacy.client_manager)
        results, failures = exchange(grid, instructions, MessageTypeLegacy.GET_PROPERTIES, FIRST_ROUND,
                                     self.federation.evaluate_timeout)
        self.strategy.check_preflight(FIRST_ROUND, results, failures)

    def evaluate(self, grid: Grid, legacy: LegacyContext) -> None:
        """Evaluate the round's global adapter and record the round. With ``overlap-evaluation``,
        in a deployment, before the last round: push the evaluation and return, so that the next
        round's first message waits on each node behind it; ``fit`` records this round once that
        round has ended."""
        current = current_round(legacy)
        record = dict(self.strategy.state_dict()["last_round"])
        grid = NodeNamedErrors(MeteredGrid(grid, self.wire))
        evaluation = self.send_evaluation(grid, legacy, current)
        more = self.strategy.round_number(current) < self.federation.num_server_rounds
        if evaluation and more and self.federation.overlap_evaluation and not grid.in_process:
            self.overlapped = OverlappedRound(record, evaluation, self.wire)
            self.wire = WireMeter()  # the next round's traffic is the next record's
            return
        self.record(record, evaluation, self.wire)

    def record(self, record: dict, evaluation: SentEvaluation | None, wire: WireMeter) -> None:
        """Append the round's ``metrics.jsonl`` record, with its evaluation when one was sent, and log it."""
        if evaluation and (metrics := self.finish_evaluation(evaluation)):
            record["evaluate"] = metrics
        record["wire"] = wire.take()
        self.run.append_metrics(record)
        self.run.plot()
        log(INFO, "%s", progress_line(record, self.federation.num_server_rounds))

    def save(self, state: dict, final: bool) -> None:
        saved = self.run.save(state, final=final)
        self.saved_round = int(state["round"])
        log(INFO, "round %s: adapter %s saved", self.saved_round, saved)

    def _plain_fit(self, grid: Grid, legacy: LegacyContext, current: int, queued_s: float) -> None:
        parameters = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        instructions = self.strategy.configure_fit(current, parameters, legacy.client_manager)
        results, failures = exchange(grid, instructions, MessageType.TRAIN, current,
                                     self.federation.fit_timeout + queued_s)
        aggregated, metrics = self.strategy.aggregate_fit(current, results, failures)
        legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(aggregated, True)
        legacy.history.add_metrics_distributed_fit(server_round=current, metrics=metrics)

    def send_evaluation(self, grid: PollingGrid, legacy: LegacyContext, server_round: int,
                        preflight: bool = False) -> SentEvaluation | None:
        """Push the current global adapter to the connected clients for evaluation on their
        held-out prompts (None when none is due this round). With ``preflight`` the evaluation
        carries the preflight."""
        parameters = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        instructions = self.strategy.configure_evaluate(server_round, parameters, legacy.client_manager,
                                                        preflight=preflight)
        if not instructions:
            return None
        return SentEvaluation(send(grid, instructions, MessageType.EVALUATE, server_round,
                                   self.federation.evaluate_timeout), server_round, preflight)

    def finish_evaluation(self, evaluation: SentEvaluation) -> dict:
        """The aggregated metrics of a sent evaluation ({} when nobody answered by its deadline).
        One that carries the preflight ends the run on any client error, as the preflight would:
        before anything trains."""
        results, failures = collect(evaluation.sent)
        if evaluation.preflight:
            self.strategy.check_preflight(FIRST_ROUND, results, failures)
        _, metrics = self.strategy.aggregate_evaluate(evaluation.server_round, results, failures)
        return {**metrics, "seconds": time.monotonic() - evaluation.sent.pushed_at} if metrics else {}

    def evaluate_round(self, grid: PollingGrid, legacy: LegacyContext, server_round: int,
                       preflight: bool = False) -> dict:
        """Evaluate the current global adapter now: ``send_evaluation`` and ``finish_evaluation``."""
        evaluation = self.send_evaluation(grid, legacy, server_round, preflight)
        return self.finish_evaluation(evaluation) if evaluation else {}


def progress_line(record: dict, rounds: int) -> str:
    """One line per round: sampled reward before and after local training, held-out accuracy,
    this run's epsilon so far, seconds, and bytes up and down."""
    fit, evaluation = record.get("fit", {}), record.get("evaluate", {})
    parts = [f"reward {fit['reward_before']:.3f} -> {fit['reward_after']:.3f}" if "reward_before" in fit
             else f"noised reward {fit['dp_reward_mean']:.3f}" if "dp_reward_mean" in fit
             else "training metrics not sent",
             f"held-out accuracy {evaluation['accuracy']:.3f}" if "accuracy" in evaluation else "not evaluated"]
    if "epsilon_run" in fit:
        parts.append(f"epsilon {fit['epsilon_run']:.2f} in this run")
    parts.append(f"{record.get('seconds', math.nan):.1f} s")
    if wire := record.get("wire"):  # measured on the wire, every stage, summed over the clients
        parts.append(f"{sum(wire['up'].values()) / 1e6:.2f} MB up, {sum(wire['down'].values()) / 1e6:.2f} MB down "
                     "on the wire")
    else:
        parts.append(f"{fit.get('bytes_sent', 0) / 1e6:.2f} MB up, {fit.get('bytes_received', 0) / 1e6:.2f} MB down")
    return f"round {record['round']}/{rounds}: " + " | ".join(parts)


def current_round(legacy: LegacyContext) -> int:
    return int(legacy.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])


class CheckedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, except that a halted protocol raises ``RoundFailed``.

    Flower only logs "Secure aggregation halted." and goes on to the next round, so a round
    that lost more clients than the reconstruction threshold allows would pass silently. Here
    it ends the run with the stage, the number of clients left, the threshold and every
    client's reason; the global adapter is left as it was. When every client that left did so
    for its privacy budget, the federation has spent what it may: ``StopFederation`` ends the
    run normally after the last completed round, as in the clear.
    """

    STAGES = ("setup", "share keys", "collect masked vectors", "unmask")

    def __call__(self, grid: Grid, context: LegacyContext) -> None:
        state = WorkflowState()
        steps = (self.setup_stage, self.share_keys_stage, self.collect_masked_vectors_stage, self.unmask_stage)
        log(INFO, "Secure aggregation commencing.")
        for stage, step in zip(self.STAGES, steps):
            if not step(grid, context, state):
                log(WARNING, "Secure aggregation halted.")
                self._stop_if_spent(context, state)
                raise RoundFailed(self._halted(context, state, stage))
        log(INFO, "Secure aggregation completed.")

    @staticmethod
    def _stop_if_spent(context: LegacyContext, state: WorkflowState) -> None:
        strategy = context.strategy
        messages = describe_failures(state.failures)
        refused = strategy.note_refusals(messages)
        if messages and len(refused) == len(messages):
            raise StopFederation(budget_spent(strategy.round_number(current_round(context)), len(refused),
                                              len(state.sampled_node_ids), strategy.completed_round))

    @staticmethod
    def _halted(context: LegacyContext, state: WorkflowState, stage: str) -> str:
        round_number = context.strategy.round_number(current_round(context))
        sampled = len(state.sampled_node_ids)
        if not sampled:
            return f"round {round_number}: secure aggregation halted at stage '{stage}': too few clients sampled"
        reasons = "; ".join(describe_failures(state.failures)) or "no reply before secagg.timeout"
        return (f"round {round_number}: secure aggregation halted at stage '{stage}': "
                f"{len(state.active_node_ids)} of {sampled} sampled clients still taking part, fewer than the "
                f"reconstruction threshold {state.threshold} allows. Client failures: {reasons}")
