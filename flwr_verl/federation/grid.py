"""How the server waits for replies: a ``Grid`` that polls for them promptly.

Flower 1.42's grids wait for replies in fixed sleeps between pulls: 3 s in a deployment's
``HttpGrid.send_and_receive``, 0.1 s in the simulation's ``InMemoryGrid``. Every message stage of
a round waits for its slowest reply plus up to that sleep, and a SecAgg+ round has five stages
(setup, key sharing, masked fit, unmasking, then evaluation), so a deployment round idled for up
to 15 s around fits of a few seconds. Neither sleep has a setting.

``PollingGrid`` forwards everything to the grid it wraps and implements ``send_and_receive`` with
the grid's public ``push_messages`` and ``pull_messages``: it pulls at once, then after
``FIRST_POLL_S``, growing by ``POLL_GROWTH`` up to ``MAX_POLL_S``, so a reply that arrives within
a second is seen within a few tens of milliseconds, and a long fit costs at most a few pulls a
second (one small request to the SuperLink each). In simulation a pull is a lookup in the
process's own state, so the waits stop growing at ``MAX_POLL_IN_PROCESS_S``. The server's other wrappers
(``wire.MeteredGrid``, ``wire.NodeNamedErrors``) subclass it and override only what they change.

What the server cannot shorten: a SuperNode with nothing to do asks the SuperLink for a message
every 3 s (``flwr.supernode.start_client_internal``, no setting), so each stage may still wait up
to 3 s before a node sees its message. ``docs/deployment.md`` gives the measured cost. Where a
node's next message does not depend on its last reply, the server can have it waiting: with
``overlap-evaluation`` (``workflow.RoundLoop``) a round's evaluation and the next round's first
message go out together, and ``QueuedGrid`` gives that first message's stage the time the
evaluation ahead of it may take.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.server import Grid
from flwr.superlink.grid import InMemoryGrid

FIRST_POLL_S = 0.005
POLL_GROWTH = 1.5
MAX_POLL_S = 0.25  # deployment: a long fit costs 4 pulls a second, each a request to the SuperLink
MAX_POLL_IN_PROCESS_S = 0.02  # simulation (InMemoryGrid): a pull is a lookup in this process


class PollingGrid(Grid):
    """A ``Grid`` that passes everything to ``grid`` and waits for replies by polling it promptly.

    Args:
        grid: the grid to wrap (Flower's, or another ``PollingGrid``).
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        # Flower's simulation (its InMemoryGrid at the bottom of the wrappers), or a deployment.
        self.in_process = grid.in_process if isinstance(grid, PollingGrid) else isinstance(grid, InMemoryGrid)
        self.max_poll_s = MAX_POLL_IN_PROCESS_S if self.in_process else MAX_POLL_S  # the longest a reply waits unseen

    def set_run(self, run_id: int) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and return their replies once all have arrived, or whichever arrived
        within ``timeout`` seconds (None: no deadline), as Flower's grids do."""
        ids = self.push_messages(messages)
        return self.receive(ids, None if timeout is None else time.monotonic() + timeout)

    def receive(self, message_ids: Iterable[str], deadline: float | None) -> list[Message]:
        """The replies to the pushed ``message_ids`` once all have arrived, or whichever arrived by
        ``deadline`` (``time.monotonic()``; None: none)."""
        pending = set(message_ids)
        replies: list[Message] = []
        interval = FIRST_POLL_S
        while True:
            arrived = list(self.pull_messages(pending))
            replies += arrived
            pending -= {reply.metadata.reply_to_message_id for reply in arrived}
            if not pending:
                return replies
            remaining = float("inf") if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return replies
            time.sleep(min(interval, remaining))
            interval = min(interval * POLL_GROWTH, self.max_poll_s)


class QueuedGrid(PollingGrid):
    """A ``PollingGrid`` whose first ``send_and_receive`` waits ``queued_s`` longer than asked: its
    messages reach nodes that still have earlier work to finish (an evaluation pushed just before),
    and a node answers them only after that.

    Args:
        grid: the grid to wrap.
        queued_s: the longest the earlier work may still take (its own deadline's remainder).
    """

    def __init__(self, grid: Grid, queued_s: float) -> None:
        super().__init__(grid)
        self.queued_s = queued_s

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        extra, self.queued_s = self.queued_s, 0.0
        return super().send_and_receive(messages, timeout=None if timeout is None else timeout + extra)
