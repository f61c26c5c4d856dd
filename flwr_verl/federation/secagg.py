"""SecAgg+ settings, derived from a precision target: the smallest quantization range whose
secure aggregate stays within ``secagg.precision`` (default 1e-7) of exact FedAvg.

Flower's SecAgg+ (``secaggplus_mod`` on clients, ``SecAggPlusWorkflow`` on the server) weights
each update on the client by ``q_i / Q`` with ``q_i = round(n_i / max_weight * Q)``, clips it to
``[-c, c]`` (c = ``clipping_range``), and stochastically rounds ``(x + c) * Q / (2c)`` to an
integer in [0, Q] (Q = ``quantization_range``). The server unmasks the sums of both and returns
``sum(q_i u_i) / sum(q_i)`` up to rounding. The server only ever sees the masked sum.

**Error bound** (``error_bound``), for updates within ``[-c, c]`` (clients refuse to send any
other: ``check_update``; clipping would be unbounded damage):

- the weights: ``|q_i - Q n_i / W| <= 1/2`` moves the normalised weights by at most
  ``k / sum(q_i)`` in L1, so the mean by at most ``c k / sum(q_i)``;
- the rounding: each client's integers are off by less than 1, so the sum of k by less than k
  steps of ``2c / Q``, which the division by ``sum(q_i) / Q`` turns into ``2 c k / sum(q_i)``.

With every client's weight at least ``rho * W``, ``sum(q_i) >= k (Q rho - 1/2)``, so
``max |error| <= 3 c / (Q rho - 1/2)`` for any number k of survivors. ``derive_parameters``
takes the smallest Q meeting ``secagg.precision`` with rho the weight floor it can guarantee:
a client never trains on fewer prompts than ``data.train_batch_size`` (its preflight refuses,
``privacy.sample_rate``), so its ``num_examples`` is at least that (``exact`` or ``bucketed``
weights), or, under the automatic ``max_weight`` for iid task data, exactly
``data.train_size`` (rho = 1/2); ``fixed`` weights are all 1 (and the automatic ``max_weight``
is then 1, so rho = 1).
Q must stay below 2**31 (Flower rounds through int32): a target that needs more is refused,
naming ``secagg.precision`` and the best reachable value. A loose ``max_weight`` costs
precision: rho shrinks with it.

**Modulus.** Each client's integers lie in [0, Q], so the sum of k clients unmasks without
wrapping while ``k * Q`` is below the modulus: the smallest modulus for k clients is the power of
two above ``k * Q`` (``smallest_modulus``). The workflow nonetheless uses ``MODULUS_RANGE`` =
2**40 (int64 masks cannot overflow), which holds ``MAX_CLIENTS`` = 512 clients at any Q below
2**31 (the strategy refuses to sample more): a round samples ``max(fraction-fit * available,
min-fit-clients)`` clients, unknown when the workflow is built, and on Flower 1.42's wire a
narrower modulus saves nothing. ``secaggplus_mod`` draws its masks with
``randint(..., dtype=np.int64)``, the masked sums stay int64 (``parameters_mod``), and they travel
as ``ndarray_to_bytes`` of those int64 arrays: 8 bytes per parameter whatever the modulus
(``benchmarks/secagg_precision.py --bits`` measures it). ``smallest_modulus`` is what a transport
that packed k-bit integers would need.

The bound holds only for float64 updates: ``secaggplus_mod`` weights, shifts and scales the
update in the dtype it receives, so a float32 update is first rounded to float32's resolution at
``clipping_range`` (2**-23 * clipping_range, 1.2e-7 at 1), and the aggregate then misses exact
FedAvg by about 1e-7 (measured 1.1e-7 through real SecAgg+, ``tests/federation/test_secagg.py``). Send
``exact_update(new, old)``: float64, and exact for float32 weights. Under SecAgg+ this costs no
bandwidth: what travels is the masked int64 vector either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from flwr_verl.config import ConfigError, DataConfig, FlwrVerlError, SecAggConfig

MAX_QUANTIZATION_RANGE = 2**31 - 1  # Flower's stochastic rounding casts to int32
MODULUS_RANGE = 2**40
MAX_CLIENTS = (MODULUS_RANGE - 1) // MAX_QUANTIZATION_RANGE  # 512: the sum that 2**40 holds at any allowed Q
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

    def smallest_modulus(self, num_clients: int) -> int:
        """The smallest power of two that holds ``num_clients`` clients' quantized sum."""
        return 1 << (num_clients * self.quantization_range).bit_length()

    def workflow_kwargs(self) -> dict:
        return {
            "num_shares": self.num_shares, "reconstruction_threshold": self.reconstruction_threshold,
            "clipping_range": self.clipping_range, "quantization_range": self.quantization_range,
            "modulus_range": self.modulus_range, "max_weight": self.max_weight, "timeout": self.timeout,
        }


def error_bound(clipping_range: float, quantization_range: int, weight_floor: float) -> float:
    """Max abs error of SecAgg+'s weighted mean against exact FedAvg, for updates within
    ``[-clipping_range, clipping_range]`` and every weight at least ``weight_floor`` times
    ``max_weight`` (see the module docstring); infinite when the weights can round to 0."""
    usable = quantization_range * weight_floor - 0.5
    return 3 * clipping_range / usable if usable > 0 else math.inf


def quantization_range_for(precision: float, clipping_range: float, weight_floor: float) -> int:
    """The smallest Q with ``error_bound(clipping_range, Q, weight_floor) <= precision``."""
    needed = math.ceil((3 * clipping_range / precision + 0.5) / weight_floor)
    while error_bound(clipping_range, needed, weight_floor) > precision:  # float rounding of the line above
        needed += 1
    return needed


