"""DP-SGD for the local PPO update, through Opacus, with deliberate accounting.

``make_private`` is the one call that adds privacy to a fit: like Opacus's
``PrivacyEngine.make_private`` it takes the policy, its optimizer and the prompt set, and
returns a ``PrivateUpdate``: Opacus's DP optimizer, Opacus's Poisson sampler over prompts, the
mini-batch split, and Opacus's per-sample gradients computed only for the update's own forward
passes (``per_sample.PerSampleGradients``: ``PrivacyEngine.make_private`` would hook every
forward of the policy, generation included). ``PrivacyAccount`` owns what was spent and
serialises it.

**Privacy unit.** One prompt with everything generated from it: its ``n`` responses, their
rewards, advantages and the KL terms. ``per_sample.PerSampleGradients`` computes one gradient
per unit, the gradient of the mean loss over its n response rows (units of varying size get
per-row gradients, pooled by ``pool_rows``), before Opacus clips it to ``max_grad_norm`` and
adds Gaussian noise of std ``noise_multiplier * max_grad_norm``.

**Sampling.** Each local iteration Poisson-samples prompts at rate q = train_batch_size / N.
An empty draw still makes its (noise-only) steps, so the number of releases never depends on
the data.

**Accounting.** One iteration runs K = ``ppo_epochs`` passes over the sampled units. In each
pass every sampled unit is assigned to one of the M mini-batches independently and uniformly
(``PrivateUpdate.split``), so a unit's assignment never depends on which other units were
sampled: adding or removing one unit changes exactly one mini-batch per pass, and the unit
enters exactly one noisy step per pass. Its K releases compose to a Gaussian mechanism of noise
multiplier sigma / sqrt(K) (Gaussian DP composition, tight), and subsampling amplifies that
mechanism once per iteration. So each iteration is recorded as one Sampled Gaussian step with
(sigma / sqrt(K), q): an ``IterationMechanism``. Opacus's own step hook would record K
independent subsampled steps, which undercounts; it is removed here.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from flwr_verl.config import ConfigError, FlwrVerlError, PrivacyConfig

PRIVACY_UNIT = "prompt"  # one prompt with everything generated from it (the ledger keys budgets by it)

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

    from flwr_verl.privacy.per_sample import PerSampleGradients


def sample_rate(batch_size: int, num_prompts: int) -> float:
    q = batch_size / num_prompts if num_prompts else math.inf
    if not 0 < q <= 1:
        raise ConfigError(
            f"data.train_batch_size={batch_size} with {num_prompts} private prompts gives sample rate q={q:.4g}; "
            "q must be in (0, 1]: lower data.train_batch_size or give the client more prompts"
        )
    return q


# ----------------------------------------------------------------------------- accounting
@dataclass(frozen=True)
class IterationMechanism:
    """One local iteration as a privacy mechanism: K = ``ppo_epochs`` noisy releases of every
    unit sampled at rate ``sample_rate``, each at ``noise_multiplier``."""

    noise_multiplier: float
    sample_rate: float
    ppo_epochs: int = 1
    # > 0: the iteration also releases the training metrics' noisy sums over the same draw at this
    # noise multiplier (``privacy.metrics = "dp"``, ``release_metrics``); 0: no metric is released.
    metrics_noise_multiplier: float = 0.0

    @property
    def effective_noise_multiplier(self) -> float:
        """The K releases composed: one Gaussian mechanism at sigma / sqrt(K). With the metrics'
        release, which uses the same Poisson draw, the K + 1 Gaussian releases of a sampled unit
        compose to one at 1 / sqrt(K / sigma^2 + 1 / sigma_m^2), subsampled once (two separate
        Sampled Gaussian entries would assume two independent draws)."""
        if self.metrics_noise_multiplier == 0:
            return self.noise_multiplier / math.sqrt(self.ppo_epochs)
        if self.noise_multiplier == 0:
            return 0.0
        return 1 / math.sqrt(self.ppo_epochs / self.noise_multiplier ** 2 + 1 / self.metrics_noise_multiplier ** 2)


class PrivacyAccountError(FlwrVerlError, ValueError):
    """A serialised privacy account is malformed."""


@dataclass
class PrivacyAccount:
    """The privacy spent on one data set: a history of Sampled Gaussian steps, as Opacus's
    accountants keep it (``(noise multiplier, sample rate, steps)``), and the accountant that
    turns it into epsilon.

    ``record`` spends; ``after`` answers "what if" without spending; ``to_json``/``from_json``
    serialise it. What a data set has spent across runs is kept in the node's ``ledger.py``.
    """

    accountant: str = "rdp"
    history: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def record(self, mechanism: IterationMechanism, iterations: int) -> None:
        """Spend ``iterations`` iterations of ``mechanism`` (merged like Opacus's accountants)."""
        if iterations < 0:
            raise ValueError(f"iterations={iterations} must be >= 0")
        if iterations == 0:
            return
        step = (mechanism.effective_noise_multiplier, mechanism.sample_rate)
        if self.history and tuple(self.history[-1][:2]) == step:
            self.history[-1] = (*step, self.history[-1][2] + iterations)
        else:
            self.history.append((*step, iterations))

    def after(self, mechanism: IterationMechanism, iterations: int) -> PrivacyAccount:
        """A copy that has also spent ``iterations`` iterations of ``mechanism``."""
        future = PrivacyAccount(self.accountant, list(self.history))
        future.record(mechanism, iterations)
        return future

    def epsilon(self, delta: float) -> float:
        """Epsilon spent at ``delta``, from Opacus's accountant; infinity if any step had no noise."""
        from opacus.accountants import create_accountant
        from opacus.accountants.analysis import rdp

        history = [entry for entry in self.history if entry[2] > 0]  # no step, no release (PRV fails on them)
        if not history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in history):
            return math.inf
        if self.accountant == "rdp":  # what RDPAccountant.get_epsilon computes, from cached per-step RDP
            orders = create_accountant("rdp").DEFAULT_ALPHAS
            total = sum(_rdp_of_one_step(q, sigma) * steps for sigma, q, steps in history)
            return float(rdp.get_privacy_spent(orders=orders, rdp=total, delta=delta)[0])
        accountant = create_accountant(self.accountant)
        accountant.history = history
        return float(accountant.get_epsilon(delta=delta))

    def to_json(self) -> str:
        return json.dumps({"accountant": self.accountant, "history": [list(entry) for entry in self.history]})

    @classmethod
    def from_json(cls, text: str) -> PrivacyAccount:
        try:
            data = json.loads(text)
            history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in data["history"]]
            return cls(accountant=str(data["accountant"]), history=history)
        except (ValueError, KeyError, TypeError) as error:
            raise PrivacyAccountError(f"malformed privacy account {text[:120]!r}: {error}") from error


