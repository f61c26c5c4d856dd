"""The local loop of the stages that learn from fixed data, not from rollouts: ``sft``
(``flwr_verl.stages.sft``) and ``reward_model`` (``flwr_verl.stages.preference``).

One local iteration, top to bottom, as the policy's (``trainer.LocalPPOTrainer``) minus the
rollout:

1. Poisson-sample privacy units at q = ``data.train_batch_size`` / N (shuffled batches without DP);
2. ``actor.ppo_epochs`` passes; each splits the sampled units into
   ``train_batch_size / ppo_mini_batch_size`` mini-batches (``update.split``);
3. per mini-batch: the stage's loss (``unit_loss``: a mean over units of each unit's own loss),
   backward, one step of the update (``engine.update.start_update``: DP-SGD with per-unit clipping,
   FedProx's term, AdamW), or a noise-only step for an empty mini-batch.

So a stage only writes its loss; the accounting (``privacy.IterationMechanism``), FedProx,
SecAgg+, the node's time budget and the run directory are the policy's.
"""

from __future__ import annotations

import abc
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flwr_verl.config import EngineConfig


@dataclass
class UnitFit:
    """One fit: its update (private or plain) and the endless stream of unit batches."""

    update: object
    batches: Iterator[list[int]]

    @property
    def mechanism(self):
        return self.update.mechanism


@dataclass
class UnitLoss:
    """One mini-batch's loss and how its rows map to units (``privacy.pool_rows``)."""

    loss: torch.Tensor  # scalar: the mean over the mini-batch's units of each unit's loss
    unit_of_row: torch.Tensor  # (rows,) unit ids 0..U-1 of the rows Opacus sees
    metrics: dict[str, float]


class UnitTrainer(abc.ABC):
    """The trainer interface ``VerlClient`` runs (``fit``, ``evaluate``, ``models.adapters``,
    ``policy_params``: the trained weights) over a list of privacy units. A stage subclasses it
    with ``unit_loss`` and ``evaluate``; ``model`` is the module whose trainable weights train."""

    def __init__(self, config: EngineConfig, train_units: list, models, model: torch.nn.Module) -> None:
        torch.set_num_threads(config.trainer.num_threads)
        self.config = config
        self.train_units = train_units
        self.models = models
        self.model = model
        self.policy_params = [p for p in model.parameters() if p.requires_grad]

    @abc.abstractmethod
    def unit_loss(self, units: list) -> UnitLoss:
        """The loss of one non-empty mini-batch of units."""

    @abc.abstractmethod
    def evaluate(self, units: list):
        """An ``engine.evaluation.Evaluation`` on held-out ``units``; None without any."""

    def fit(self, iterations: int, *, anchor: Sequence[np.ndarray | torch.Tensor] | None = None,
            proximal_mu: float = 0.0, noise_multiplier: float | None = None, seed: int = 0,
            time_budget_s: float | None = None):
        """As ``trainer.LocalPPOTrainer.fit``: up to ``iterations``, none started after ``time_budget_s``."""
        from flwr_verl.engine.trainer import FitResult, run_iterations

        with self.start_fit(anchor=anchor, proximal_mu=proximal_mu, noise_multiplier=noise_multiplier,
                            seed=seed) as fit:
            metrics = run_iterations(lambda: self.iteration(fit), iterations, time_budget_s)
        return FitResult(metrics=metrics, mechanism=fit.mechanism)

    @contextmanager
    def start_fit(self, *, anchor=None, proximal_mu: float = 0.0, noise_multiplier: float | None = None,
                  seed: int = 0) -> Iterator[UnitFit]:
        from flwr_verl.engine.update import start_update

        update, batches = start_update(self.model, self.policy_params, len(self.train_units), self.config,
                                       rows_per_unit=1, anchor=anchor, proximal_mu=proximal_mu,
                                       noise_multiplier=noise_multiplier, seed=seed)
        try:
            yield UnitFit(update, batches)
        finally:
            update.close()

    def iteration(self, fit: UnitFit) -> dict[str, float]:
        """Draw units, then ``actor.ppo_epochs`` passes of steps over mini-batches (module docstring)."""
        start = time.perf_counter()
        units = [self.train_units[i] for i in next(fit.batches)]
        num_mini_batches = self.config.data.train_batch_size // self.config.actor.ppo_mini_batch_size
        if not units:  # an empty Poisson draw is still a round of (noise-only) DP steps
            for _ in range(self.config.actor.ppo_epochs * num_mini_batches):
                fit.update.noise_only_step()
            return {"prompts": 0.0}
        totals: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        with fit.update.recording():  # under DP, only these forward passes feed per-sample gradients
            for _ in range(self.config.actor.ppo_epochs):
                for members in fit.update.split(len(units)):
                    if len(members) == 0:
                        fit.update.noise_only_step()
                        continue
                    step = self.unit_loss([units[i] for i in members])
                    fit.update.backward(step.loss)
                    fit.update.step(step.unit_of_row)
                    for name, value in step.metrics.items():
                        totals[name].append(value)
        self.model.eval()
        return {"prompts": float(len(units)), **{k: float(np.mean(v)) for k, v in totals.items()},
                "time_update": time.perf_counter() - start}
