"""Sparse uploads (``compression.density``): the same round-seeded coordinates for every client,
their exact mean scattered back, and error feedback that keeps what was not sent."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.common import parameters_to_ndarrays

from flwr_verl.config import CompressionConfig, ConfigError, FederationConfig, SecAggConfig, parse_run_config
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.compression import (
    StateErrorFeedback,
    coordinate_mask,
    round_seed,
    scatter,
    select,
    with_error_feedback,
)
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.protocol import FitConfig, FitReport, SecAggBounds
from flwr_verl.federation.strategy import FedProxAdapters

SHAPES = [(4, 3), (5,), (2, 2, 2)]  # 25 coordinates


def federation(density: float, secure: bool = False) -> FederationConfig:
    return FederationConfig(min_fit_clients=3, min_evaluate_clients=3, min_available_clients=3, proximal_mu=0.0,
                            secagg=SecAggConfig(enabled=secure), compression=CompressionConfig(density=density))


def test_every_client_gets_the_same_mask_in_a_round_and_another_the_next_round():
    arrays = [np.zeros(s, dtype=np.float32) for s in SHAPES]
    strategy = FedProxAdapters(federation(0.2), arrays, local_iterations=1, mask_seed=7)
    masks = {}
    for server_round in (1, 2, 3):
        instructions = [FitConfig.from_config(dict(ins.config)) for _, ins in
                        strategy.configure_fit(server_round, None, InProcessClients.named(range(3)))]
        assert len({i.sparse for i in instructions}) == 1  # one SparseRound for every client
        sparse = instructions[0].sparse
        assert sparse.density == 0.2 and sparse.seed == round_seed(7, server_round)
        masks[server_round] = coordinate_mask(sparse.seed, 25, sparse.density)
        assert masks[server_round].shape == (5,)
    assert len({tuple(m) for m in masks.values()}) == 3  # differs across rounds
    assert not np.array_equal(coordinate_mask(round_seed(8, 1), 25, 0.2), masks[1])  # and across runs' seeds


def test_density_one_sends_no_sparse_instructions():
    strategy = FedProxAdapters(federation(1.0), [np.zeros(3)], local_iterations=1)
    (_, ins), *_ = strategy.configure_fit(1, None, InProcessClients.named(range(3)))
    assert FitConfig.from_config(dict(ins.config)).sparse is None


def test_error_feedback_keeps_exactly_what_was_not_sent():
    rng = np.random.default_rng(0)
    update = [rng.normal(size=s) for s in SHAPES]
    indices = coordinate_mask(3, 25, 0.25)
    sent, residual = with_error_feedback(update, None, indices)
    assert sent.shape == (6,)
    np.testing.assert_array_equal(sent, select(update, indices))
    for whole, part, rest in zip(update, scatter(sent, indices, SHAPES), residual):
        np.testing.assert_array_equal(part + rest, whole)  # sent + residual = the full update
    # Next round the residual rides along: sent + new residual = new update + old residual.
    update2 = [rng.normal(size=s) for s in SHAPES]
    indices2 = coordinate_mask(4, 25, 0.25)
    sent2, residual2 = with_error_feedback(update2, residual, indices2)
    for new, old, part, rest in zip(update2, residual, scatter(sent2, indices2, SHAPES), residual2):
        np.testing.assert_allclose(part + rest, new + old, rtol=0, atol=1e-15)


@pytest.mark.parametrize("density", [0.0, -0.25, 1.5])
def test_a_density_outside_zero_one_is_refused_naming_the_key(density):
    with pytest.raises(ConfigError, match=rf"compression.density={density!r} is invalid: must be in \(0, 1\]"):
        parse_run_config({"compression.density": density})


def test_compression_with_client_level_dp_is_refused():
    with pytest.raises(ConfigError, match="compression.density=0.5 is invalid: must be 1 with privacy.client_level"):
        parse_run_config({"compression.density": 0.5, "privacy.client_level.enabled": True})


def test_a_clientapp_keeps_its_residual_in_the_node_state_across_messages():
    """Each message runs in a fresh ClientApp process: the residual must live in the run's
    ``context.state``, which the SuperNode passes from message to message."""
    state = RecordDict()
    residual = [np.arange(6.0).reshape(2, 3), np.array([0.5, -1.0])]
    assert StateErrorFeedback(state).residual is None
    StateErrorFeedback(state).residual = residual
    kept = StateErrorFeedback(state).residual  # a later message's client, same state
    assert all(np.array_equal(k, r) for k, r in zip(kept, residual))
    assert StateErrorFeedback(RecordDict()).residual is None  # another run's state has none


@pytest.fixture(scope="module")
def engine(tiny_config):
    # 2 iterations of 8 prompts x 4 responses: every client gets some reward signal (a nonzero update)
    # in round 1 (with 1 x 8 x 2, a client's responses to each prompt could all score alike)
    return tiny_config(trainer={"local_iterations": 2}, rollout={"n": 4})


@pytest.fixture(scope="module")
def models(engine):
    return build_models(engine.model, with_critic=False, seed=0)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg_arithmetic"])
def test_the_aggregate_of_the_selected_coordinates_is_their_plain_mean(engine, models, secure):
    rows = [load_rows(engine.data, "train", 0, i, 3) for i in range(3)]
    clients = {str(i): VerlClient(engine, rows[i], [], partition_id=i, models=models) for i in range(3)}
    initial = models.adapters.get_arrays()
    shapes, total = [a.shape for a in initial], sum(a.size for a in initial)
    strategy = FedProxAdapters(federation(0.25, secure), initial, local_iterations=engine.trainer.local_iterations,
                               mask_seed=engine.trainer.seed,
                               secure_aggregation=SecAggBounds(1.0, 64.0) if secure else None)
    before = [w.detach().numpy().copy() for w in strategy.weights]
    results, _ = fit_round(strategy, InProcessClients(clients), server_round=1, secure=secure)

    indices = coordinate_mask(round_seed(engine.trainer.seed, 1), total, 0.25)
    sent = {proxy.cid: res for proxy, res in results}
    vectors = {cid: parameters_to_ndarrays(res.parameters) for cid, res in sent.items()}
    assert all(len(v) == 1 and v[0].shape == indices.shape for v in vectors.values())  # only the round's coordinates
    weights = {cid: res.num_examples for cid, res in sent.items()}
    mean = sum(weights[cid] * vectors[cid][0].astype(np.float64) for cid in vectors) / sum(weights.values())
    step = [w.detach().numpy() - b for w, b in zip(strategy.weights, before)]
    # Flower's plain mean of float32 vectors rounds in float32; SecAgg+'s arrives in float64.
    tolerance = 1e-12 if secure else 4 * np.finfo(np.float32).eps * np.abs(mean).max()
    np.testing.assert_allclose(select(step, indices), mean, rtol=0, atol=tolerance)
    untouched = np.ones(total, dtype=bool)
    untouched[indices] = False
    assert not np.concatenate([s.ravel() for s in step])[untouched].any()  # no update off the mask
    assert np.abs(mean).max() > 0  # the clients did train
    for cid, client in clients.items():  # each keeps the rest: zero exactly where it sent
        residual = np.concatenate([r.ravel() for r in client.error_feedback.residual])
        assert not residual[indices].any() and np.abs(residual[untouched]).max() > 0
        report = FitReport.from_metrics(sent[cid].metrics)
        assert report.bytes_sent == vectors[cid][0].nbytes  # a quarter of the coordinates
    assert [tuple(s.shape) for s in step] == [tuple(s) for s in shapes]