def compose(*accounts: PrivacyAccount) -> PrivacyAccount:
    """One account for a data set that several runs used in turn (the RLHF pipeline's stages on
    the same private prompts): their histories together, so epsilon is that of the sequential
    composition. Accounts of disjoint data sets are not composed: each keeps its own epsilon."""
    kinds = {account.accountant for account in accounts}
    if len(kinds) > 1:
        raise PrivacyAccountError(f"cannot compose accounts of different accountants: {sorted(kinds)}")
    return PrivacyAccount(kinds.pop() if kinds else "rdp",
                          [entry for account in accounts for entry in account.history])


@functools.lru_cache(maxsize=256)
def _rdp_of_one_step(q: float, sigma: float) -> np.ndarray:
    """RDP of one Sampled Gaussian step at Opacus's default orders. RDP composes by addition,
    and ``compute_rdp(steps=k)`` is exactly k times this, so a history of any length costs one
    sum: the exact computation at ~0.3 s per mechanism is paid once per process."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    return compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)


def noise_for_target_epsilon(config: PrivacyConfig, q: float, total_iterations: int, ppo_epochs: int) -> float:
    """The noise multiplier that spends ``config.target_epsilon`` over all planned iterations
    (with the metrics' release under ``privacy.metrics = "dp"``, which shares the budget)."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        sigma_eff = get_noise_multiplier(
            target_epsilon=config.target_epsilon, target_delta=config.delta, sample_rate=q,
            steps=total_iterations, accountant=config.accountant,
        )
    except ValueError as error:
        raise ConfigError(
            f"privacy.target_epsilon={config.target_epsilon} cannot be met with delta={config.delta}, q={q:.4g} "
            f"and {total_iterations} iterations: {error}"
        ) from error
    if config.sent_metrics != "dp":
        return sigma_eff * math.sqrt(ppo_epochs)
    # IterationMechanism.effective_noise_multiplier solved for the update's sigma.
    if config.metrics_noise_multiplier <= sigma_eff:
        raise ConfigError(
            f"privacy.metrics_noise_multiplier={config.metrics_noise_multiplier} is invalid with "
            f"privacy.target_epsilon={config.target_epsilon}: the metrics alone would spend the target; "
            f"it must be > {sigma_eff:.4g} (the whole iteration's noise multiplier)")
    return math.sqrt(ppo_epochs / (1 / sigma_eff ** 2 - 1 / config.metrics_noise_multiplier ** 2))


