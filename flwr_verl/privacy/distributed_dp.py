"""Client-level DP with distributed noise under SecAgg+: the distributed Skellam mechanism.

The pipeline of DDGauss (Kairouz, Liu & Steinke, ICML 2021) with Skellam noise (Agarwal, Kairouz
& Liu, "The Skellam Mechanism for Differentially Private Federated Learning", NeurIPS 2021). The
privacy unit is one *client*: everything it contributes in a round, whatever its number of prompts.
Skellam noise is integer and closed under summation: clients that add Sk(v_1), ..., Sk(v_k) give
exactly Sk(v_1 + ... + v_k), so the securely summed noise is one Skellam mechanism, no
approximation. Flower's own DP strategies add the noise on the server, after unmasking; here no
one ever holds a noise-free sum.

What a client does to its round update (``encode_update``), in order:

1. flatten every adapter array into one vector and clip it to L2 norm C (``clip_l2``);
2. optionally rotate it (``rotate``): a randomized Hadamard transform whose signs come from the
   round number, public to everyone. It spreads the update evenly over coordinates so that the
   modular range can be narrow; privacy never depends on it (it preserves the L2 norm);
3. scale by ``plan.scale`` and round stochastically to integers, conditionally: redraw until the
   integer vector's L2 norm is at most ``plan.l2_sensitivity`` (``conditional_round``), which
   makes the sensitivity a fixed bound instead of a high-probability one;
4. add its share of the noise, Skellam of variance ``plan.client_variance`` (``skellam_noise``);
5. reduce modulo 2**bits and hand the result to Flower's ``secaggplus_mod`` in the form that it
   sums without changing a single integer (``to_secagg_input``).

What the server does (``decode_aggregate``): recover the integer sum modulo 2**bits from what
``SecAggPlusWorkflow`` returns (``secure_integer_sum``, exact), centre it, divide by the scale,
rotate back, divide by the number of survivors. It has no other input: there is no code path that
forms a sum without the clients' noise.

**Exactness through Flower 1.42's SecAgg+.** ``secaggplus_mod`` weights an update by
``round(n / max_weight * Q) / Q``, clips it to ``[-c, c]`` and stochastically rounds
``(x + c) * Q / (2c)``. With ``n = max_weight = 1`` the weight is 1.0, with ``c = Q/2`` the scale is
1.0, and an integer-valued float64 in ``[-Q/2, Q/2)`` passes as the integer ``x + Q/2``, which
stochastic rounding leaves as it is (``federation.secagg.integer_secagg_parameters``). The workflow returns
``sum(x_i) / k`` for k survivors; multiplied by k and rounded it is ``sum(x_i)`` exactly while
``|sum| < 2**52 / k`` (here at most 2**40). So the secure sum is the sum of the clients' noisy
integers, bit for bit (``tests/privacy/test_distributed_dp.py`` checks it through real SecAgg+).

**Modular range.** ``bits`` sets the modulus 2**bits of DDGauss's modular arithmetic, and of
Flower's quantization range (at most 2**30: Flower rounds through int32; and k * 2**bits must stay
below its modulus 2**40, so at most 2**(40 - bits) - 1 clients a round). The scale is chosen so
that ``K_STDDEVS`` standard deviations of every coordinate of the noisy sum of ``num_clients``
clients fit in the range (Kairouz et al. 2021, Section 4's heuristic); a coordinate beyond it
wraps around, which costs accuracy, never privacy. Rounding grows the sensitivity (the ``d / 4``
term of ``l2_sensitivity``); a bit width for which it would grow by more than
``MAX_SENSITIVITY_INFLATION`` is refused before any training (``plan_round``).

**Dropouts.** Each client adds the noise share of the fewest clients whose masked vectors an
unmasked aggregate can hold, m (``min_survivors``): variance ``(z * scale * C)**2 / m``. Flower's
SecAgg+ unmasks only when every sampled client has at least t = ``secagg.reconstruction-threshold``
surviving neighbours among its s = ``secagg.num-shares``, so an aggregate of n sampled clients
holds at least ``m = ceil(n * t / s)`` of them (``federation.secagg.fewest_survivors``; t when
n <= s), and the summed noise is then at least ``(z * scale * C)**2``: the accounted noise. More
survivors add more noise than accounted (utility cost up to ``num_clients / m``, about s / t),
never less. (Taking m = t, the fewest survivors of one client's neighbourhood, would cost up to
n / t: a noise std 12x the accounted one at 300 clients a round.)

**Accounting** (``ClientLevelAccount``). Per round, the Skellam mechanism's RDP at integer orders
(Agarwal et al. 2021, Theorem 3.5; ``skellam_rdp``), amplified by client sampling at rate
q = sampled / eligible clients with Zhu & Wang (2019)'s bound for Poisson subsampling of any RDP
mechanism (``poisson_subsampled_rdp``; q = 1 when fraction-fit is 1). Flower samples a fixed number
of clients without replacement, not Poisson: accounting it as Poisson at q is the approximation
DP-FedAvg makes (McMahan et al., ICLR 2018), stated here, not hidden. Rounds compose by adding
RDP; Opacus's ``get_privacy_spent`` turns it into epsilon at ``privacy.client_level.delta``.

**Randomness** (``noise_generator``). The stochastic rounding and the Skellam noise are drawn by
numpy's samplers from ChaCha20 (``randomgen.ChaCha``, 20 rounds), a cryptographically secure
generator, keyed with 256 bits from the OS's CSPRNG (``secrets``) for every round's update: its
output does not reveal its key, so the noise cannot be predicted from other draws. numpy's default
PCG64 and torch's Mersenne Twister are not secure: their state can be recovered from outputs.
``privacy.deterministic`` derives the key from (trainer.seed, round, partition) instead, for tests
and benchmarks only: whoever knows the seed can subtract the noise. The rotation's signs are
public by design (seeded by the round) and need no secrecy.

**The node's own account.** Each client also records every round it takes part in, in its node's
privacy ledger (``ledger.py``), against its data set with privacy unit ``PRIVACY_UNIT`` ("client"),
at sampling rate 1: a node cannot check the server's client sampling, and the rounds it is not
sampled in do not depend on its data, so composing only its own rounds, unamplified, bounds its
epsilon without trusting the server. The server's ``ClientLevelAccount`` with amplification by
sampling is the federation's (smaller) figure; the node's is the one its
``client-epsilon-budget`` is enforced against (``client.py``).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field

import numpy as np
from scipy.special import gammaln, logsumexp

from flwr_verl.config import ClientLevelConfig, ConfigError, FlwrVerlError

K_STDDEVS = 6.0  # headroom of the modular range, in standard deviations of one coordinate of the sum
MAX_BITS = 30  # Flower's stochastic rounding casts to int32: the quantization range must stay below 2**31
SECAGG_MODULUS_BITS = 40  # flwr_verl.federation.secagg.MODULUS_RANGE = 2**40: k clients need k * 2**bits below it
MAX_SENSITIVITY_INFLATION = 1.1  # rounding may grow the L2 sensitivity by at most 10% over scale * C
BETA = math.exp(-0.5)  # conditional rounding: the bound that one draw fails with probability <= BETA
ROUNDING_ATTEMPTS = 200  # all fail with probability <= BETA**200 < 1e-43
ORDERS = tuple(range(2, 257))  # integer RDP orders: both Skellam's bound and Zhu & Wang's need them
ROTATION_SALT = 0x5EC_A66  # the rotation's signs: np.random.default_rng([ROTATION_SALT, round])
PRIVACY_UNIT = "client"  # one client's whole round update: the unit the node's ledger keys these spends by


class RoundingFailed(FlwrVerlError, RuntimeError):
    """Conditional rounding found no integer vector within the sensitivity bound (never expected)."""


# ----------------------------------------------------------------------------- the round's parameters
@dataclass(frozen=True)
class SkellamPlan:
    """The public parameters of one round, the same on every client and on the server.

    ``scale`` maps the clipped float update (L2 norm <= ``clip_norm``) onto the integer grid;
    sensitivities and variances are in grid units.
    """

    clip_norm: float
    noise_multiplier: float  # summed noise std / clip_norm, before rounding's growth of the sensitivity
    bits: int
    rotation: bool
    dim: int  # parameters in one update (every adapter array)
    num_clients: int  # sampled this round: the scale leaves room for all of them
    min_survivors: int  # the fewest clients whose noise an unmasked aggregate holds (see Dropouts)
    scale: float

    @property
    def padded_dim(self) -> int:
        """The Hadamard transform needs a power of two; without rotation, the update's own size."""
        return 1 << (self.dim - 1).bit_length() if self.rotation else self.dim

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def l2_sensitivity(self) -> float:
        """Bound on the L2 norm of one client's rounded integer vector (Kairouz et al. 2021, Thm 2's
        conditional rounding bound, at ``BETA``; never more than ``scale * C + sqrt(d)``)."""
        return rounded_l2_bound(self.scale * self.clip_norm, self.padded_dim)

    @property
    def l1_sensitivity(self) -> float:
        """For an integer vector, ||z||_1 <= ||z||_2**2 and <= sqrt(d) * ||z||_2."""
        bound = self.l2_sensitivity
        return bound * min(bound, math.sqrt(self.padded_dim))

    @property
    def central_variance(self) -> float:
        """Per-coordinate variance of the summed noise with ``min_survivors`` survivors: what is accounted."""
        return (self.noise_multiplier * self.scale * self.clip_norm) ** 2

    @property
    def client_variance(self) -> float:
        """Each client's share: ``min_survivors`` clients together add ``central_variance``."""
        return self.central_variance / self.min_survivors


