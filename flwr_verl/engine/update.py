"""One fit's optimizer update of LoRA weights, shared by every local objective (PPO, SFT, reward
model, DPO): the plain one (clip, FedProx's gradient, AdamW step) or, under ``privacy.enabled``,
Opacus's DP-SGD per privacy unit (``privacy.dpsgd.make_private``); and the endless stream of unit
batches it draws from (Poisson under DP)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from flwr_verl.config import EngineConfig
from flwr_verl.engine.proximal import Proximal
from flwr_verl.privacy.dpsgd import PrivateUpdate, make_private, sample_rate


@dataclass
class PlainUpdate:
    """The non-private update of one fit: clip the mini-batch gradient to ``actor.grad_clip``,
    add FedProx's gradient, AdamW step. The private counterpart is ``privacy.PrivateUpdate``."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    proximal: Proximal
    grad_clip: float
    num_mini_batches: int
    rng: np.random.Generator
    mechanism = None  # no privacy mechanism: nothing to account

    def split(self, unit_count: int) -> list[np.ndarray]:
        """A random split of the units into equal mini-batches."""
        return np.array_split(self.rng.permutation(unit_count), self.num_mini_batches)

    def recording(self) -> AbstractContextManager[None]:
        """Nothing to record: the plain update needs only the batch gradient."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, unit_of_row: torch.Tensor | None = None) -> dict[str, float]:
        """One step on the mini-batch gradient (``unit_of_row`` matters only under DP)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.proximal.add_gradient(self.params)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"grad_norm": grad_norm.item()}

    def noise_only_step(self) -> None:
        """An empty mini-batch releases nothing without DP: no step."""

    def close(self) -> None:
        """Nothing is attached to the model."""


def start_update(model: torch.nn.Module, params: list[torch.nn.Parameter], num_units: int, cfg: EngineConfig, *,
                 rows_per_unit: int, anchor: Sequence[np.ndarray | torch.Tensor] | None, proximal_mu: float,
                 noise_multiplier: float | None, seed: int) -> tuple[PlainUpdate | PrivateUpdate, Iterator[list[int]]]:
    """The update of one fit of ``params`` (trainable weights of ``model``) over ``num_units``
    privacy units, and the endless stream of unit batches it draws from (Poisson under DP): a
    fresh AdamW at ``actor.lr``, FedProx's term anchored at ``anchor`` (default: the current
    weights), DP-SGD when ``privacy.enabled`` (``noise_multiplier`` overrides the config's). The
    caller closes the update. Shared by every local objective (PPO, Bradley-Terry)."""
    sample_rate(cfg.data.train_batch_size, num_units)  # batch must fit the units
    num_mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    proximal = Proximal.at(params, params if anchor is None else anchor, proximal_mu)
    optimizer = torch.optim.AdamW(params, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay)
    update: PlainUpdate | PrivateUpdate
    if cfg.privacy.enabled:
        model.train()  # Opacus validates the module in training mode
        update = make_private(
            model, optimizer, num_units, cfg.privacy,
            batch_size=cfg.data.train_batch_size, num_mini_batches=num_mini_batches,
            rows_per_unit=rows_per_unit, ppo_epochs=cfg.actor.ppo_epochs,
            noise_multiplier=cfg.privacy.noise_multiplier if noise_multiplier is None else noise_multiplier,
            proximal=proximal, seed=seed if cfg.privacy.deterministic else None,
        )
        batches = _forever(update.sampler)
    else:
        update = PlainUpdate(optimizer, params, proximal, cfg.actor.grad_clip, num_mini_batches,
                             np.random.default_rng(seed))
        batches = _forever(torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(num_units, device="cpu")),
            batch_size=cfg.data.train_batch_size, shuffle=True, drop_last=True,
            generator=torch.Generator().manual_seed(seed)))
    return update, (batch[0].tolist() for batch in batches)


def _forever(loader):
    """Batches from ``loader`` pass after pass, each pass drawn afresh (a new shuffle, new Poisson
    draws). ``itertools.cycle`` would replay the first pass's batches."""
    while True:
        yield from loader