# ----------------------------------------------------------------------------- released training metrics
# ``privacy.metrics = "dp"``: the training metrics a client releases, each a bounded per-prompt
# mean. The sampled reward (the signal RLHF is judged by) and the response length (the usual sign of
# length hacking and collapse) are the two whose per-prompt value has a natural, stated range:
# scores are clipped to [-custom_reward_function.clip, clip] and lengths lie in [0,
# rollout.response_length]. KL and the losses have no such bound, and timings are not per prompt.
DP_METRICS = ("reward_mean", "response_length")


def metric_ranges(reward_clip: float, response_length: int) -> dict[str, tuple[float, float]]:
    """The range each of ``DP_METRICS``' per-prompt values is clipped to."""
    return {"reward_mean": (-reward_clip, reward_clip), "response_length": (0.0, float(response_length))}


def centered_prompt_sum(values: torch.Tensor, low: float, high: float) -> float:
    """Sum over prompts of clip(v, low, high) rescaled to [-1/2, 1/2]: adding or removing one
    prompt changes it by at most 1/2. ``values``: (prompts,), one per-prompt mean each."""
    return float(((values.clamp(low, high) - low) / (high - low) - 0.5).sum())


def metrics_sensitivity(num_metrics: int) -> float:
    """L2 sensitivity of one iteration's vector of ``centered_prompt_sum`` s (one prompt moves each
    coordinate by at most 1/2)."""
    return math.sqrt(num_metrics) / 2


def released_metric_std(low: float, high: float, *, num_metrics: int, noise_multiplier: float,
                        iterations: int, batch_size: int) -> float:
    """Std of the noise in one value of ``release_metrics``, in the metric's own units."""
    std_of_sum = noise_multiplier * metrics_sensitivity(num_metrics) * math.sqrt(iterations)
    return (high - low) * std_of_sum / (iterations * batch_size)


def release_metrics(centered_sums: dict[str, float], ranges: dict[str, tuple[float, float]], *,
                    iterations: int, batch_size: int, noise_multiplier: float,
                    rng: np.random.Generator) -> dict[str, float]:
    """The round's noised metrics: per-prompt means over every iteration's sampled prompts.

    ``centered_sums[name]`` is the round's sum of each iteration's ``centered_prompt_sum``. Each
    iteration's vector of sums is a Gaussian release at ``noise_multiplier`` times
    ``metrics_sensitivity`` over that iteration's Poisson draw (accounted with the update, see
    ``IterationMechanism.metrics_noise_multiplier``); their sum is drawn here with one Gaussian of
    sqrt(iterations) times that std, the same distribution. The denominator is fixed,
    ``iterations * batch_size`` (the expected number of sampled prompts), never the realised
    count, which would depend on the data.
    """
    std_of_sum = noise_multiplier * metrics_sensitivity(len(centered_sums)) * math.sqrt(iterations)
    released = {}
    for name, total in centered_sums.items():
        low, high = ranges[name]
        noisy = total + rng.normal(0.0, std_of_sum)
        released[name] = low + (high - low) * (0.5 + noisy / (iterations * batch_size))
    return released