def rounded_l2_bound(norm: float, dim: int) -> float:
    """L2 norm bound of a vector of norm ``norm`` in ``dim`` coordinates after stochastic rounding
    that is redrawn until it holds (holds for one draw with probability >= 1 - ``BETA``)."""
    squared = norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / BETA)) * (norm + math.sqrt(dim) / 2)
    return min(math.sqrt(squared), norm + math.sqrt(dim))


def plan_round(config: ClientLevelConfig, dim: int, num_clients: int, min_survivors: int) -> SkellamPlan:
    """The scale for ``config.bits`` and the round's clients; a ``ConfigError`` naming the key when
    the bit width is too small (or too large) for them. ``min_survivors``: the fewest of the
    ``num_clients`` whose noise an aggregate holds (``federation.secagg.fewest_survivors``)."""
    if not 1 <= min_survivors <= num_clients:
        raise ValueError(f"min_survivors={min_survivors} must be in [1, num_clients={num_clients}]")
    problem = _bits_problem(config, config.bits, dim, num_clients, min_survivors)
    if problem:
        usable = [bits for bits in range(1, MAX_BITS + 1)
                  if not _bits_problem(config, bits, dim, num_clients, min_survivors)]
        hint = (f"use privacy.client_level.bits={usable[0]} or more" if usable else
                "no bit width works: sample fewer clients per round or lower privacy.client_level.noise_multiplier")
        raise ConfigError(f"privacy.client_level.bits={config.bits} is invalid for {num_clients} clients per round "
                          f"and an update of {dim} parameters: {problem}; {hint}")
    return _plan(config, config.bits, dim, num_clients, min_survivors)


