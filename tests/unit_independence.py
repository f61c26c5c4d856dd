"""The DP independence check of the fixed-data stages (``supervised.UnitTrainer``): shared by
their tests."""

from __future__ import annotations

import torch

from flwr_verl.config import PrivacyConfig
from flwr_verl.privacy.dpsgd import make_private, pool_rows


def assert_units_are_independent(trainer, units: list) -> None:
    """``trainer.unit_loss`` on all ``units`` in one mini-batch: each unit's pooled Opacus
    gradient is the gradient of that unit's loss computed alone (no coupling between privacy
    units, so per-unit clipping bounds each unit's influence)."""
    model, params = trainer.model, trainer.policy_params
    expected = [[g.detach().clone() for g in torch.autograd.grad(trainer.unit_loss([unit]).loss, params)]
                for unit in units]
    model.train()
    private = make_private(model, torch.optim.SGD(params, lr=0.0), 8, PrivacyConfig(), batch_size=4,
                           num_mini_batches=1, rows_per_unit=1, noise_multiplier=1.0, seed=0)
    try:
        with private.recording():
            step = trainer.unit_loss(units)
            private.backward(step.loss)
        pool_rows(private.optimizer.params, step.unit_of_row, len(units))
        for index, grads in enumerate(expected):
            for param, grad in zip(params, grads):
                torch.testing.assert_close(param.grad_sample[index], grad, atol=1e-6, rtol=1e-4)
    finally:
        private.optimizer.zero_grad()
        private.close()
        model.eval()
