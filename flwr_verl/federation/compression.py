"""Sparse uploads that SecAgg+ can sum: every client sends the same random coordinates each round.

With ``compression.density = d < 1`` the server derives a seed from the run's ``trainer.seed``
and the round (``round_seed``) and sends it with the round's instructions
(``protocol.SparseRound``). Every client draws the same ``k = max(1, round(d * D))`` of the
adapter's ``D`` coordinates from it (``coordinate_mask``) and uploads only those, as one
vector of shape ``(k,)`` (``select``). The vectors of all clients are aligned, so SecAgg+ sums
them as it sums dense ones, and the server scatters the mean back into the adapter's shapes
(``scatter``): the coordinates not drawn get no update this round (a momentum or Adam server
optimizer still moves them by its momentum).

Error feedback (Stich et al. 2018, "Sparsified SGD with memory"): what a client does not send
is kept as its residual and added to its next round's update (``with_error_feedback``), so no
coordinate's update is lost, only delayed. The residual never leaves the client.

Privacy: the mask is a function of the round and the run's seed only, never of any client's
data or update, so choosing it reveals nothing and costs no privacy: what a client sends is a
fixed projection of its (DP-noised) update plus earlier residuals, i.e. post-processing of
mechanisms already accounted. (Top-k selection, by contrast, would depend on the data and
would not align across clients under SecAgg+.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def round_seed(run_seed: int, server_round: int) -> int:
    """The round's mask seed, from the run's ``trainer.seed`` and the round (a non-negative
    int64, so that it travels in a Flower config record)."""
    return int(np.random.SeedSequence([run_seed, server_round]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def coordinate_mask(seed: int, total: int, density: float) -> np.ndarray:
    """The sorted indices, shape ``(k,)`` with ``k = max(1, round(density * total))``, of the
    coordinates sent this round, out of ``total`` (the adapter arrays flattened and concatenated
    in order). The same for every caller with the same arguments."""
    k = min(total, max(1, round(density * total)))
    return np.sort(np.random.default_rng(seed).choice(total, size=k, replace=False))


def select(arrays: list[np.ndarray], indices: np.ndarray) -> np.ndarray:
    """The coordinates ``indices`` of ``arrays`` (flattened and concatenated), shape ``(k,)``."""
    return np.concatenate([np.ravel(a) for a in arrays])[indices]


def scatter(values: np.ndarray, indices: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Arrays of ``shapes`` holding ``values`` (shape ``(k,)``) at ``indices`` and 0 elsewhere:
    the inverse of ``select`` on the selected coordinates."""
    flat = np.zeros(sum(int(np.prod(s)) for s in shapes), dtype=values.dtype)
    flat[indices] = values
    return _unflatten(flat, shapes)


def _unflatten(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    sizes = [int(np.prod(s)) for s in shapes]
    return [part.reshape(shape) for part, shape in zip(np.split(flat, np.cumsum(sizes)[:-1]), shapes)]


def with_error_feedback(update: list[np.ndarray], residual: list[np.ndarray] | None,
                        indices: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """What to send and what to keep: ``corrected = update + residual`` (arrays of the adapter's
    shapes; no residual is zeros); returns ``select(corrected, indices)``, shape ``(k,)``, and the
    new residual, ``corrected`` with the sent coordinates set to 0. So
    ``scatter(sent) + new_residual == update + residual`` exactly."""
    corrected = update if residual is None else [u + r for u, r in zip(update, residual, strict=True)]
    sent = select(corrected, indices)
    kept = np.concatenate([np.ravel(a) for a in corrected])
    kept[indices] = 0
    return sent, _unflatten(kept, [a.shape for a in corrected])


@dataclass
class ErrorFeedback:
    """One client's residual (arrays of the adapter's shapes; None before its first sparse round).

    It lives as long as this object: a ``VerlClient`` built in process keeps its own. A ClientApp
    runs each message in a fresh process, so it keeps the residual in Flower's ``Context.state``
    instead (``StateErrorFeedback``), which the SuperNode holds from message to message of a run."""

    residual: list[np.ndarray] | None = None


class StateErrorFeedback(ErrorFeedback):
    """The residual stored in a Flower ``RecordDict`` (a ClientApp's ``context.state``): it
    outlives the ClientApp process and stays on the node, as the SuperNode keeps a run's state
    (a SuperNode restart loses it: at most the unsent part of the updates so far)."""

    KEY = "flwr_verl.error_feedback"

    def __init__(self, state) -> None:  # state: flwr.app.RecordDict
        self._state = state

    @property
    def residual(self) -> list[np.ndarray] | None:
        record = self._state.array_records.get(self.KEY)
        return None if record is None else record.to_numpy_ndarrays()

    @residual.setter
    def residual(self, arrays: list[np.ndarray] | None) -> None:
        from flwr.app import ArrayRecord

        if arrays is None:
            self._state.array_records.pop(self.KEY, None)
        else:
            self._state.array_records[self.KEY] = ArrayRecord([np.asarray(a) for a in arrays])
