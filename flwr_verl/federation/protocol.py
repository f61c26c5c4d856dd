"""The messages between the server and a client, typed, defined once.

Flower carries a fit's instructions as a flat config dict and a client's report as a flat
metrics dict of scalars. These dataclasses are the only code that reads or writes those
dicts: ``FitConfig`` (server -> client, in ``FitIns.config``), ``FitReport`` (client -> server,
in ``FitRes.metrics``) and ``EvaluateReport`` (in ``EvaluateRes.metrics``). Each ``from_*``
rejects a missing or mistyped entry with a ``ProtocolError`` that names it.

What travels in the clear beside the (securely aggregated) update: everything in ``FitReport``
(its ``training`` summary only under ``privacy.metrics=clear``), and the weight ``num_examples``
(``privacy.num_examples``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, get_type_hints

from flwr_verl.config import FlwrVerlError
from flwr_verl.engine.evaluation import Evaluation

STATUS_OK = "ok"
STATUS_BUDGET = "privacy_budget_exhausted"  # the client refused the round: it would pass its epsilon budget
STATUSES = (STATUS_OK, STATUS_BUDGET)


class ProtocolError(FlwrVerlError, ValueError):
    """A message between server and client lacks an entry or has one of the wrong type."""


def _read(values: dict[str, Any], key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    if key not in values:
        if default is dataclasses.MISSING:
            raise ProtocolError(f"message entry {key!r} is missing")
        return default
    value = values[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
        isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ProtocolError(f"message entry {key!r}={value!r} must be of type {kind.__name__}")
    return float(value) if kind is float else value


@dataclass(frozen=True)
class SecAggBounds:
    """What a client must check before SecAgg+ quantizes its update (see ``secagg.py``)."""

    clipping_range: float
    max_weight: float


@dataclass(frozen=True)
class ClientLevelRound:
    """What a client needs, beyond its own ``privacy.client_level`` config, to encode its update for
    client-level DP (``distributed_dp.plan_round``): the round's number of sampled clients and the
    fewest of them whose noise an unmasked aggregate holds (``secagg.fewest_survivors``, from
    SecAgg+'s shares and reconstruction threshold). The rotation's seed is the round number."""

    num_clients: int
    min_survivors: int


@dataclass(frozen=True)
class SparseRound:
    """This round's sparse upload (``compression.density < 1``, ``compression.py``): send only the
    coordinates ``coordinate_mask(seed, D, density)`` of the update, the same for every client."""

    density: float
    seed: int  # compression.round_seed(trainer.seed, server_round): data-independent


@dataclass(frozen=True)
class FitConfig:
    """The server's instructions for one client's fit."""

    server_round: int  # counted across resumes
    local_iterations: int
    planned_iterations: int  # over the whole run: what privacy.target_epsilon is spread over
    proximal_mu: float
    secagg: SecAggBounds | None = None  # None: the update travels in the clear
    fail_partition: int = -1  # fault injection for tests: this partition's fit raises
    client_level: ClientLevelRound | None = None  # None: no client-level DP
    # FedNova (``aggregation = "fednova"``): send the update divided by the iterations run. On the
    # client, because under SecAgg+ the server sees only the sum.
    normalize_update: bool = False
    sparse: SparseRound | None = None  # None: the whole update travels

    def to_config(self) -> dict[str, bool | int | float | str]:
        config: dict[str, bool | int | float | str] = {
            "server_round": self.server_round, "local_iterations": self.local_iterations,
            "planned_iterations": self.planned_iterations, "proximal_mu": self.proximal_mu,
            "fail_partition": self.fail_partition, "secure": self.secagg is not None,
            "normalize_update": self.normalize_update,
        }
        if self.secagg is not None:
            config.update(secagg_clipping_range=self.secagg.clipping_range, secagg_max_weight=self.secagg.max_weight)
        if self.client_level is not None:
            config.update(client_level_num_clients=self.client_level.num_clients,
                          client_level_min_survivors=self.client_level.min_survivors)
        if self.sparse is not None:
            config.update(sparse_density=self.sparse.density, sparse_seed=self.sparse.seed)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FitConfig:
        secagg = SecAggBounds(_read(config, "secagg_clipping_range", float), _read(config, "secagg_max_weight", float)) \
            if _read(config, "secure", bool) else None
        return cls(
            server_round=_read(config, "server_round", int), local_iterations=_read(config, "local_iterations", int),
            planned_iterations=_read(config, "planned_iterations", int),
            proximal_mu=_read(config, "proximal_mu", float),
            secagg=secagg, fail_partition=_read(config, "fail_partition", int),
            client_level=ClientLevelRound(_read(config, "client_level_num_clients", int),
                                          _read(config, "client_level_min_survivors", int))
            if "client_level_num_clients" in config else None,
            normalize_update=_read(config, "normalize_update", bool, False),
            sparse=SparseRound(_read(config, "sparse_density", float), _read(config, "sparse_seed", int))
            if "sparse_density" in config else None,
        )


@dataclass(frozen=True)
class PreflightConfig:
    """Sent to every client before the first round: check everything that can be checked
    against your own data (model, data, reward function, batch sizes, SecAgg+ bounds) now."""

    secagg: SecAggBounds | None = None
    # The server's ``AdapterSet.frozen_fingerprint``: the base model and any frozen LoRA A factors
    # never travel, so a client must hold the same ones. "" when the server sends none to compare.
    frozen_weights: str = ""

    def to_config(self) -> dict[str, bool | int | float | str]:
        frozen = {"frozen_weights": self.frozen_weights} if self.frozen_weights else {}
        if self.secagg is None:
            return {"secure": False, **frozen}
        return {"secure": True, "secagg_clipping_range": self.secagg.clipping_range,
                "secagg_max_weight": self.secagg.max_weight, **frozen}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PreflightConfig:
        frozen = _read(config, "frozen_weights", str, "")
        if not _read(config, "secure", bool):
            return cls(frozen_weights=frozen)
        return cls(SecAggBounds(_read(config, "secagg_clipping_range", float), _read(config, "secagg_max_weight", float)),
                   frozen_weights=frozen)


@dataclass(frozen=True)
class PreflightReport:
    """A client's answer to the preflight: the name it gives itself (node config ``client-id``).
    The name only labels the node in logs and errors; Flower's node id, which SuperNode
    authentication binds to the node's key, identifies it. The server refuses a run in which two
    nodes claim one name, before round 1 (``FedProxAdapters.check_preflight``)."""

    client_id: str

    def to_metrics(self) -> dict[str, str]:
        return {"preflight.client_id": self.client_id}

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> PreflightReport:
        return cls(_read(metrics, "preflight.client_id", str))


@dataclass(frozen=True)
class EvaluateConfig:
    """Evaluate the global adapter on your held-out prompts. With ``preflight``, first run the
    preflight's checks: the first evaluation of a fresh run that reaches every connected client
    carries them, which saves each node one ClientApp process (in a deployment every message
    starts one, and each pays the engine's imports)."""

    server_round: int
    preflight: PreflightConfig | None = None

    def to_config(self) -> dict[str, bool | int | float | str]:
        if self.preflight is None:
            return {"server_round": self.server_round}
        return {"server_round": self.server_round, "preflight": True, **self.preflight.to_config()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EvaluateConfig:
        preflight = PreflightConfig.from_config(config) if _read(config, "preflight", bool, False) else None
        return cls(_read(config, "server_round", int), preflight)


@dataclass(frozen=True)
class TrainingSummary:
    """One fit's training metrics, on the client's private training prompts."""

    reward_before: float  # mean sampled reward in the first iteration with prompts
    reward_after: float  # ... and in the last
    reward_mean: float
    kl: float  # to the reference policy (adapter disabled); NaN when no KL term runs the reference pass
    response_length: float
    pg_loss: float
    time_fit: float
    time_rollout: float
    time_reward: float
    time_log_prob: float
    time_advantage: float
    time_update: float

    @classmethod
    def of_fit(cls, iterations: list[dict[str, float]], seconds: float) -> TrainingSummary:
        """One fit's iteration metrics summarised (iterations without prompts, empty Poisson
        draws, carry no training metrics)."""
        trained = [m for m in iterations if m.get("prompts", 0) > 0] or [{}]

        def mean(key: str) -> float:
            return statistics.fmean([m.get(key, math.nan) for m in trained])

        return cls(
            reward_before=trained[0].get("reward_mean", math.nan), reward_after=trained[-1].get("reward_mean", math.nan),
            reward_mean=mean("reward_mean"), kl=mean("kl"), response_length=mean("response_length"),
            pg_loss=mean("pg_loss"), time_fit=seconds,
            **{f"time_{phase}": float(sum(m.get(f"time_{phase}", 0.0) for m in iterations))
               for phase in ("rollout", "reward", "log_prob", "advantage", "update")},
        )


@dataclass(frozen=True)
class NoisedTrainingMetrics:
    """``privacy.metrics = "dp"``: one fit's training metrics on the private prompts, each a
    per-prompt mean clipped to a stated range, with Gaussian noise of the stated std, accounted in
    the client's privacy ledger with its update (``privacy.release_metrics``)."""

    reward_mean: float  # mean sampled reward per prompt, clipped to [-custom_reward_function.clip, clip]
    response_length: float  # mean response length per prompt, in [0, rollout.response_length]
    reward_mean_noise_std: float
    response_length_noise_std: float


@dataclass(frozen=True)
class PrivacyReport:
    """All that a client tells the server of its privacy state after a fit.

    The server needs one answer: can this node train one more round like this one within its
    epsilon budget. The budget, the ledger's history (whose sample rates give the data size, and
    whose step counts cover the node's other runs) and the total over every run stay on the node.
    ``epsilon_run`` (this run's spends on this data set at ``privacy.delta``) is sent only when
    the node's weight is its exact prompt count (``privacy.num_examples = "exact"``): then the
    server can compute it from what it already holds (N, the run config, the iterations run), so
    it reveals nothing new; otherwise it is None.
    """

    fits_next_round: bool
    epsilon_run: float | None = None

    def to_json_dict(self) -> dict[str, bool | float]:
        """Scalars only: what Flower's metrics and JSON can hold."""
        return {"fits_next_round": self.fits_next_round,
                **({} if self.epsilon_run is None else {"epsilon_run": self.epsilon_run})}

    @classmethod
    def from_json_dict(cls, values: dict[str, Any]) -> PrivacyReport:
        epsilon = _read(values, "epsilon_run", float, None)
        if epsilon is not None and not epsilon >= 0:
            raise ProtocolError(f"message entry 'epsilon_run'={epsilon!r} must be a number >= 0")
        return cls(_read(values, "fits_next_round", bool), epsilon)


@dataclass(frozen=True)
class FitReport:
    """A client's report beside its update: who it is, whether it trained, what it spent."""

    status: str
    partition_id: int
    client_id: str
    bytes_received: int
    bytes_sent: int
    # Local iterations actually run (fewer than asked under a node's budget; 0 when refused). Sent
    # whatever ``privacy.metrics`` says: FedNova's rescaling and the round log need it.
    iterations: int = 0
    privacy: PrivacyReport | None = None  # None without DP
    training: TrainingSummary | None = None  # None when the client refused the round
    training_dp: NoisedTrainingMetrics | None = None  # only under privacy.metrics = "dp" (then training is None)

    def to_metrics(self) -> dict[str, bool | int | float | str]:
        metrics: dict[str, bool | int | float | str] = {
            "status": self.status, "partition_id": self.partition_id, "client_id": self.client_id,
            "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent, "iterations": self.iterations,
        }
        if self.privacy is not None:
            metrics.update({f"privacy.{k}": v for k, v in self.privacy.to_json_dict().items()})
        if self.training is not None:
            metrics.update({f"training.{k}": v for k, v in dataclasses.asdict(self.training).items()})
        if self.training_dp is not None:
            metrics.update({f"training_dp.{k}": v for k, v in dataclasses.asdict(self.training_dp).items()})
        return metrics

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> FitReport:
        status = _read(metrics, "status", str)
        if status not in STATUSES:
            raise ProtocolError(f"message entry 'status'={status!r} must be one of {', '.join(STATUSES)}")
        privacy = training = None
        if "privacy.fits_next_round" in metrics:
            privacy = PrivacyReport.from_json_dict(
                {k.removeprefix("privacy."): v for k, v in metrics.items() if k.startswith("privacy.")})
        if "training.reward_mean" in metrics:
            training = TrainingSummary(**_read_fields(TrainingSummary, metrics, "training."))
        training_dp = (NoisedTrainingMetrics(**_read_fields(NoisedTrainingMetrics, metrics, "training_dp."))
                       if "training_dp.reward_mean" in metrics else None)
        return cls(status=status, partition_id=_read(metrics, "partition_id", int),
                   client_id=_read(metrics, "client_id", str), bytes_received=_read(metrics, "bytes_received", int),
                   bytes_sent=_read(metrics, "bytes_sent", int), iterations=_read(metrics, "iterations", int),
                   privacy=privacy, training=training, training_dp=training_dp)


@dataclass(frozen=True)
class EvaluateReport(Evaluation):
    """A client's ``engine.trainer.Evaluation`` as evaluation metrics on the wire."""

    @classmethod
    def of(cls, evaluation: Evaluation) -> EvaluateReport:
        return cls(**dataclasses.asdict(evaluation))

    def to_metrics(self) -> dict[str, float]:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> EvaluateReport:
        return cls(**_read_fields(cls, metrics, "", skip={"response_loss"}),
                   response_loss=_read(metrics, "response_loss", float, None))


def _read_fields(cls, values: dict[str, Any], prefix: str, skip: frozenset | set = frozenset()) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: _read(values, prefix + f.name, hints[f.name])
            for f in dataclasses.fields(cls) if f.name not in skip}

