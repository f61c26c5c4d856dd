"""SecAgg+ settings, derived so that the secure aggregate matches exact FedAvg to 1e-7.

Flower's SecAgg+ (``secaggplus_mod`` on clients, ``SecAggPlusWorkflow`` on the server) weights
each update on the client by ``round(n / max_weight * Q) / Q``, clips it to
``[-clipping_range, clipping_range]``, and stochastically rounds it to ``Q`` levels
(``quantization_range``). The server only ever sees the masked sum. Errors therefore come from

- rounding: at most one step, ``2 * clipping_range / Q``, per client, scaled by
  ``max_weight / sum(n)`` when the weighted mean is recovered;
- clipping: unbounded. So it must never happen: clients check their update against
  ``clipping_range`` and raise an error with the numbers instead of sending it.

We take ``Q = 2**30`` (Flower rounds through int32, so Q must stay below 2**31) and a modulus
of 2**40, while int64 masks cannot overflow. Each client's quantized entry lies in [0, Q], so
the sum of k clients lies in [0, k * Q] and unmasks without wrapping only while k * Q < 2**40:
at most ``MAX_CLIENTS`` = 1023 clients per round (1024 could wrap at the range's edge). With ``clipping_range = 1`` the rounding step is 1.9e-9.

That step holds only for float64 updates: ``secaggplus_mod`` weights, shifts and scales the
update in the dtype it receives, so a float32 update is first rounded to float32's resolution at
``clipping_range`` (2**-23 * clipping_range, 1.2e-7 at 1), and the aggregate then misses exact
FedAvg by about 1e-7 (measured 1.1e-7 through real SecAgg+, ``tests/test_secagg.py``). Send
``exact_update(new, old)``: float64, and exact for float32 weights. Under SecAgg+ this costs no
bandwidth: what travels is the masked int64 vector either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flwr_verl.config import ConfigError, DataConfig, FlwrVerlError, SecAggConfig

QUANTIZATION_RANGE = 2**30
MODULUS_RANGE = 2**40
MAX_CLIENTS = MODULUS_RANGE // QUANTIZATION_RANGE - 1  # the largest k with k * Q < MODULUS_RANGE
MIN_CLIENTS = 3  # Flower's SecAgg+ needs num_shares >= 3, so a round needs 3 clients


class UpdateOutOfRange(FlwrVerlError, ValueError):
    """A client update would be clipped by SecAgg+ (silent damage), so it is not sent."""


@dataclass(frozen=True)
class SecAggParameters:
    num_shares: int
    reconstruction_threshold: int
    clipping_range: float
    quantization_range: int
    modulus_range: int
    max_weight: float
    timeout: float

    def workflow_kwargs(self) -> dict:
        return {
            "num_shares": self.num_shares, "reconstruction_threshold": self.reconstruction_threshold,
            "clipping_range": self.clipping_range, "quantization_range": self.quantization_range,
            "modulus_range": self.modulus_range, "max_weight": self.max_weight, "timeout": self.timeout,
        }


def derive_parameters(config: SecAggConfig, data: DataConfig, num_clients: int) -> SecAggParameters:
    """SecAgg+ settings for ``num_clients`` sampled clients per round."""
    if num_clients > MAX_CLIENTS:
        raise ConfigError(f"min-fit-clients={num_clients} is invalid under SecAgg+: the modulus 2**40 holds the "
                          f"sum of at most {MAX_CLIENTS} clients' quantized updates without wrapping around")
    if config.num_shares > num_clients:
        raise ConfigError(f"secagg.num-shares={config.num_shares} is invalid: must be <= the {num_clients} "
                          "clients sampled per round")
    if config.max_weight:
        max_weight = float(config.max_weight)
    elif data.train_files:
        raise ConfigError("secagg.max-weight=0 (auto) is invalid with data.train_files: set it to an upper "
                          "bound of any client's number of training prompts")
    elif data.partition != "iid":
        # The pooled train_size * num-partitions prompts are split with label skew: one client can
        # get most of them (measured: 133 and 159 of 192 for 3 partitions of 64).
        raise ConfigError("secagg.max-weight=0 (auto) is invalid with data.partition="
                          f"{data.partition!r}: set it to an upper bound of any client's number of training "
                          "prompts (at most data.train_size * num-partitions)")
    else:
        # Under iid a task generator gives each client exactly data.train_size prompts.
        max_weight = float(2 * data.train_size)
    return SecAggParameters(
        num_shares=config.num_shares, reconstruction_threshold=config.reconstruction_threshold,
        clipping_range=config.clipping_range, quantization_range=QUANTIZATION_RANGE, modulus_range=MODULUS_RANGE,
        max_weight=max_weight, timeout=config.timeout,
    )


def exact_update(new: list[np.ndarray], old: list[np.ndarray]) -> list[np.ndarray]:
    """``new - old`` in float64, the update format SecAgg+ quantizes finely. For float32 weights
    the difference is exact unless their magnitudes differ by more than 2**29."""
    return [np.asarray(n, dtype=np.float64) - np.asarray(o, dtype=np.float64) for n, o in zip(new, old, strict=True)]


def check_update(update: list[np.ndarray], num_examples: int, clipping_range: float, max_weight: float) -> None:
    """Raise before sending an update that SecAgg+ would clip or overflow."""
    largest = max((float(np.max(np.abs(a))) for a in update if a.size), default=0.0)
    if largest > clipping_range:
        raise UpdateOutOfRange(
            f"update max |value| {largest:.4g} exceeds secagg.clipping-range={clipping_range}: SecAgg+ would clip it. "
            "Raise secagg.clipping-range (costs precision) or lower actor.lr / trainer.local_iterations"
        )
    if num_examples > max_weight:
        raise UpdateOutOfRange(
            f"num_examples={num_examples} exceeds secagg.max-weight={max_weight:g}: SecAgg+ would overflow the "
            "weighted update. Raise secagg.max-weight"
        )
