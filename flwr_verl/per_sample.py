"""Opacus's per-sample gradients, computed only for the forward passes of the DP update.

Opacus's ``GradSampleHooks`` (what ``PrivacyEngine.make_private`` attaches) put a forward and a
full backward hook on every trainable layer for as long as the model is private. With LoRA on
every linear layer that is dozens of hooks that every forward of the policy goes through,
generation and the no-grad log-prob passes included, and every backward then runs each layer's
inputs and outputs through identity autograd nodes. Here, instead, the trainable layers are
hooked only inside ``PerSampleGradients.recording()``, which the update wraps around its own
forward passes. A recorded forward keeps each layer's input (what Opacus calls its activations)
and where its output enters the autograd graph; ``backward(loss)`` asks autograd for the loss's
gradient at those outputs alone (Opacus's backprops), which also skips the batch gradient of
every trainable weight: DP-SGD replaces it with the clipped, noised sum of the per-sample
gradients anyway.

The per-sample gradients themselves are Opacus's: each layer's grad sampler
(``GradSampleHooks.GRAD_SAMPLERS``, or functorch for ``grad_sample_mode="functorch"`` and for
layer types without one), fed the same activations and backprops scaled as for
``loss_reduction="mean"``. They are the values Opacus's hooks give, bit for bit
(``tests/test_privacy.py`` checks it). Clipping, noise and the optimizer step stay Opacus's
``DPOptimizer``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from opacus.utils.module_utils import has_trainable_params


@dataclass
class _RecordedForward:
    """One trainable layer's part of a recorded forward pass."""

    layer: torch.nn.Module
    activations: list[torch.Tensor]  # the layer's inputs, detached; batch first
    output: torch.autograd.graph.GradientEdge  # where the layer's output enters the graph (not the tensor:
    # holding it would keep every layer's output alive until the backward)


def sampled_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The layers that get per-sample gradients, chosen as Opacus chooses them: every module that
    owns a trainable parameter; one without a registered grad sampler is handled whole by
    functorch, its submodules included."""
    if has_trainable_params(model):
        yield model
        if type(model) not in GradSampleHooks.GRAD_SAMPLERS:
            return
    for child in model.children():
        yield from sampled_layers(child)


class PerSampleGradients:
    """Per-sample gradients of ``model``'s trainable weights for the forward passes run inside
    ``recording()``: after ``backward(loss)`` each weight has ``grad_sample`` (batch, *shape),
    where ``loss`` is the mean over the batch's rows (Opacus's ``loss_reduction="mean"``).

    Outside ``recording()`` the model carries no hook at all. Inside it, only forwards that build
    a graph in training mode are recorded (as Opacus's hooks do): a no-grad pass records nothing.
    ``close()`` removes what functorch attached to the layers.
    """

    def __init__(self, model: torch.nn.Module, *, functorch: bool = False) -> None:
        self.layers = list(sampled_layers(model))
        self._samplers = {layer: self._sampler(layer, functorch) for layer in self.layers}
        self._recorded: list[_RecordedForward] = []

    @staticmethod
    def _sampler(layer: torch.nn.Module, functorch: bool):
        """Opacus's choice of per-sample gradient function for ``layer``."""
        registered = GradSampleHooks.GRAD_SAMPLERS.get(type(layer))
        if registered is not None and not functorch:
            return registered
        prepare_layer(layer, batch_first=True)  # attaches layer.ft_compute_sample_grad
        return ft_compute_per_sample_gradient

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the training forward passes run inside the block; nothing is hooked outside it."""
        handles = [layer.register_forward_hook(self._record) for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._recorded.clear()

    def _record(self, layer: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if layer.training and torch.is_grad_enabled():
            self._recorded.append(_RecordedForward(layer, [t.detach() for t in inputs],
                                                   torch.autograd.graph.get_gradient_edge(output)))

    def backward(self, loss: torch.Tensor) -> None:
        """Set ``grad_sample`` on every trainable weight from the forward passes recorded since the
        last backward and their mean-over-rows ``loss``; the weights' batch gradients (``.grad``)
        are not computed.

        The loss's rows are those of the widest pass. A layer may run more than once (a prompt
        pass and a response pass, ``forward.response_logits``): a pass with ``rows / k`` rows has
        one row per k adjacent rows of the loss, and each of them gets 1/k of its gradient, so
        the sum over each group of k rows, what pooling per prompt takes, is exact."""
        recorded, self._recorded = self._recorded, []
        if not recorded:
            raise RuntimeError("PerSampleGradients.backward: no training forward pass was recorded; run the "
                               "forward pass inside recording(), with gradients enabled and the model in train mode")
        rows = max(record.activations[-1].shape[0] for record in recorded)
        if any(rows % record.activations[-1].shape[0] for record in recorded):
            raise RuntimeError("PerSampleGradients.backward: a recorded pass's rows do not divide the loss's "
                               f"{rows} rows: {sorted({record.activations[-1].shape[0] for record in recorded})}")
        backprops = list(torch.autograd.grad(loss, [record.output for record in recorded]))
        order = sorted(range(len(recorded)), key=lambda i: recorded[i].activations[-1].shape[0], reverse=True)
        assigned: set[torch.nn.Parameter] = set()
        for index in order:  # full-width passes first: the narrower ones add into their rows in place
            record, backprop, backprops[index] = recorded[index], backprops[index], None  # freed once used
            share = rows // record.activations[-1].shape[0]
            sampler = self._samplers[record.layer]
            # loss_reduction="mean": a row's gradient is rows x its share of the loss's gradient
            for param, sample in sampler(record.layer, record.activations, backprop * rows).items():
                if param not in assigned:
                    param.grad_sample = sample if share == 1 else torch.zeros(
                        (rows, *sample.shape[1:]), dtype=sample.dtype, device=sample.device)
                    assigned.add(param)
                    if share == 1:
                        continue
                grouped = param.grad_sample.view(-1, share, *sample.shape[1:])  # (rows / share, share, ...)
                grouped.add_(sample.unsqueeze(1), alpha=1.0 / share)

    def close(self) -> None:
        """Detach what functorch attached to the layers (nothing in the default mode)."""
        for layer in self.layers:
            if hasattr(layer, "ft_compute_sample_grad"):
                del layer.ft_compute_sample_grad
