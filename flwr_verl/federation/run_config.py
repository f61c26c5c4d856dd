"""The run config at the edge: Flower's flat run config parsed and validated
(``config.parse_run_config``), then checked for what its owners derive from it, so that every bad
value fails once, before anything trains, naming the key: verl's registered names
(``engine._verl.check_registered_names``), SecAgg+'s parameters (``secagg.derive_parameters``:
``secagg.precision`` must be reachable) and client-level DP's bit width
(``distributed_dp.plan_round``). The ServerApp, the ClientApp and the command lines read the run
config through ``load_run_config``."""

from __future__ import annotations

from typing import Any

from flwr_verl.config import RunConfig, parse_run_config
from flwr_verl.federation.secagg import derive_parameters, fewest_survivors
from flwr_verl.privacy.distributed_dp import plan_round


def load_run_config(run_config: dict[str, Any]) -> RunConfig:
    """``run_config`` parsed, validated and checked against what is derived from it."""
    from flwr_verl.engine._verl import check_registered_names  # imports verl: only once the config parses

    config = parse_run_config(run_config)
    check_registered_names(config.engine)
    client_level, secagg = config.engine.privacy.client_level, config.federation.secagg
    data, weights = config.engine.data, config.engine.privacy.num_examples
    known_max_weight = secagg.max_weight or weights == "fixed" or (not data.train_files and data.partition == "iid")
    if secagg.enabled and not client_level.enabled and known_max_weight:
        # secagg.precision must be reachable. The server derives the same settings again, and
        # reports an automatic max-weight that the data cannot give.
        derive_parameters(secagg, data, config.federation.min_fit_clients, weights)
    if client_level.enabled:
        # The bit width against the fewest clients a round samples, at the smallest update; the
        # server checks again with the round's real numbers before the clients train.
        fewest = config.federation.min_fit_clients
        plan_round(client_level, dim=1, num_clients=fewest,
                   min_survivors=fewest_survivors(fewest, secagg.num_shares, secagg.reconstruction_threshold))
    return config
