"""The federation's configuration, in Flower's kebab-case names (``num-server-rounds``,
``proximal-mu``, ``secagg.*``, ``compression.*``), and ``RunConfig``, the whole app's.
Quantities derived from it (SecAgg+'s parameters, a round's client-level noise plan) are computed
by their owners (``federation.secagg``, ``privacy.distributed_dp``), never here."""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr_verl.config.engine import EngineConfig
from flwr_verl.config.errors import require

# The largest server learning rate each server optimizer allows; the defaults are in
# ``FederationConfig.effective_server_learning_rate``. FedAdam moves every coordinate by about
# +-lr each step, whatever the update's size, and keeps moving as the updates shrink: lr 1 wrecks
# a LoRA adapter, whose round updates are ~1e-2 per coordinate, so it is capped at the top of
# Reddi et al. (2021)'s server learning rates (1e-3 to 1e-1).
MAX_SERVER_LEARNING_RATES = {"sgd": 2.0, "momentum": 2.0, "adam": 0.1}
AGGREGATIONS = ("mean", "fednova", "median", "trimmed_mean")
ROBUST_AGGREGATIONS = ("median", "trimmed_mean")  # read each update: in the clear only


@dataclass
class SecAggConfig:
    enabled: bool = True
    num_shares: int = 3  # clients that hold a share of each client's secrets
    reconstruction_threshold: int = 2  # shares needed to unmask: the round survives num_shares - this dropouts
    clipping_range: float = 1.0  # bound on |update| per coordinate; larger is an error, never clipped
    max_weight: int = 0  # bound on any client's num_examples; 0 = derive from data.train_size
    timeout: float = 300.0
    precision: float = 1e-7  # max abs error of the aggregate vs exact FedAvg: sets the quantization range (secagg.py)

    def __post_init__(self) -> None:
        require(self.num_shares >= 3, "secagg.num-shares", self.num_shares, "must be >= 3 (Flower's SecAgg+)")
        require(2 <= self.reconstruction_threshold < self.num_shares, "secagg.reconstruction-threshold",
                self.reconstruction_threshold, f"must be in [2, secagg.num-shares={self.num_shares})")
        require(self.clipping_range > 0, "secagg.clipping-range", self.clipping_range, "must be > 0")
        require(self.max_weight >= 0, "secagg.max-weight", self.max_weight, "must be >= 0 (0 = auto)")
        require(self.timeout > 0, "secagg.timeout", self.timeout, "must be > 0")
        require(0 < self.precision < self.clipping_range, "secagg.precision", self.precision,
                f"must be in (0, secagg.clipping-range={self.clipping_range:g}): the max abs error of the secure "
                "aggregate against exact FedAvg")


@dataclass
class CompressionConfig:
    """Sparse uploads (``compression.py``): each round every client sends the same random
    ``density`` share of the adapter's coordinates, keeping the rest as an error-feedback residual."""

    density: float = 1.0  # 1 = off: every coordinate travels

    def __post_init__(self) -> None:
        require(0 < self.density <= 1, "compression.density", self.density,
                "must be in (0, 1] (the share of coordinates each client uploads per round; 1 = all)")


