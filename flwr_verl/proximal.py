"""FedProx on the client: the proximal term mu/2 * ||theta - theta_global||^2.

It anchors the local adapter weights to the global ones received from the server. It does not
depend on data, so under DP its gradient is added after Opacus has clipped and noised the
per-sample gradients: it is neither clipped nor charged to the privacy budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def proximal_term(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """mu/2 * sum_i ||params_i - anchor_i||^2 (differentiable in ``params``)."""
    total = sum(((p - a.to(p.dtype)) ** 2).sum() for p, a in zip(params, anchor, strict=True))
    return 0.5 * mu * total


@torch.no_grad()
def add_proximal_gradient(params: Sequence[torch.nn.Parameter], anchor: Sequence[torch.Tensor], mu: float) -> None:
    """Add the term's gradient, mu * (theta - theta_global), to each ``param.grad``."""
    if mu == 0:
        return
    for param, reference in zip(params, anchor, strict=True):
        step = mu * (param - reference.to(param.dtype))
        param.grad = step if param.grad is None else param.grad + step
