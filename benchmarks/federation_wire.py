"""Bytes on the wire: bytes per client per round, by direction and protocol stage, of the app's
real messages, serialized as Flower serializes them, for each option (SecAgg+, FFA-LoRA, sparse
uploads).

Goal: no target set.

    python benchmarks/federation_wire.py [--out DIR]

``measure_wire(run_config)`` runs the bundled ServerApp (``flwr_verl.federation.server.run_server``) and
ClientApp (``apps.client_app.app``, with its mods: SecAgg+ included) in this process, over a
``LoopbackGrid`` that hands each message straight to the destination node's ClientApp and its
reply straight back. Every message both ways is serialized with Flower's own protobuf serde
(``flwr.common.serde.message_to_proto(...).SerializeToString()``), the bytes a SuperLink
receives or sends for it, and counted per node, direction and protocol stage. Nothing is
estimated: under SecAgg+ the masked int64 vectors, public keys and encrypted shares are the
ones the protocol produced.

Real Flower adds framing (gRPC headers, TLS records) of a few dozen bytes per message; the
loopback skips the SuperLink's store-and-forward, which changes times, not message contents.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import harness  # first: puts this checkout on sys.path
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.server import Grid
from flwr.supercore.task_identity import TaskIdentity

from flwr_verl.federation.wire import stage_of
from flwr_verl.federation.wire import wire_bytes as transported_bytes


def wire_bytes(message: Message) -> tuple[int, int]:
    """Size of ``message`` as Flower's protobuf serde writes it, and as Flower 1.42 actually
    transports it (``flwr_verl.federation.wire.wire_bytes``: the sum of its deflated objects, each pushed
    to the SuperLink's object store separately)."""
    return len(message_to_proto(message).SerializeToString()), transported_bytes(message)


def over_the_wire(message: Message) -> Message:
    """The copy the other side gets: serialized and parsed again (the workflow sends one content
    object to several nodes, and SecAgg+'s mod changes what it receives)."""
    return message_from_proto(message_to_proto(message))


class LoopbackGrid(Grid):
    """A Grid whose nodes are ClientApps in this process, called one after the other with a
    serialized copy of each message; counts every message's serialized bytes.

    ``traffic[(node_id, direction, stage)]`` is a list with one entry per message: its
    ``wire_bytes`` (direction ``down``: server to client, ``up``: the reply)."""

    def __init__(self, client_app, node_contexts: dict[int, Context]) -> None:
        self.client_app, self.contexts = client_app, node_contexts
        self.traffic: dict[tuple[int, str, str], list[tuple[int, int]]] = defaultdict(list)
        self._run = SimpleNamespace(run_id=1)  # the legacy client manager reads only the run id
        self._replies: dict[str, Message] = {}

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id,
                       ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            node, stage = message.metadata.dst_node_id, stage_of(message)
            message.metadata.__dict__["_message_id"] = message_id = uuid.uuid4().hex
            self.traffic[(node, "down", stage)].append(wire_bytes(message))
            reply = self.client_app(over_the_wire(message), self.contexts[node])
            self.traffic[(node, "up", stage)].append(wire_bytes(reply))
            reply = over_the_wire(reply)
            self._replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def measure_wire(run_config: dict, num_clients: int, grid_class: type[LoopbackGrid] = LoopbackGrid,
                 ) -> tuple[dict[tuple[int, str, str], list[tuple[int, int]]], list[dict]]:
    """Run the app's server and clients over a ``grid_class`` grid; return its traffic record and
    the run's ``metrics.jsonl`` records (whose ``wire`` entries the server measured itself)."""
    from apps.client_app import app as client_app
    from flwr_verl.federation.server import run_server

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # a ServerApp process is told these; Message() reads them
    with tempfile.TemporaryDirectory() as tmp:
        config = {**run_config, "output-dir": str(Path(tmp) / "out")}
        contexts = {node: Context(run_id=1, node_id=node, state=RecordDict(), run_config=config,
                                  node_config={"partition-id": node - 1, "num-partitions": num_clients,
                                               "privacy-ledger": str(Path(tmp) / "ledger.sqlite")})
                    for node in range(1, num_clients + 1)}
        grid = grid_class(client_app, contexts)
        run = run_server(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=config, node_config={}))
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return dict(grid.traffic), records


def bytes_per_message(traffic: dict[tuple[int, str, str], list[tuple[int, int]]]) -> dict[str, dict[str, dict]]:
    """Serialized bytes of one client's message in the last round, mean over clients, by
    direction and stage: ``{"up": {"train": {"protobuf": b, "objects": b}}}``. Every fit stage sends
    one message per client per round, so this is also bytes per client per round. The last round,
    because in round 1 the global LoRA B matrices are all zero, and identical arrays are one
    object in Flower's object store."""
    grouped: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for (_, direction, stage), sizes in traffic.items():
        grouped[(direction, stage)].append(sizes[-1])
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for (direction, stage), sizes in sorted(grouped.items()):
        out[direction][stage] = {"protobuf": sum(p for p, _ in sizes) / len(sizes),
                                 "objects": sum(o for _, o in sizes) / len(sizes)}
    return dict(out)


# Each option on the tiny engine, 2 rounds (the last is measured: see ``bytes_per_message``).
OPTIONS = {
    "plain": {"secagg.enabled": False},
    "plain_ffa_lora": {"secagg.enabled": False, "model.lora_freeze_a": True},
    "secagg": {"secagg.enabled": True},
    "secagg_ffa_lora": {"secagg.enabled": True, "model.lora_freeze_a": True},
    **{f"secagg_density_{d:g}": {"secagg.enabled": True, "compression.density": d} for d in (0.25, 0.05)},
}
TINY_RUN = {"num-server-rounds": 2, "min-fit-clients": 3, "min-evaluate-clients": 3, "min-available-clients": 3,
            "evaluate-every": 0, "data.train_size": 32, "data.val_size": 8, "data.train_batch_size": 8,
            "rollout.n": 2, "rollout.response_length": 6, "actor.ppo_mini_batch_size": 4,
            "trainer.local_iterations": 1, "privacy.enabled": False}


def main() -> None:
    """Bytes per client per round, each option, by direction and stage, and per adapter parameter."""
    from flwr_verl.config import parse_run_config
    from flwr_verl.engine.models import build_models

    parser = harness.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args()
    results = {}
    for name, option in OPTIONS.items():
        config = {**TINY_RUN, **option}
        params = build_models(parse_run_config(config).engine.model, with_critic=False).adapters.num_parameters()
        per_message = bytes_per_message(measure_wire(config, num_clients=3)[0])
        totals = {d: sum(s["objects"] for name, s in stages.items() if name != "get_properties")  # once a run
                  for d, stages in per_message.items()}
        results[name] = {"adapter_parameters_sent": params, "per_message": per_message, "per_round": totals,
                         "per_round_per_parameter": {d: b / params for d, b in totals.items()}}
        stages = ", ".join(f"{d} {s} {v['objects']:.0f}" for d, st in per_message.items() for s, v in st.items())
        print(f"{name:16s} {params} parameters; per client per round: up {totals['up']:.0f} B "
              f"({totals['up'] / params:.2f} B/param), down {totals['down']:.0f} B "
              f"({totals['down'] / params:.2f} B/param); {stages}", flush=True)
    harness.write_json(args.out / "federation_wire.json", results)


if __name__ == "__main__":
    main()