@dataclass
class FederationConfig:
    num_server_rounds: int = 8
    fraction_fit: float = 1.0
    fraction_evaluate: float = 1.0
    min_fit_clients: int = 3
    min_evaluate_clients: int = 3
    min_available_clients: int = 3
    proximal_mu: float = 0.01
    server_optimizer: str = "sgd"  # sgd (FedAvg/FedProx), momentum (FedAvgM), adam (FedAdam)
    server_learning_rate: float = 0.0  # 0: the optimizer's default (effective_server_learning_rate)
    server_momentum: float = 0.9
    # mean: the num_examples-weighted mean of the updates (FedAvg, FedProx). fednova: FedNova's
    # normalised averaging (Wang et al. 2020), so clients that ran more local iterations do not
    # dominate: each client divides its update by its iterations, the server scales the mean by
    # the mean iteration count (strategy.FedProxAdapters). median, trimmed_mean: robust to a few
    # malicious updates (coordinate-wise, unweighted; Flower's aggregate_median/_trimmed_avg), in the clear only.
    aggregation: str = "mean"
    trim_fraction: float = 0.2  # aggregation = "trimmed_mean": the share of updates cut at each end, per coordinate
    evaluate_every: int = 1
    save_every: int = 1
    # Deadlines, in seconds: every wait of the server has one, and a message naming who is missing.
    connect_timeout: float = 120.0  # for min-available-clients SuperNodes to be connected before a round
    fit_timeout: float = 1800.0  # for the sampled clients' fit replies (plain rounds; SecAgg+ has secagg.timeout)
    evaluate_timeout: float = 600.0  # for the evaluation replies
    # Deployments: push a round's evaluation and the next round's first message together, so a
    # SuperNode finds its next message waiting instead of idling 3 s (workflow.RoundLoop).
    overlap_evaluation: bool = True
    output_dir: str = "~/flwr_verl_runs"
    resume: bool = False
    inject_failure_partition: int = -1  # tests: this partition's fit raises (-1 = none)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    @property
    def effective_server_learning_rate(self) -> float:
        """``server-learning-rate``, or the chosen optimizer's default when it is 0: sgd 1 (FedAvg,
        FedProx: the mean update applied as is); momentum 1 - server-momentum, which keeps
        FedAvgM's effective step lr / (1 - momentum) at 1; adam 1e-3, the low end of Reddi et al."""
        if self.server_learning_rate:
            return self.server_learning_rate
        return {"sgd": 1.0, "momentum": 1.0 - self.server_momentum, "adam": 1e-3}[self.server_optimizer]

    def __post_init__(self) -> None:
        require(self.num_server_rounds >= 1, "num-server-rounds", self.num_server_rounds, "must be >= 1")
        require(0 < self.fraction_fit <= 1, "fraction-fit", self.fraction_fit, "must be in (0, 1]")
        require(0 <= self.fraction_evaluate <= 1, "fraction-evaluate", self.fraction_evaluate, "must be in [0, 1]")
        for key in ("min_fit_clients", "min_evaluate_clients", "min_available_clients"):
            require(getattr(self, key) >= 1, key.replace("_", "-"), getattr(self, key), "must be >= 1")
        require(self.proximal_mu >= 0, "proximal-mu", self.proximal_mu, "must be >= 0 (0 = FedAvg)")
        require(self.server_optimizer in ("sgd", "momentum", "adam"), "server-optimizer", self.server_optimizer,
                "allowed: sgd, momentum, adam")
        require(0 <= self.server_momentum < 1, "server-momentum", self.server_momentum, "must be in [0, 1)")
        require(self.aggregation in AGGREGATIONS, "aggregation", self.aggregation, f"allowed: {', '.join(AGGREGATIONS)}")
        require(0 <= self.trim_fraction < 0.5, "trim-fraction", self.trim_fraction, "must be in [0, 0.5)")
        require(not (self.secagg.enabled and self.aggregation in ROBUST_AGGREGATIONS), "aggregation", self.aggregation,
                "needs each client's update, which SecAgg+ hides: with secagg.enabled=true use mean or fednova")
        largest = MAX_SERVER_LEARNING_RATES[self.server_optimizer]
        require(self.server_learning_rate == 0 or 0 < self.server_learning_rate <= largest, "server-learning-rate",
                self.server_learning_rate,
                f"with server-optimizer={self.server_optimizer!r} must be in (0, {largest:g}], or 0 for its default")
        require(self.evaluate_every >= 0, "evaluate-every", self.evaluate_every, "must be >= 0 (0 = never)")
        require(self.save_every >= 1, "save-every", self.save_every, "must be >= 1")
        for key in ("connect_timeout", "fit_timeout", "evaluate_timeout"):
            require(getattr(self, key) > 0, key.replace("_", "-"), getattr(self, key), "must be > 0 seconds")
        if self.secagg.enabled:
            require(self.secagg.num_shares <= self.min_fit_clients, "secagg.num-shares", self.secagg.num_shares,
                    f"must be <= min-fit-clients={self.min_fit_clients} (shares go to other sampled clients)")


@dataclass
class RunConfig:
    """The whole app's configuration: one engine config per client, one federation config."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)

    def __post_init__(self) -> None:
        client_level, secagg = self.engine.privacy.client_level, self.federation.secagg
        if not client_level.enabled:
            return
        require(self.federation.compression.density == 1, "compression.density", self.federation.compression.density,
                "must be 1 with privacy.client_level.enabled=true (its rotated, noised integers are not sparsified)")
        require(secagg.enabled, "privacy.client_level.enabled", True,
                "needs secagg.enabled=true (without SecAgg+ the server would see each client's lightly noised update)")
