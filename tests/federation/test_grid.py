"""How the server waits for replies (``federation.grid.PollingGrid``): every reply is collected
however late it arrives within the deadline, nothing is waited for past the deadline, and the
server's wrappers keep their behaviour on top of it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from flwr_verl.federation.grid import PollingGrid, QueuedGrid


def reply(answers: str) -> SimpleNamespace:
    """What the grid reads of a Flower reply: the id of the message it answers."""
    return SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=answers))


class SlowGrid:
    """Replies to message ``i`` from the ``ready_after[i]``-th pull on; None: never."""

    def __init__(self, ready_after: list[int | None]) -> None:
        self.ready_after, self.pulls, self.sent = ready_after, 0, set()

    def push_messages(self, messages):
        return [str(i) for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        ready = [i for i in message_ids if (after := self.ready_after[int(i)]) is not None and self.pulls >= after]
        self.sent.update(ready)
        return [reply(i) for i in ready]


def test_every_reply_is_collected_however_many_pulls_it_takes():
    grid = SlowGrid([1, 4, 12])
    replies = PollingGrid(grid).send_and_receive([object()] * 3, timeout=600)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "1", "2"]
    assert grid.pulls == 12  # it stopped pulling once everything had arrived


def test_what_has_not_arrived_by_the_deadline_is_left_out_and_the_call_returns():
    grid = SlowGrid([1, None])
    started = time.monotonic()
    replies = PollingGrid(grid).send_and_receive([object()] * 2, timeout=0.5)
    assert [r.metadata.reply_to_message_id for r in replies] == ["0"]
    assert time.monotonic() - started < 60  # a deadline, not a hang (generous: a loaded machine)
    assert grid.pulls > 1


def test_no_timeout_waits_until_the_last_reply():
    grid = SlowGrid([30])
    assert len(PollingGrid(grid).send_and_receive([object()], timeout=None)) == 1


def test_a_queued_grid_gives_its_first_exchange_the_time_of_the_work_ahead_and_no_other():
    """Behind an overlapped evaluation (up to 300 s more), the first stage's replies are due 300 s
    later than its own timeout; the stages after it keep theirs; no timeout stays no timeout."""
    deadlines = []

    class Recorded(QueuedGrid):
        def receive(self, message_ids, deadline):
            deadlines.append(None if deadline is None else deadline - time.monotonic())
            return []

    grid = Recorded(SlowGrid([None]), queued_s=300.0)
    for timeout in (60.0, 60.0):
        grid.send_and_receive([object()], timeout=timeout)
    assert 330 < deadlines[0] <= 360 and 30 < deadlines[1] <= 60  # generous below: a loaded machine
    Recorded(SlowGrid([None]), queued_s=300.0).send_and_receive([object()], timeout=None)
    assert deadlines[2] is None


def test_in_simulation_a_reply_waits_at_most_20_ms_to_be_seen_and_in_a_deployment_at_most_250(monkeypatch):
    """A pull of Flower's in-process InMemoryGrid is a lookup; a deployment's is a request to the
    SuperLink. The waits between pulls (what the grid asks ``time.sleep`` for) grow to 20 ms in
    simulation and to 250 ms in a deployment, through a wrapper too."""
    from flwr.superlink.grid import InMemoryGrid

    from flwr_verl.federation import grid as grid_module

    class InMemorySlowGrid(SlowGrid, InMemoryGrid):
        pass

    waits: list[float] = []
    clock = [0.0]

    def sleep(seconds: float) -> None:  # a clock that advances by exactly what was asked
        waits.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(grid_module, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    for fake, longest in ((InMemorySlowGrid([None]), 0.02), (SlowGrid([None]), 0.25)):
        waits.clear()
        PollingGrid(PollingGrid(fake)).send_and_receive([object()], timeout=5)
        assert max(waits) == pytest.approx(longest) and sum(waits) == pytest.approx(5)