# ----------------------------------------------------------------------------- the private update
def pool_rows(params: list[torch.nn.Parameter], unit_of_row: torch.Tensor, num_units: int) -> None:
    """Turn per-row gradient samples into per-unit ones, for units with different numbers of
    rows (a prompt with any number of preference pairs): row r belongs to unit ``unit_of_row[r]``.
    (Units of n adjacent rows each get their gradients directly: ``PerSampleGradients``.)

    The loss is the mean over units of each unit's own loss. Opacus's ``loss_reduction="mean"``
    scales each of the R rows' gradient samples by R, so unit u's gradient is
    (num_units / R) * the sum of its rows' samples.
    """
    for param in params:
        sample = param.grad_sample
        pooled = torch.zeros((num_units, *sample.shape[1:]), dtype=sample.dtype, device=sample.device)
        pooled.index_add_(0, unit_of_row.to(sample.device), sample)
        param.grad_sample = pooled * (num_units / sample.shape[0])


def unit_means(values: torch.Tensor, unit_of_row: torch.Tensor, num_units: int) -> torch.Tensor:
    """Each unit's mean of its rows' ``values``: (num_units,) from (R,), row r in unit
    ``unit_of_row[r]``. A loss that is the mean of these over units is the one ``pool_rows``
    turns into exact per-unit gradients: each unit's term depends on its own rows alone."""
    rows_per_unit = torch.bincount(unit_of_row, minlength=num_units).to(values)
    return torch.zeros(num_units, dtype=values.dtype, device=values.device).index_add(
        0, unit_of_row, values) / rows_per_unit


class PublicTerm(Protocol):
    """A loss term that reads no private data (FedProx's proximal term, ``engine.proximal.Proximal``):
    its gradient is added after clipping and noise, unclipped and at no privacy cost."""

    def add_gradient(self, params: Sequence[torch.nn.Parameter]) -> None: ...


@dataclass
class PrivateUpdate:
    """The DP-SGD update of one fit: what ``make_private`` returns.

    ``split`` assigns sampled units to mini-batches; the update's forward passes run inside
    ``recording()``, and ``backward(loss)`` computes each unit's gradient from them (each
    row's, with ``rows_per_unit=1``); ``step`` takes one mini-batch's DP step (clip per unit,
    noise, FedProx's data-independent term, optimizer step); ``noise_only_step`` takes the step
    of an empty mini-batch; ``close`` detaches Opacus.
    """

    optimizer: DPOptimizer
    sampler: DataLoader  # Poisson draws of prompt indices at rate ``mechanism.sample_rate``
    mechanism: IterationMechanism
    proximal: PublicTerm | None  # FedProx's term; None: none
    rows_per_unit: int
    num_mini_batches: int
    rng: np.random.Generator
    per_sample: PerSampleGradients = field(repr=False)

    def split(self, unit_count: int) -> list[np.ndarray]:
        """Each unit to one of the mini-batches, independently and uniformly (see the module
        docstring: this is what makes a unit's participation independent of the others)."""
        assignment = self.rng.integers(self.num_mini_batches, size=unit_count)
        return [np.flatnonzero(assignment == batch) for batch in range(self.num_mini_batches)]

    def recording(self) -> AbstractContextManager[None]:
        """A block whose training forward passes ``backward`` can differentiate per row."""
        return self.per_sample.recording()

    def backward(self, loss: torch.Tensor) -> None:
        """Per-unit gradients (``grad_sample``) of the mini-batch's mean-over-rows ``loss``, for
        units of ``rows_per_unit`` adjacent rows."""
        self.per_sample.backward(loss)

    def step(self, unit_of_row: torch.Tensor | None = None) -> dict[str, float]:
        """After ``backward(loss)`` on one mini-batch: one DP-SGD step. With ``unit_of_row``
        (ids 0..U-1; needs ``rows_per_unit=1``) the per-row gradients are pooled into those units
        first."""
        if any(getattr(param, "grad_sample", None) is None for param in self.optimizer.params):
            raise RuntimeError("PrivateUpdate.step: no per-sample gradients; run the forward pass inside "
                               "update.recording() and call update.backward(loss), not loss.backward()")
        if unit_of_row is not None:
            if self.rows_per_unit != 1:
                raise ValueError(f"PrivateUpdate.step(unit_of_row): the gradients are already per unit of "
                                 f"{self.rows_per_unit} rows; pooling by unit_of_row needs rows_per_unit=1")
            pool_rows(self.optimizer.params, unit_of_row, int(unit_of_row.max()) + 1)
        self._noisy_step()
        return {}

    def noise_only_step(self) -> None:
        """A step for an empty mini-batch: zero clipped gradients plus noise."""
        for param in self.optimizer.params:
            param.grad_sample = torch.zeros((0, *param.shape), dtype=param.dtype, device=param.device)
        self._noisy_step()

    def _noisy_step(self) -> None:
        # Opacus's pre_step clips each unit's gradient, sums, adds noise and divides by the
        # expected batch size. FedProx's gradient does not depend on data: it is added after
        # the noise, unclipped and at no privacy cost, then the inner optimizer steps.
        if self.optimizer.pre_step():
            if self.proximal is not None:
                self.proximal.add_gradient(self.optimizer.params)
            self.optimizer.original_optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        """Detach Opacus from the model: no per-sample gradient state stays on its weights."""
        self.per_sample.close()
        for param in self.optimizer.params:
            for attr in ("grad_sample", "summed_grad"):
                vars(param).pop(attr, None)