def _plan(config: ClientLevelConfig, bits: int, dim: int, num_clients: int, min_survivors: int) -> SkellamPlan:
    # K_STDDEVS of the sum's per-coordinate std must fit in half the range: the signal of num_clients
    # clipped updates (spread over the coordinates by the rotation, else all in one), their
    # noise and their rounding (variance <= 1/4 each).
    padded = 1 << (dim - 1).bit_length() if config.rotation else dim
    spread = padded if config.rotation else 1
    headroom = (2 ** (bits - 1) / K_STDDEVS) ** 2 - num_clients / 4
    per_scale = config.clip_norm**2 * (num_clients**2 / spread
                                       + config.noise_multiplier**2 * num_clients / min_survivors)
    scale = math.sqrt(headroom / per_scale) if headroom > 0 else 0.0
    return SkellamPlan(config.clip_norm, config.noise_multiplier, bits, config.rotation, dim, num_clients,
                       min_survivors, scale)


def _bits_problem(config: ClientLevelConfig, bits: int, dim: int, num_clients: int, min_survivors: int) -> str:
    if bits > MAX_BITS:
        return f"Flower's SecAgg+ quantizes through int32, so at most {MAX_BITS} bits"
    if num_clients >= 2 ** (SECAGG_MODULUS_BITS - bits):
        return (f"the SecAgg+ modulus 2**{SECAGG_MODULUS_BITS} holds the sum of at most "
                f"{2 ** (SECAGG_MODULUS_BITS - bits) - 1} clients at this width")
    plan = _plan(config, bits, dim, num_clients, min_survivors)
    if plan.scale <= 0:
        return "the range cannot even hold the clients' rounding error"
    growth = plan.l2_sensitivity / (plan.scale * plan.clip_norm)
    if growth > MAX_SENSITIVITY_INFLATION:
        return (f"rounding to a grid this coarse would grow the sensitivity by {100 * (growth - 1):.0f}% "
                f"(at most {100 * (MAX_SENSITIVITY_INFLATION - 1):.0f}% allowed)")
    return ""


