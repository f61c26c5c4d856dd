"""``overlap-evaluation``: in a deployment a SuperNode runs one message at a time and idles 3 s
when none is waiting, so the server pushes a round's evaluation and the next round's first
message together. Each node then finds that message waiting; what is computed does not change,
and the records come out whole and in order. In simulation nothing overlaps: Flower's simulation
could run both messages of one node at once.

The app's real ServerApp and ClientApps (SecAgg+ mods included) run in this process over the
loopback grid of ``benchmarks/federation_wire.py``, which answers each message as it is pushed
and hands the reply over when it is pulled; the grid here records the order of both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from flwr.superlink.grid import InMemoryGrid

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from federation_wire import LoopbackGrid, measure_wire  # noqa: E402

from flwr_verl.federation.rundir import RunDirectory  # noqa: E402

RUN = {"num-server-rounds": 3, "min-fit-clients": 3, "min-evaluate-clients": 3, "min-available-clients": 3,
       "data.train_size": 32, "data.val_size": 8, "data.train_batch_size": 8, "rollout.n": 2,
       "rollout.response_length": 6, "actor.ppo_mini_batch_size": 4, "trainer.local_iterations": 1,
       "privacy.enabled": False, "secagg.enabled": True}


def recording(base: type[LoopbackGrid]):
    """A ``base`` grid class that appends ``(push | pull, message type, round)`` to ``events``."""
    events: list[tuple[str, str, int]] = []

    class Recording(base):
        def push_messages(self, messages):
            messages = list(messages)
            events.extend(("push", m.metadata.message_type, int(m.metadata.group_id)) for m in messages)
            return super().push_messages(messages)

        def pull_messages(self, message_ids):
            replies = list(super().pull_messages(message_ids))
            events.extend(("pull", r.metadata.message_type, int(r.metadata.group_id)) for r in replies)
            return replies

    return Recording, events


class SimulationGrid(LoopbackGrid, InMemoryGrid):
    """The loopback grid, typed as the grid Flower's simulation hands a ServerApp."""


def first(events: list, *event) -> int:
    return events.index(event)


def last(events: list, *event) -> int:
    return len(events) - 1 - events[::-1].index(event)


@pytest.fixture(scope="module")
def runs():
    """Per schedule: the grid's events, and the records and checkpoints written, in order."""
    out = {}
    for name, grid, overlap in (("overlap", LoopbackGrid, True), ("sequential", LoopbackGrid, False),
                                ("simulation", SimulationGrid, True)):
        grid_class, events = recording(grid)
        writes: list[tuple[str, int]] = []
        append, save = RunDirectory.append_metrics, RunDirectory.save

        def appended(run, record, writes=writes):
            writes.append(("record", record["round"]))
            return append(run, record)

        def saved(run, state, final, writes=writes):
            writes.append(("checkpoint", state["round"]))
            return save(run, state, final)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RunDirectory, "append_metrics", appended)
            patch.setattr(RunDirectory, "save", saved)
            _, records = measure_wire({**RUN, "overlap-evaluation": overlap}, num_clients=3, grid_class=grid_class)
        out[name] = events, records, writes
    return out


def test_the_next_rounds_setup_goes_out_before_the_evaluations_replies_are_collected(runs):
    events, _, writes = runs["overlap"]
    for evaluated in (1, 2):  # round 3 is the last: its evaluation has nothing to overlap
        assert first(events, "push", "train", evaluated + 1) < first(events, "pull", "evaluate", evaluated)
        # Its record is still written before the next round's checkpoint, which resume trusts.
        assert writes.index(("record", evaluated)) < writes.index(("checkpoint", evaluated + 1))


@pytest.mark.parametrize("name", ["sequential", "simulation"])
def test_without_overlap_each_evaluation_is_collected_before_the_next_round_starts(runs, name):
    events, _, _ = runs[name]
    for evaluated in (1, 2):
        assert last(events, "pull", "evaluate", evaluated) < first(events, "push", "train", evaluated + 1)


def test_overlap_changes_when_messages_go_not_what_is_computed_or_recorded(runs):
    _, overlapped, _ = runs["overlap"]
    _, sequential, _ = runs["sequential"]
    assert [r["round"] for r in overlapped] == [0, 1, 2, 3]
    for with_overlap, without in zip(overlapped, sequential, strict=True):
        assert with_overlap["round"] == without["round"]
        assert with_overlap["evaluate"]["accuracy"] == without["evaluate"]["accuracy"]
        # The same training, up to the noise of SecAgg+'s stochastic rounding (secagg.precision):
        # Flower's quantize draws from numpy's global generator, which the two schedules leave in
        # different states.
        assert with_overlap.get("update_max_abs") == pytest.approx(without.get("update_max_abs"), rel=1e-3)
        assert with_overlap.get("fit", {}).get("reward_after") == without.get("fit", {}).get("reward_after")
        # Each round's record holds its own traffic: the evaluation's, and none of the next round's.
        for direction in ("up", "down"):
            assert with_overlap["wire"][direction] == without["wire"][direction]
