"""A federation in one process, without Flower's transport: the strategy and ``VerlClient``s call
each other directly, through the same typed messages as over the wire.

For experiments that need many rounds and seeds (benchmarks), for GPU smoke checks, and for
tests of the strategy's decisions. What Flower adds on top (transport, SecAgg+ masking, process
isolation) is measured and tested with real Flower processes instead.

    clients = {str(i): VerlClient(config, train[i], val[i], partition_id=i) for i in range(3)}
    manager = InProcessClients(clients)
    evaluate_round(strategy, manager, 0)  # the initial adapter
    for server_round in range(1, 9):
        fit_round(strategy, manager, server_round)
        evaluate_round(strategy, manager, server_round)
"""

from __future__ import annotations

import random

from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy
from flwr.server.criterion import Criterion

from flwr_verl.federation.strategy import FedProxAdapters


class InProcessProxy(ClientProxy):
    """Names one in-process client for the strategy; it never carries a message itself."""

    def _not_over_a_wire(self, *args, **kwargs):
        raise RuntimeError(f"client {self.cid} is in this process: call it directly (see fit_round)")

    get_properties = get_parameters = fit = evaluate = reconnect = _not_over_a_wire


class InProcessClients:
    """The part of Flower's ``ClientManager`` that ``FedProxAdapters`` uses, over clients that live
    in this process (any objects with the ``NumPyClient`` methods, keyed by cid). Every client is
    always available, so nothing ever waits. ``rng``: sample as Flower does, uniformly at random
    (needed below fraction-fit 1, where privacy amplification by sampling assumes a random
    sample); None: the first clients in cid order, deterministic."""

    def __init__(self, clients: dict[str, object], rng: random.Random | None = None) -> None:
        self.clients = dict(clients)
        self.proxies = {cid: InProcessProxy(cid) for cid in self.clients}
        self.rng = rng

    @classmethod
    def named(cls, cids, rng: random.Random | None = None) -> InProcessClients:
        """Clients known by name only: enough for the strategy's sampling decisions."""
        return cls({str(cid): None for cid in cids}, rng)

    def num_available(self) -> int:
        return len(self.proxies)

    def all(self) -> dict[str, ClientProxy]:
        return dict(self.proxies)

    def wait_for(self, num_clients: int, timeout: float) -> bool:
        return len(self.proxies) >= num_clients

    def sample(self, num_clients: int, min_num_clients: int | None = None,
               criterion: Criterion | None = None) -> list[ClientProxy]:
        """``num_clients`` eligible clients: a uniform sample with ``rng``, else the first in cid order."""
        eligible = [p for p in self.proxies.values() if criterion is None or criterion.select(p)]
        if len(eligible) < num_clients:
            return []
        return self.rng.sample(eligible, num_clients) if self.rng else eligible[:num_clients]


def fit_round(strategy: FedProxAdapters, manager: InProcessClients, server_round: int,
              secure: bool = False) -> tuple[list[tuple[ClientProxy, FitRes]], dict]:
    """One round: the strategy's instructions, each sampled client's ``fit``, the aggregation.
    Returns what the clients sent and the round's aggregated fit metrics.

    ``secure``: SecAgg+'s arithmetic without its masking or quantization: the strategy gets every
    ``FitRes`` carrying the num_examples-weighted mean of the updates, as ``SecAggPlusWorkflow``
    hands it over. For client-level DP's integers (weight 1) that is Flower's result exactly
    (``tests/privacy/test_distributed_dp.py`` compares with real SecAgg+)."""
    results = []
    for proxy, ins in strategy.configure_fit(server_round, ndarrays_to_parameters(strategy.global_arrays), manager):
        update, num_examples, metrics = manager.clients[proxy.cid].fit(parameters_to_ndarrays(ins.parameters),
                                                                      dict(ins.config))
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), num_examples, metrics)))
    received = results
    if secure:
        total = sum(res.num_examples for _, res in results)
        updates = [(parameters_to_ndarrays(res.parameters), res.num_examples) for _, res in results]
        mean = ndarrays_to_parameters([sum(n * arrays[i] for arrays, n in updates) / total
                                       for i in range(len(updates[0][0]))])
        received = [(proxy, FitRes(res.status, mean, res.num_examples, res.metrics)) for proxy, res in results]
    _, metrics = strategy.aggregate_fit(server_round, received, [])
    return results, metrics


def evaluate_round(strategy: FedProxAdapters, manager: InProcessClients,
                   server_round: int) -> tuple[float | None, dict]:
    """The strategy's evaluation of its global adapter on each sampled client's held-out data
    (round 0: the initial adapter): Flower's aggregated loss and metrics, as ``aggregate_evaluate``
    returns them."""
    results = []
    for proxy, ins in strategy.configure_evaluate(server_round, ndarrays_to_parameters(strategy.global_arrays),
                                                  manager):
        loss, num_examples, metrics = manager.clients[proxy.cid].evaluate(parameters_to_ndarrays(ins.parameters),
                                                                          dict(ins.config))
        results.append((proxy, EvaluateRes(Status(Code.OK, ""), loss, num_examples, metrics)))
    return strategy.aggregate_evaluate(server_round, results, [])
