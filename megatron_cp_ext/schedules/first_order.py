"""First derivatives only: a backward run under ``create_graph=True`` refuses a second one.

The schedules' backward (ring steps, all-to-alls, fused kernels, fp32 accumulators) is not
itself differentiable. Left to autograd, a backward run with ``create_graph=True`` (a gradient
penalty, Hessian-vector products) would record part of it and return gradients whose own
graph is missing the attention's share: a second derivative would come out silently wrong, or
a sum that mixes them with other terms would drop it. ``torch.autograd.function.
once_differentiable`` catches this only when the incoming gradient requires grad; here it is
caught whenever an input does (``ctx.needs_input_grad``), since the gradients depend on q, k
and v themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["SECOND_DERIVATIVE", "first_order"]

SECOND_DERIVATIVE = (
    "cp_attention has no second derivative: its gradients were computed with create_graph=True "
    "(e.g. for a gradient penalty) and are now being differentiated. Differentiate a model "
    "without context-parallel attention, or leave these gradients out of the second backward"
)


class _Refuse(torch.autograd.Function):
    """Passes first derivatives through; differentiating them raises."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *grads: torch.Tensor):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_DERIVATIVE)


def first_order(backward: Callable) -> Callable:
    """Decorate an autograd Function's ``backward``: it runs without recording, and under
    ``create_graph=True`` the gradients it returns carry a node that raises on a second
    derivative (instead of a partial graph)."""

    @functools.wraps(backward)
    def wrapped(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not (torch.is_grad_enabled() and any(ctx.needs_input_grad)):
            return grads
        at = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        if not at:
            return grads
        anchor = torch.zeros((), requires_grad=True)  # gives the outputs a grad_fn: _Refuse
        marked = _Refuse.apply(anchor, *(grads[i] for i in at))
        out = list(grads)
        for i, g in zip(at, marked, strict=True):
            out[i] = g
        return tuple(out)

    return wrapped