def derive_parameters(config: SecAggConfig, data: DataConfig, num_clients: int,
                      num_examples: str = "exact") -> SecAggParameters:
    """SecAgg+ settings for ``num_clients`` sampled clients per round, whose weights are
    ``privacy.num_examples`` = ``num_examples``: the smallest quantization range that meets
    ``config.precision`` (``quantization_range_for``)."""
    if num_clients > MAX_CLIENTS:
        raise ConfigError(f"min-fit-clients={num_clients} is invalid under SecAgg+: the modulus 2**40 holds the "
                          f"sum of at most {MAX_CLIENTS} clients' quantized updates without wrapping around")
    if config.num_shares > num_clients:
        raise ConfigError(f"secagg.num-shares={config.num_shares} is invalid: must be <= the {num_clients} "
                          "clients sampled per round")
    # A client trains on at least one batch of prompts (its preflight refuses fewer), so it
    # weighs at least that much; fixed weights are all 1.
    smallest_weight = 1 if num_examples == "fixed" else data.train_batch_size
    if config.max_weight:
        max_weight = float(config.max_weight)
    elif num_examples == "fixed":
        max_weight = 1.0  # every client sends weight 1
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
        # Under iid a task generator gives each client exactly data.train_size prompts: its weight
        # is that count (exact) or the power of two above it (bucketed), within [train_size, 2 * train_size].
        max_weight = float(2 * data.train_size)
        smallest_weight = data.train_size
    weight_floor = min(smallest_weight / max_weight, 1.0)
    quantization_range = quantization_range_for(config.precision, config.clipping_range, weight_floor)
    if quantization_range > MAX_QUANTIZATION_RANGE:
        best = error_bound(config.clipping_range, MAX_QUANTIZATION_RANGE, weight_floor)
        raise ConfigError(
            f"secagg.precision={config.precision:g} is unreachable: with secagg.clipping-range="
            f"{config.clipping_range:g} and weights as small as {smallest_weight} of secagg.max-weight="
            f"{max_weight:g} it needs a quantization range of {quantization_range}, above Flower's int32 limit "
            f"{MAX_QUANTIZATION_RANGE}. The best reachable is {best:.3g}: raise secagg.precision, or lower "
            "secagg.max-weight or secagg.clipping-range")
    params = SecAggParameters(
        num_shares=config.num_shares, reconstruction_threshold=config.reconstruction_threshold,
        clipping_range=config.clipping_range, quantization_range=quantization_range, modulus_range=MODULUS_RANGE,
        max_weight=max_weight, timeout=config.timeout,
    )
    return params


def fewest_survivors(num_clients: int, num_shares: int, threshold: int) -> int:
    """The fewest of ``num_clients`` sampled clients whose masked vectors an aggregate that
    Flower 1.42's SecAgg+ unmasks can hold.

    ``SecAggPlusWorkflow`` places the sampled clients on a ring (its setup stage) and gives each
    the window of ``num_shares`` clients centred on itself (itself included; an even count grows
    by one unless it is every client), and unmasks only if every window still holds at least
    ``threshold`` of the clients that sent a masked vector. Each client lies in as many windows
    as a window has clients (w), so the survivors number at least ``ceil(num_clients * threshold
    / w)``, which evenly spaced survivors reach. Client-level DP splits its noise over this many
    clients (``distributed_dp``): at 300 clients, 3 shares and threshold 2, 200 rather than 2."""
    window = min(2 * (num_shares // 2) + 1, num_clients)
    return -(-num_clients * threshold // window)


def exact_update(new: list[np.ndarray], old: list[np.ndarray]) -> list[np.ndarray]:
    """``new - old`` in float64, the update format SecAgg+ quantizes finely. For float32 weights
    the difference is exact unless their magnitudes differ by more than 2**29."""
    return [np.asarray(n, dtype=np.float64) - np.asarray(o, dtype=np.float64) for n, o in zip(new, old, strict=True)]


def infeasible_coordinates(mean: list[np.ndarray], bound: float) -> tuple[int, int, float]:
    """The server's check of an unmasked weighted mean: how many coordinates are outside
    [-bound, bound], how many of those are not finite, and the largest finite |value|. Honest
    clients send updates within [-clipping_range, clipping_range] (``check_update``), and a
    weighted mean of those stays in that range up to SecAgg+'s rounding, so ``bound`` is the
    clipping range plus ``secagg.precision``."""
    outside = nonfinite = 0
    largest = 0.0
    for a in mean:
        magnitude = np.abs(np.asarray(a, dtype=np.float64))
        finite = np.isfinite(magnitude)
        outside += int(np.count_nonzero(~(magnitude <= bound)))  # NaN compares false: counted
        nonfinite += int(np.count_nonzero(~finite))
        largest = max(largest, float(magnitude[finite].max(initial=0.0)))
    return outside, nonfinite, largest


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


def integer_secagg_parameters(params: SecAggParameters, bits: int) -> SecAggParameters:
    """``params`` changed so that Flower's SecAgg+ sums a client's integers in
    [-2**(bits-1), 2**(bits-1)) unchanged: weight 1 (``max_weight`` = every client's
    ``num_examples`` = 1), clipping range 2**(bits-1), quantization range 2**bits (scale 1)."""
    return replace(params, clipping_range=float(2 ** (bits - 1)), quantization_range=2**bits, max_weight=1.0)
