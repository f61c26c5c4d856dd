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
- ``CheckedSecAggPlusWorkflow``: Flower's SecAgg+ fit, except that a halted protocol fails the
  round with the reason instead of passing silently. Its own deadline is ``secagg.timeout``.

Every message of a round, both ways and every SecAgg+ stage, is measured as it is serialized
(``wire.MeteredGrid``); the round's ``metrics.jsonl`` record holds the figures under ``wire``
(the preflight and the initial evaluation go into round 0's record).
"""

from __future__ import annotations

import math
import time
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


def exchange(grid: Grid, instructions: list[tuple[ClientProxy, object]], message_type: str, server_round: int,
             timeout: float) -> tuple[list, list]:
    """Send each ``(proxy, FitIns | EvaluateIns | GetPropertiesIns)`` and collect replies for at most ``timeout``
    seconds; return ``(results, failures)`` as the legacy strategy API expects them. On a
    ``wire.NodeNamedErrors`` grid every error names its node."""
    to_recorddict, from_recorddict = CONVERTERS[message_type]
    proxies = {proxy.node_id: proxy for proxy, _ in instructions}
    messages = [Message(content=to_recorddict(ins), dst_node_id=proxy.node_id, message_type=message_type,
                        group_id=str(server_round)) for proxy, ins in instructions]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    # Match replies by the message they answer, not by sender: the SuperLink itself sends the
    # "node unavailable" error for a node that died. Pushing the messages gave them their ids.
    addressee = {message.metadata.message_id: proxies[message.metadata.dst_node_id] for message in messages}
    results, failures = [], []
    for reply in replies:
        proxy = addressee[reply.metadata.reply_to_message_id]
        if reply.has_content():
            res = from_recorddict(reply.content)
            (results if res.status.code == Code.OK else failures).append((proxy, res))
        else:
            failures.append(Exception(reply.error))
    answered = {reply.metadata.reply_to_message_id for reply in replies}
    failures += [NoReply(f"node {proxy.node_id} sent no {message_type} reply within {timeout:g} s")
                 for message_id, proxy in addressee.items() if message_id not in answered]
    return results, failures


FIRST_ROUND = 1  # Flower's number of a run's first round: the preflight belongs to it


class RoundLoop:
    """The fit and evaluate steps that ``DefaultWorkflow`` runs each round, with deadlines.

    Args:
        strategy: the federation's strategy; its ``state_dict()`` is what gets checkpointed.
        run: the run directory that receives checkpoints and ``metrics.jsonl`` records.
        federation: cadences (``evaluate-every``, ``save-every``) and deadlines (``fit-timeout``,
            ``evaluate-timeout``).
        secure_fit: the SecAgg+ fit workflow; None fits in the clear.
    """

    def __init__(self, strategy: FedProxAdapters, run: RunDirectory, federation: FederationConfig,
                 secure_fit: SecAggPlusWorkflow | None) -> None:
        self.strategy, self.run, self.federation, self.secure_fit = strategy, run, federation, secure_fit
        self.saved_round = strategy.completed_round
        self.wire = WireMeter()

    def fit(self, grid: Grid, legacy: LegacyContext) -> None:
        grid = NodeNamedErrors(MeteredGrid(grid, self.wire))
        current = current_round(legacy)
        if current == FIRST_ROUND:  # the first round of this run, fresh or resumed
            self.first_round(grid, legacy)
        if self.secure_fit is not None:
            self.secure_fit(grid, legacy)
        else:
            self._plain_fit(grid, legacy, current)
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
        record = dict(self.strategy.state_dict()["last_round"])
        if evaluation := self.evaluate_round(NodeNamedErrors(MeteredGrid(grid, self.wire)), legacy,
                                             current_round(legacy)):
            record["evaluate"] = evaluation
        record["wire"] = self.wire.take()
        self.run.append_metrics(record)
        self.run.plot()
        log(INFO, "%s", progress_line(record, self.federation.num_server_rounds))

    def save(self, state: dict, final: bool) -> None:
        saved = self.run.save(state, final=final)
        self.saved_round = int(state["round"])
        log(INFO, "round %s: adapter %s saved", self.saved_round, saved)

    def _plain_fit(self, grid: Grid, legacy: LegacyContext, current: int) -> None:
        parameters = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        instructions = self.strategy.configure_fit(current, parameters, legacy.client_manager)
        results, failures = exchange(grid, instructions, MessageType.TRAIN, current, self.federation.fit_timeout)
        aggregated, metrics = self.strategy.aggregate_fit(current, results, failures)
        legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(aggregated, True)
        legacy.history.add_metrics_distributed_fit(server_round=current, metrics=metrics)

    def evaluate_round(self, grid: Grid, legacy: LegacyContext, server_round: int, preflight: bool = False) -> dict:
        """Evaluate the current global adapter on the connected clients' held-out prompts, with a
        deadline; the aggregated metrics ({} when none was due or nobody answered). With
        ``preflight`` the evaluation carries the preflight, and any client error ends the run as
        the preflight's would: before anything trains."""
        parameters = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
        instructions = self.strategy.configure_evaluate(server_round, parameters, legacy.client_manager,
                                                        preflight=preflight)
        if not instructions:
            return {}
        start = time.perf_counter()
        results, failures = exchange(grid, instructions, MessageType.EVALUATE, server_round,
                                     self.federation.evaluate_timeout)
        if preflight:
            self.strategy.check_preflight(FIRST_ROUND, results, failures)
        _, metrics = self.strategy.aggregate_evaluate(server_round, results, failures)
        return {**metrics, "seconds": time.perf_counter() - start} if metrics else {}


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
