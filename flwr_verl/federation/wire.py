"""Bytes on the wire: every message the server exchanges, measured as Flower transports it.

Flower 1.42 moves a message as separate deflated objects (the message, its records, each array's
chunks) through the SuperLink's object store; ``wire_bytes`` is their sum, per message, so each
client is charged everything it receives or sends (objects it shares with other clients'
messages included). gRPC and TLS framing add a few dozen bytes per object on top.

``MeteredGrid`` wraps the ServerApp's ``Grid`` and counts every message both ways, per node,
direction (``down``: server to client, ``up``: the reply) and stage (``get_properties``, ``fit``,
``evaluate``, or the SecAgg+ stage: ``secagg_setup``, ``secagg_share_keys``,
``secagg_collect_masked_vectors``, ``secagg_unmask``). ``WireMeter.take`` summarises and resets
it; ``workflow.RoundLoop`` writes that summary into each round's ``metrics.jsonl`` record.
Both wrappers are ``grid.PollingGrid``s: they change only how messages are pushed and pulled.

``NodeNamedErrors`` wraps it too and puts the node id of the addressee in front of every error
reply: "node <id>: <reason>". Flower's SecAgg+ workflow keeps a failed client's error without its
node id, and the client's own reason names only what the client calls itself, which any node can
claim; the node id (bound to the node's key under SuperNode authentication) is what the strategy
keys its per-client state on.

What a parameter costs: in the clear, its dtype (float32 from clients, float64 from the server's
global weights). Under SecAgg+ each masked entry is an int64 (8 bytes) whatever the modulus:
the 2**40 modulus needs 40 bits, so 3 of every 8 bytes carry nothing, and a 2**k modulus packed
to k bits would cost k/8 bytes (Flower 1.42 has no narrower integer type for it).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

from flwr.app import Error, Message
from flwr.server import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from flwr_verl.federation.grid import PollingGrid

SECAGG_RECORD = "secaggplus_configs"  # flwr.common.secure_aggregation's RECORD_KEY_CONFIGS


def wire_bytes(message: Message) -> int:
    """The sum of ``message``'s deflated objects: what Flower 1.42 pushes and pulls for it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def stage_of(message: Message) -> str:
    """The protocol stage a message belongs to (its type, or its SecAgg+ stage)."""
    kind = message.metadata.message_type.partition(".")[0]
    if message.has_content() and (config := message.content.config_records.get(SECAGG_RECORD)) and "stage" in config:
        return f"secagg_{config['stage']}"
    return kind


class WireMeter:
    """Serialized bytes per (node, direction, stage), and each stage's wall time (from its push
    to its last reply pulled), until ``take``."""

    def __init__(self) -> None:
        self.traffic: dict[tuple[int, str, str], int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def count(self, message: Message, direction: str, node_id: int, stage: str) -> None:
        self.traffic[(node_id, direction, stage)] += wire_bytes(message)

    def take(self) -> dict:
        """``{"up": {stage: bytes}, "down": {...}, "per_client": {node: {"up": b, "down": b}},
        "seconds": {stage: s}}`` (bytes summed over the clients), then start counting afresh."""
        out: dict = {"up": defaultdict(int), "down": defaultdict(int), "per_client": {}}
        for (node, direction, stage), size in sorted(self.traffic.items()):
            out[direction][stage] += size
            out["per_client"].setdefault(str(node), {"up": 0, "down": 0})[direction] += size
        seconds = dict(self.seconds)
        self.traffic.clear()
        self.seconds.clear()
        return {"up": dict(out["up"]), "down": dict(out["down"]), "per_client": out["per_client"], "seconds": seconds}


class MeteredGrid(PollingGrid):
    """A ``Grid`` that passes everything to ``grid`` and counts each message on ``meter``.

    A reply is charged to the stage of the message it answers (an error reply carries no
    SecAgg+ stage of its own)."""

    def __init__(self, grid: Grid, meter: WireMeter) -> None:
        super().__init__(grid)
        self.meter = meter
        self._stages: dict[str, tuple[str, float]] = {}  # message id -> (its stage, pushed at), until answered

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.grid.push_messages(messages))
        pushed_at = time.perf_counter()
        for message, message_id in zip(messages, ids):
            stage = stage_of(message)
            self._stages[message_id] = (stage, pushed_at)
            self.meter.count(message, "down", message.metadata.dst_node_id, stage)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.grid.pull_messages(message_ids))
        pulled_at = time.perf_counter()
        for reply in replies:
            stage, pushed_at = self._stages.pop(reply.metadata.reply_to_message_id, (stage_of(reply), pulled_at))
            self.meter.count(reply, "up", reply.metadata.src_node_id, stage)
            self.meter.seconds[stage] = max(self.meter.seconds[stage], pulled_at - pushed_at)
        return replies


class NodeNamedErrors(PollingGrid):
    """A ``Grid`` that passes everything to ``grid`` and names, in every error reply, the node that
    the answered message was sent to (the SuperLink's errors about a dead node included)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self._addressee: dict[str, int] = {}  # message id -> its destination node, until answered

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.grid.push_messages(messages))
        self._addressee.update(zip(ids, (m.metadata.dst_node_id for m in messages)))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._named(reply) for reply in self.grid.pull_messages(message_ids)]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        try:
            return super().send_and_receive(messages, timeout=timeout)
        finally:  # unanswered ones too: nothing outlives the call
            for message in messages:
                self._addressee.pop(message.metadata.message_id, None)

    def _named(self, reply: Message) -> Message:
        node = self._addressee.pop(reply.metadata.reply_to_message_id, None)
        if reply.has_error() and node is not None:
            reply.error = Error(reply.error.code, f"node {node}: {reply.error.reason or ''}")
        return reply
