"""Attention computes in the dtype of ``q, k, v``, whatever autocast region it is called in.

Under ``torch.autocast`` the matmuls and reductions of the exact kernels, the max logits and
the merges would run in 16 bit while backward (run outside the region) recomputes in full
precision against a 16-bit log-sum-exp: forward and backward would not match, the lse would
leave its fp32 contract and ``return_max_logit`` would not be exact. Every entry of the
package's forward and backward runs with autocast off instead; Megatron's layers hand
attention q, k, v already in the training dtype, so nothing changes for them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["autocast_off"]

F = TypeVar("F", bound=Callable)

_AVAILABLE = getattr(torch.amp, "is_autocast_available", lambda device: device in ("cpu", "cuda"))


def autocast_off(fn: F) -> F:
    """``fn`` run with autocast off on the device of its first tensor argument, where it is on
    (one check per call otherwise)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or not _AVAILABLE(device) or not torch.is_autocast_enabled(device):  # meta: none
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
