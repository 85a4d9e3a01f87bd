"""Local varlen attention backends behind one contract (design §2).

``get_backend(device, name)``: ``reference`` (exact, any device) and ``flash`` (flash-attn when
installed, else PyTorch's built-in varlen flash) as asked; ``auto`` is the exact ``reference``
on CPU and, on CUDA, a :class:`.pick.Picker` that runs each local call on the kernel the
measured table names for its shape and this device class (:mod:`.pick`; with no measured
entry, the same kernels as ``flash``). The choice is a pure function of host values, made
the same way on every rank, never by measuring inside forward/backward.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from ..runtime.validation import CPArgumentError, as_choice
from . import reference

__all__ = ["BACKENDS", "get_backend", "backend_name"]

BACKENDS = ("auto", "reference", "flash")


def get_backend(device: torch.device, name: str = "auto"):
    """The object implementing ``attn_fwd``/``attn_bwd``/``max_logit`` for ``device``."""
    as_choice(name, "backend", BACKENDS)
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return reference
    if device.type != "cuda":
        raise CPArgumentError(f"backend 'flash' needs CUDA tensors, got device {device}; use 'auto' or 'reference'")
    if name == "auto":
        return _picker(device)
    from . import flash

    return flash


_PICKERS: dict[tuple, object] = {}
"""One :class:`.pick.Picker` per (device, ``MCX_KERNEL``, ``MCX_KERNEL_TABLE``): the table is
read and availability probed once per process, not per call."""


def _picker(device: torch.device):
    from .pick import Picker

    key = (str(device), os.environ.get("MCX_KERNEL"), os.environ.get("MCX_KERNEL_TABLE"))
    p = _PICKERS.get(key)
    if p is None:
        p = _PICKERS[key] = Picker(device)
    return p


def backend_name(backend: ModuleType | object) -> str:
    """``reference`` or ``flash``: what a resolved backend counts as for argument checks and
    rank agreement (a :class:`.pick.Picker` runs the GPU kernels, so ``flash``)."""
    name = getattr(backend, "name", None)
    return name if isinstance(name, str) else backend.__name__.rsplit(".", 1)[-1]
