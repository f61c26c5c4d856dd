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

A sample is one privacy unit: ``rows_per_unit`` adjacent rows of the loss.

* **Per row** (``rows_per_unit=1``: units of any size, pooled afterwards by
  ``privacy.pool_rows``): each layer's Opacus grad sampler (``GradSampleHooks.GRAD_SAMPLERS``,
  or functorch for ``grad_sample_mode="functorch"`` and for layer types without one), fed the
  activations and the backprops scaled as for ``loss_reduction="mean"``: the values Opacus's
  hooks give, bit for bit, on a forward that runs every layer on all rows
  (``tests/privacy/test_privacy.py`` checks it).
* **Per unit** (``rows_per_unit=n``: a prompt and its n responses, the PPO update's unit): the
  sum over each unit's rows of their per-row gradients, computed without them. A linear layer
  acts on each position alone and its weight gradient is a sum over positions, so for
  ``nn.Linear`` a unit's n rows of T positions are one row of n*T positions (a free view of the
  (B*n, T, d) activations and backprops as (B, n*T, d)): the output is n times smaller and no
  pooling is left to do. Its gradients come from ``linear_unit_gradients`` (Opacus's linear
  sampler as one batched matrix product in the faster orientation), or from Opacus's
  functorch on the same views. Any other layer type gets Opacus's per-row gradients, summed per
  unit. A prompt pass of B rows (``forward.response_logits``) has one row per unit and adds in
  whole. The loss's gradient enters scaled by the number of units (``loss_reduction="mean"``
  over units). The result equals the mean over each unit's rows of the per-row gradients (what
  pooling per prompt took) up to float rounding (the same products, summed in another order),
  not bit for bit.

That is safe for DP: Opacus's ``DPOptimizer`` still clips each unit's gradient to
``max_grad_norm`` before summing and noising, and each unit's gradient is still computed from that
unit's rows alone (every sum stays inside the unit), so one unit's influence on the noised sum is
at most ``max_grad_norm`` whatever its rounding: the sensitivity is unchanged.
(``tests/privacy/test_privacy.py`` checks each unit's gradient against the unit computed alone and against
its pooled per-row gradients.)
Clipping, noise and the optimizer step stay Opacus's ``DPOptimizer``.
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

    @property
    def rows(self) -> int:
        return self.activations[-1].shape[0]


