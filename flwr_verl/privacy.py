"""DP-SGD for the local PPO update, through Opacus, with deliberate accounting.

``make_private`` is the one call that adds privacy to a trainer: like Opacus's
``PrivacyEngine.make_private`` (which it calls) it takes the policy, its optimizer and the
prompt set, and returns the DP optimizer and a Poisson sampler over prompts.

**Privacy unit.** One prompt with everything generated from it: its ``n`` responses, their
rewards, advantages and the KL terms. Opacus computes one gradient per response row; the rows of
a unit are pooled into one unit gradient (``pool_units``) before Opacus clips it to
``max_grad_norm`` and adds Gaussian noise of std ``noise_multiplier * max_grad_norm``.

**Sampling.** Each local iteration Poisson-samples prompts at rate q = train_batch_size / N.
An empty draw still makes its (noise-only) steps, so the number of releases never depends on
the data.

**Accounting.** One iteration runs ``ppo_epochs`` passes over the sampled units; in each pass
a unit enters exactly one noisy mini-batch step. Its K = ppo_epochs noisy gradient releases
compose to a Gaussian mechanism of noise multiplier sigma / sqrt(K) (Gaussian DP composition,
tight), and subsampling amplifies that mechanism once per iteration. So each iteration is
recorded as one Sampled Gaussian step with (sigma / sqrt(K), q). Opacus's own step hook would
record K independent subsampled steps, which undercounts; it is replaced here.
"""

from __future__ import annotations

import math
import secrets
import warnings
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch.utils.data import DataLoader, TensorDataset

from flwr_verl.config import ConfigError, PrivacyConfig

# Opacus warns that its secure RNG is off (we document what our seeding means instead), and
# torch that backward hooks fire with no input requiring grad (true for frozen embeddings).
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing")

History = list[tuple[float, float, int]]  # Opacus accountant history: (noise multiplier, sample rate, steps)


def sample_rate(batch_size: int, num_prompts: int) -> float:
    q = batch_size / num_prompts if num_prompts else math.inf
    if not 0 < q <= 1:
        raise ConfigError(
            f"data.train_batch_size={batch_size} with {num_prompts} private prompts gives sample rate q={q:.4g}; "
            "q must be in (0, 1]: lower data.train_batch_size or give the client more prompts"
        )
    return q


def effective_noise_multiplier(noise_multiplier: float, ppo_epochs: int) -> float:
    """Noise multiplier of one iteration's K = ppo_epochs releases composed (sigma / sqrt(K))."""
    return noise_multiplier / math.sqrt(ppo_epochs)


def epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """Epsilon spent by ``history`` at ``delta``, from Opacus's accountant."""
    history = [entry for entry in history if entry[2] > 0]  # no step, no release (PRV fails on them)
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf
    account = create_accountant(accountant)
    account.history = list(history)
    return float(account.get_epsilon(delta=delta))


def record_iterations(history: History, noise_multiplier: float, ppo_epochs: int, q: float, iterations: int) -> History:
    """``history`` extended by ``iterations`` local iterations (merged like Opacus's accountants)."""
    if iterations == 0:
        return list(history)
    step = (effective_noise_multiplier(noise_multiplier, ppo_epochs), q)
    if history and tuple(history[-1][:2]) == step:
        return history[:-1] + [(*step, history[-1][2] + iterations)]
    return history + [(*step, iterations)]


def noise_for_target_epsilon(config: PrivacyConfig, q: float, total_iterations: int, ppo_epochs: int) -> float:
    """The noise multiplier that spends ``config.target_epsilon`` over all planned iterations."""
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
    return sigma_eff * math.sqrt(ppo_epochs)


def pool_units(params: list[torch.nn.Parameter], rows_per_unit: int) -> None:
    """Turn per-row gradient samples into per-unit ones: the mean over each unit's adjacent rows.

    The loss is a mean over rows and Opacus's ``loss_reduction="mean"`` scales each row's
    gradient sample to that row's own loss gradient, so the mean over a unit's rows is the
    gradient of the unit's mean loss.
    """
    for param in params:
        sample = param.grad_sample
        param.grad_sample = sample.view(-1, rows_per_unit, *sample.shape[1:]).mean(dim=1)


@dataclass
class PrivateTraining:
    """What ``make_private`` returns: the DP optimizer, the Poisson prompt sampler, and its rate."""

    optimizer: DPOptimizer
    sampler: DataLoader
    sample_rate: float
    _hooks: object = field(repr=False)

    def noise_only_step(self) -> None:
        """A step for an empty mini-batch: zero clipped gradients plus noise."""
        for param in self.optimizer.params:
            param.grad_sample = torch.zeros((0, *param.shape), dtype=param.dtype, device=param.device)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        """Detach Opacus from the model (a cached model gets hooks again at the next fit)."""
        self._hooks.cleanup()


def make_private(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_prompts: int,
    config: PrivacyConfig,
    *,
    batch_size: int,
    num_mini_batches: int,
    noise_multiplier: float,
    after_noise=None,
    seed: int | None = None,
) -> PrivateTraining:
    """Wrap the policy, optimizer and prompt indices for DP-SGD.

    ``after_noise(optimizer)`` runs after clipping and noise and before the optimizer step:
    the place for data-independent gradient terms such as FedProx's.

    ``seed`` makes sampling and noise reproducible, for tests and benchmarks only: whoever
    knows the seed can subtract the noise. Without it both come from the OS's entropy.
    """
    q = sample_rate(batch_size, num_prompts)  # validates q = batch_size / N before any work
    seed = secrets.randbits(63) if seed is None else seed
    prompt_indices = DataLoader(TensorDataset(torch.arange(num_prompts)), batch_size=batch_size)
    hooks, dp_optimizer, _ = PrivacyEngine(accountant=config.accountant).make_private(
        module=policy, optimizer=optimizer, data_loader=prompt_indices,
        noise_generator=torch.Generator(device=next(policy.parameters()).device).manual_seed(seed + 1),
        noise_multiplier=noise_multiplier, max_grad_norm=config.max_grad_norm,
        poisson_sampling=True, grad_sample_mode=config.grad_sample_mode, wrap_model=False,
        loss_reduction="mean",
    )
    # Opacus's own loader samples at 1 / ceil(N / batch_size), not at the q = batch_size / N that
    # callers plan and account with, and stops after 1/q draws (a caller that cycles it replays
    # the same draws, which voids the amplification by subsampling). Sample at exactly q, and
    # without end: every draw is fresh.
    sampler = DPDataLoader(prompt_indices.dataset, sample_rate=q, generator=torch.Generator().manual_seed(seed))
    sampler.batch_sampler.steps = sys.maxsize
    # Every mini-batch step averages over the expected number of units in it, a constant, so
    # the average reveals nothing.
    dp_optimizer.expected_batch_size = q * num_prompts / num_mini_batches
    # Replaces Opacus's accounting hook (it would count each epoch as a fresh subsampled step).
    dp_optimizer.step_hook = after_noise
    return PrivateTraining(optimizer=dp_optimizer, sampler=sampler, sample_rate=sampler.sample_rate, _hooks=hooks)


def split_units(unit_count: int, num_mini_batches: int, generator: np.random.Generator) -> list[np.ndarray]:
    """A random split of ``unit_count`` sampled units into a fixed number of mini-batches."""
    return np.array_split(generator.permutation(unit_count), num_mini_batches)