# ----------------------------------------------------------------------------- the client's steps
def noise_generator(seed: tuple[int, ...] | None = None) -> np.random.Generator:
    """numpy's samplers over ChaCha20, keyed with 256 bits from ``secrets`` (the OS's CSPRNG), or
    from ``seed`` (``privacy.deterministic``: tests and benchmarks only; see the module docstring)."""
    from randomgen import ChaCha

    key = (secrets.randbits(256) if seed is None
           else int.from_bytes(np.random.SeedSequence(list(seed)).generate_state(8, np.uint32).tobytes(), "little"))
    return np.random.Generator(ChaCha(key=key, rounds=20))


def clip_l2(vector: np.ndarray, norm: float) -> np.ndarray:
    """``vector`` scaled down to L2 norm ``norm`` if longer. Shape (d,) -> (d,)."""
    length = float(np.linalg.norm(vector))
    return vector * (norm / length) if length > norm else vector


def _hadamard(vector: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform (its own inverse). Shape (2**m,) -> (2**m,)."""
    out = np.array(vector, dtype=np.float64)
    size, half = out.size, 1
    while half < size:
        pairs = out.reshape(-1, 2, half)
        out = np.stack([pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]], axis=1).reshape(size)
        half *= 2
    return out / math.sqrt(size)


def rotation_signs(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng([ROTATION_SALT, seed]).choice([-1.0, 1.0], size=size)


def rotate(vector: np.ndarray, seed: int) -> np.ndarray:
    """Randomized Hadamard transform H D x (D: random signs from ``seed``). Shape (2**m,)."""
    return _hadamard(rotation_signs(seed, vector.size) * vector)


def unrotate(vector: np.ndarray, seed: int) -> np.ndarray:
    """The inverse of ``rotate``: D H y."""
    return rotation_signs(seed, vector.size) * _hadamard(vector)


def conditional_round(vector: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Unbiased stochastic rounding to integers, redrawn until the L2 norm is <= ``bound``. (d,) -> (d,) int64."""
    floor = np.floor(vector)
    for _ in range(ROUNDING_ATTEMPTS):
        rounded = (floor + (rng.random(vector.shape) < vector - floor)).astype(np.int64)
        if np.linalg.norm(rounded) <= bound:
            return rounded
    raise RoundingFailed(f"no stochastic rounding within L2 norm {bound:.6g} in {ROUNDING_ATTEMPTS} draws")


def skellam_noise(variance: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam noise, Poisson(v/2) - Poisson(v/2): mean 0, variance ``variance``. (size,) int64."""
    return rng.poisson(variance / 2, size) - rng.poisson(variance / 2, size)


def to_secagg_input(integers: np.ndarray, modulus: int) -> np.ndarray:
    """Integers modulo ``modulus`` as the float64 values in [-modulus/2, modulus/2) that SecAgg+
    (set up by ``federation.secagg.integer_secagg_parameters``) quantizes to ``integers mod modulus`` exactly."""
    return (np.mod(integers, modulus) - modulus // 2).astype(np.float64)


def encode_update(update: list[np.ndarray], plan: SkellamPlan, server_round: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """A client's update as what it hands to ``secaggplus_mod``: clipped, rotated, rounded, noised,
    reduced. Arrays of any shapes (``plan.dim`` values in all) -> one array of shape (padded_dim,)."""
    vector = clip_l2(np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in update]), plan.clip_norm)
    if plan.rotation:
        vector = rotate(np.pad(vector, (0, plan.padded_dim - vector.size)), server_round)
    integers = conditional_round(plan.scale * vector, plan.l2_sensitivity, rng)
    noisy = integers + skellam_noise(plan.client_variance, integers.size, rng)
    return [to_secagg_input(noisy, plan.modulus)]


# ----------------------------------------------------------------------------- the server's steps
def secure_integer_sum(aggregate: list[np.ndarray], num_survivors: int, plan: SkellamPlan) -> np.ndarray:
    """The sum of the survivors' noisy integers modulo 2**bits, centred in [-2**(bits-1), 2**(bits-1)),
    from the mean that ``SecAggPlusWorkflow`` hands the strategy. (padded_dim,) -> (padded_dim,) int64."""
    (mean,) = aggregate
    total = np.rint(np.asarray(mean, dtype=np.float64) * num_survivors).astype(np.int64)  # sum of to_secagg_input
    half = plan.modulus // 2
    return np.mod(total + num_survivors * half + half, plan.modulus) - half


NORM_TAIL = 10.0  # standard deviations of slack in feasible_mean_norm: an honest round exceeds it w.p. < e**-50


def feasible_mean_norm(plan: SkellamPlan, num_survivors: int) -> float:
    """The largest L2 norm that ``decode_aggregate`` can return for ``num_survivors`` honest
    clients, but with probability below e**-50. In grid units each client's rounded vector has
    norm <= ``l2_sensitivity`` and adds Skellam noise of variance ``client_variance`` per
    coordinate; the sum of n such noises has norm <= sqrt(n v) (sqrt(d) + t) with overwhelming
    probability (a Lipschitz function of sub-Gaussian noise concentrates about its mean). The
    rotation is orthonormal and truncation only shortens, so the mean's norm is at most
    (n l2 + sqrt(n v) (sqrt(d) + t)) / (scale n). A larger one can only come from a client that
    skipped its own clipping or wrapped its integers."""
    n, dim = num_survivors, plan.padded_dim
    grid = n * plan.l2_sensitivity + math.sqrt(n * plan.client_variance) * (math.sqrt(dim) + NORM_TAIL)
    return grid / (plan.scale * n)


def decode_aggregate(aggregate: list[np.ndarray], num_survivors: int, plan: SkellamPlan, server_round: int,
                     shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """The mean noisy update over the survivors, in the adapter's shapes (float64)."""
    vector = secure_integer_sum(aggregate, num_survivors, plan) / plan.scale
    if plan.rotation:
        vector = unrotate(vector, server_round)
    vector = vector[: plan.dim] / num_survivors
    sizes = [math.prod(shape) for shape in shapes]
    return [part.reshape(shape) for part, shape in zip(np.split(vector, np.cumsum(sizes)[:-1]), shapes, strict=True)]


# ----------------------------------------------------------------------------- accounting
def skellam_rdp(variance: float, l1_sensitivity: float, l2_sensitivity: float) -> np.ndarray:
    """RDP of the Skellam mechanism at ``ORDERS`` (Agarwal et al. 2021, Theorem 3.5):
    alpha D2^2 / (2 mu) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2), 3 D1 / (2 mu)).
    The first term is the Gaussian mechanism's at variance mu; the rest is discreteness's price."""
    alpha = np.asarray(ORDERS, dtype=np.float64)
    d1, d2sq, mu = l1_sensitivity, l2_sensitivity**2, variance
    return alpha * d2sq / (2 * mu) + np.minimum(((2 * alpha - 1) * d2sq + 6 * d1) / (4 * mu**2), 3 * d1 / (2 * mu))


def poisson_subsampled_rdp(rdp: np.ndarray, q: float) -> np.ndarray:
    """RDP at ``ORDERS`` of a mechanism (RDP ``rdp`` at ``ORDERS``) run on a Poisson sample at rate q:
    Zhu & Wang (ICML 2019), Theorem 9, an upper bound for any mechanism at integer orders, and never
    more than the mechanism's own RDP."""
    if q == 1:
        return np.asarray(rdp, dtype=np.float64)
    eps = dict(zip(ORDERS, rdp))
    out = []
    for alpha in ORDERS:
        ls = np.arange(2, alpha + 1)
        log_binom = gammaln(alpha + 1) - gammaln(ls + 1) - gammaln(alpha - ls + 1)
        terms = log_binom + ls * math.log(q) + (alpha - ls) * math.log1p(-q) + (ls - 1) * np.array([eps[l] for l in ls])
        weights = np.where(ls == 2, 1.0, 3.0)
        first = (alpha - 1) * math.log1p(-q) + math.log(alpha * q - q + 1)
        bound = logsumexp(np.concatenate([[first], terms]), b=np.concatenate([[1.0], weights])) / (alpha - 1)
        out.append(min(bound, eps[alpha]))
    return np.asarray(out)


@dataclass
class ClientLevelAccount:
    """Client-level privacy spent by the federation: rounds of ``(variance, l1, l2, q)``, merged
    while they repeat. The server keeps it (it alone knows the sampling rate) in its state."""

    history: list[tuple[float, float, float, float, int]] = field(default_factory=list)

    def record(self, plan: SkellamPlan, sample_rate: float) -> None:
        self.record_step(plan.central_variance, plan.l1_sensitivity, plan.l2_sensitivity, sample_rate)

    def record_step(self, variance: float, l1_sensitivity: float, l2_sensitivity: float, sample_rate: float) -> None:
        """One round of the Skellam mechanism of ``variance`` and these sensitivities, at sampling rate q."""
        step = (float(variance), float(l1_sensitivity), float(l2_sensitivity), float(sample_rate))
        if self.history and tuple(self.history[-1][:4]) == step:
            self.history[-1] = (*step, self.history[-1][4] + 1)
        else:
            self.history.append((*step, 1))

    @property
    def rounds(self) -> int:
        return sum(entry[4] for entry in self.history)

    def epsilon(self, delta: float) -> float:
        from opacus.accountants.analysis.rdp import get_privacy_spent

        if not self.history:
            return 0.0
        total = sum(rounds * poisson_subsampled_rdp(skellam_rdp(variance, l1, l2), q)
                    for variance, l1, l2, q, rounds in self.history)
        return float(get_privacy_spent(orders=list(ORDERS), rdp=total, delta=delta)[0])

    def to_json(self) -> str:
        return json.dumps([list(entry) for entry in self.history])

    @classmethod
    def from_json(cls, text: str) -> ClientLevelAccount:
        return cls([(float(v), float(l1), float(l2), float(q), int(r)) for v, l1, l2, q, r in json.loads(text)])