def make_private(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_prompts: int,
    config: PrivacyConfig,
    *,
    batch_size: int,
    num_mini_batches: int,
    rows_per_unit: int,
    ppo_epochs: int = 1,
    noise_multiplier: float,
    proximal: PublicTerm | None = None,
    seed: int | None = None,
) -> PrivateUpdate:
    """Wrap the policy, its optimizer and the prompt indices for DP-SGD.

    ``proximal`` is FedProx's term (any ``PublicTerm``), added after clipping and noise. ``seed`` makes sampling, mini-batch assignment and noise reproducible, for tests
    and benchmarks only: whoever knows the seed can subtract the noise. Without it all three
    come from the OS's entropy.
    """
    from opacus.data_loader import DPDataLoader
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator

    from flwr_verl.privacy.per_sample import PerSampleGradients

    q = sample_rate(batch_size, num_prompts)  # validates q = batch_size / N before any work
    seed = secrets.randbits(63) if seed is None else seed
    device = next(policy.parameters()).device
    ModuleValidator.validate(policy, strict=True)  # what PrivacyEngine.make_private checks: no unsupported layer
    # Every mini-batch step averages over the expected number of units in it, a constant, so
    # the average reveals nothing. No accounting hook on the optimizer: Opacus's would count
    # each epoch as a fresh subsampled step; the caller's PrivacyAccount records
    # IterationMechanism steps instead.
    dp_optimizer = DPOptimizer(
        optimizer, noise_multiplier=noise_multiplier, max_grad_norm=config.max_grad_norm,
        expected_batch_size=q * num_prompts / num_mini_batches, loss_reduction="mean",
        generator=torch.Generator(device=device).manual_seed(seed + 1),
    )
    # Sample at exactly q = batch_size / N, the rate callers plan and account with (Opacus's
    # make_private samples at 1 / ceil(N / batch_size)), and without end: every draw is fresh
    # (a loader that stops after 1/q draws and is cycled replays them, which voids the
    # amplification by subsampling).
    sampler = DPDataLoader(TensorDataset(torch.arange(num_prompts, device="cpu")), sample_rate=q,
                           generator=torch.Generator().manual_seed(seed))
    sampler.batch_sampler.steps = sys.maxsize
    return PrivateUpdate(
        optimizer=dp_optimizer, sampler=sampler,
        mechanism=IterationMechanism(noise_multiplier, sampler.sample_rate, ppo_epochs),
        proximal=proximal, rows_per_unit=rows_per_unit, num_mini_batches=num_mini_batches,
        rng=np.random.default_rng(seed + 2),
        per_sample=PerSampleGradients(policy, functorch=config.grad_sample_mode == "functorch",
                                      rows_per_unit=rows_per_unit),
    )