def linear_unit_gradients(layer: torch.nn.Linear, activations: list[torch.Tensor],
                          backprops: torch.Tensor) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Opacus's ``compute_linear_grad_sample`` for activations (units, positions, in) and backprops
    (units, positions, out): the same sums over positions, as one batched matrix product
    oriented so that each unit's block is (min(in, out), max(in, out)). With a LoRA rank r far
    below the width d, MKL's bmm computes an r x d block several times faster than a d x r one,
    which is the block Opacus's einsum asks for in every ``lora_B`` (3.4x less time over the
    samplers of ``benchmarks/dp_overhead.py``'s shapes)."""
    inputs = activations[0].to(backprops.dtype)
    gradients = {}
    if layer.weight.requires_grad:
        gradients[layer.weight] = (torch.bmm(inputs.transpose(1, 2), backprops).transpose(1, 2)
                                   if layer.out_features > layer.in_features
                                   else torch.bmm(backprops.transpose(1, 2), inputs))
    if layer.bias is not None and layer.bias.requires_grad:
        gradients[layer.bias] = backprops.sum(1)
    return gradients


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
    ``recording()``: after ``backward(loss)`` each weight has ``grad_sample`` (units, *shape),
    one gradient per unit of ``rows_per_unit`` adjacent rows of the loss, where ``loss`` is the
    mean over the batch's rows (Opacus's ``loss_reduction="mean"``, over units: each unit's
    gradient is that of its rows' mean loss).

    Outside ``recording()`` the model carries no hook at all. Inside it, only forwards that build
    a graph in training mode are recorded (as Opacus's hooks do): a no-grad pass records nothing.
    ``close()`` removes what functorch attached to the layers.
    """

    def __init__(self, model: torch.nn.Module, *, functorch: bool = False, rows_per_unit: int = 1) -> None:
        self.layers = list(sampled_layers(model))
        self.rows_per_unit = rows_per_unit
        self.functorch = functorch
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
        pass and a response pass, ``forward.response_logits``); a narrower pass has one row per
        group of adjacent rows of the loss (per unit: every pass has the same rows per unit)."""
        recorded, self._recorded = self._recorded, []
        if not recorded:
            raise RuntimeError("PerSampleGradients.backward: no training forward pass was recorded; run the "
                               "forward pass inside recording(), with gradients enabled and the model in train mode")
        widths = sorted({record.rows for record in recorded})
        rows = widths[-1]
        units = rows // self.rows_per_unit
        if self.rows_per_unit == 1:
            fits = all(rows % width == 0 for width in widths)
        else:
            fits = rows % self.rows_per_unit == 0 and all(width % units == 0 for width in widths)
        if not fits:
            raise RuntimeError(f"PerSampleGradients.backward: recorded passes of {widths} rows do not split the loss's "
                               f"{rows} rows into units of {self.rows_per_unit} adjacent rows")
        # loss_reduction="mean" over units: per unit the loss's gradient enters scaled by their number; per row
        # each backprop is scaled by the rows afterwards, as Opacus does it (bit for bit)
        root = torch.full_like(loss, 1.0 if self.rows_per_unit == 1 else units)
        backprops = list(torch.autograd.grad(loss, [record.output for record in recorded], grad_outputs=root))
        if self.rows_per_unit == 1:
            self._per_row(recorded, backprops, rows)
        else:
            self._per_unit(recorded, backprops, units)

    def _per_row(self, recorded: list[_RecordedForward], backprops: list[torch.Tensor], rows: int) -> None:
        """Opacus's per-row gradients. A pass with ``rows / k`` rows has one row per k adjacent
        rows of the loss, and each of them gets 1/k of its gradient, so the sum over each group
        of k rows, what pooling per prompt takes, is exact."""
        order = sorted(range(len(recorded)), key=lambda i: recorded[i].rows, reverse=True)
        assigned: set[torch.nn.Parameter] = set()
        for index in order:  # full-width passes first: the narrower ones add into their rows in place
            record, backprop, backprops[index] = recorded[index], backprops[index], None  # freed once used
            share = rows // record.rows
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

    def _per_unit(self, recorded: list[_RecordedForward], backprops: list[torch.Tensor], units: int) -> None:
        """Each unit's gradient: the sum over its rows in every pass (of the loss scaled by ``units``)."""
        assigned: set[torch.nn.Parameter] = set()
        for index, record in enumerate(recorded):
            backprop, backprops[index] = backprops[index], None  # freed once used
            for param, sample in self._unit_sums(record, backprop, units).items():
                if param in assigned:
                    param.grad_sample.add_(sample)
                else:
                    # linear_unit_gradients may give transposed blocks; Opacus flattens each unit's gradient
                    param.grad_sample = sample.contiguous()
                    assigned.add(param)

    def _unit_sums(self, record: _RecordedForward, backprop: torch.Tensor, units: int) -> dict:
        """One pass's gradients of one layer, each unit's summed over its rows: (units, *shape) per weight."""
        layer = record.layer
        if type(layer) is torch.nn.Linear:  # position-wise: a unit's k rows of T positions are one row of k * T

            def merged(t: torch.Tensor) -> torch.Tensor:  # (units * k, ..., d) -> (units, k * ..., d), a view
                return t.reshape(units, -1, t.shape[-1])

            sampler = self._samplers[layer] if self.functorch else linear_unit_gradients
            return sampler(layer, [merged(a) for a in record.activations], merged(backprop))
        return {param: sample.view(units, -1, *sample.shape[1:]).sum(1)
                for param, sample in self._samplers[layer](layer, record.activations, backprop).items()}

    def close(self) -> None:
        """Detach what functorch attached to the layers (nothing in the default mode)."""
        for layer in self.layers:
            if hasattr(layer, "ft_compute_sample_grad"):
                del layer.ft_compute_sample_grad
