"""FedProx on the client: the proximal term mu/2 * ||theta - theta_global||^2 (Li et al., 2020).

It anchors the local adapter weights to the global ones received from the server. It does not
depend on data, so under DP its gradient is added after Opacus has clipped and noised the
per-sample gradients: it is neither clipped nor charged to the privacy budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Proximal:
    """FedProx's term for one fit: the anchor (global weights, on each parameter's device and
    in its dtype) and mu. ``mu = 0`` is FedAvg: the term and its gradient are zero."""

    anchor: tuple[torch.Tensor, ...]
    mu: float

    @classmethod
    def at(cls, params: Sequence[torch.Tensor], anchor: Sequence[np.ndarray | torch.Tensor], mu: float) -> Proximal:
        """Anchor ``params`` at ``anchor`` (arrays as received, or tensors), copied to each
        parameter's device and dtype once, so that every later step is device-local."""
        if len(anchor) != len(params):
            raise ValueError(f"anchor has {len(anchor)} arrays for {len(params)} parameters")
        return cls(tuple(torch.as_tensor(a, device=p.device).to(p.dtype).clone().detach()
                         for p, a in zip(params, anchor)), float(mu))

    @classmethod
    def none(cls) -> Proximal:
        return cls((), 0.0)

    def term(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """mu/2 * sum_i ||params_i - anchor_i||^2 (differentiable in ``params``)."""
        if self.mu == 0:
            return torch.zeros((), device=params[0].device if params else "cpu")
        total = sum(((p - a) ** 2).sum() for p, a in zip(params, self.anchor, strict=True))
        return 0.5 * self.mu * total

    @torch.no_grad()
    def add_gradient(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Add the term's gradient, mu * (theta - theta_global), to each ``param.grad``."""
        if self.mu == 0:
            return
        for param, reference in zip(params, self.anchor, strict=True):
            step = self.mu * (param - reference)
            param.grad = step if param.grad is None else param.grad + step
