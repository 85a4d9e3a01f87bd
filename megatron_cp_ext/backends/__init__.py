"""Local varlen attention backends behind one contract (design §2).

``get_backend(device, name)`` picks: on CPU the exact ``reference``; on CUDA flash-attn when
installed, else PyTorch's built-in varlen flash (``flash``), with ``reference`` available
for debugging. The choice is made once per plan, never inside forward/backward.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..validation import CPArgumentError, as_choice
from . import reference

__all__ = ["BACKENDS", "get_backend"]

BACKENDS = ("auto", "reference", "flash")


def get_backend(device: torch.device, name: str = "auto") -> ModuleType:
    """The module implementing ``attn_fwd``/``attn_bwd`` for ``device``."""
    as_choice(name, "backend", BACKENDS)
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return reference
    if device.type != "cuda":
        raise CPArgumentError(f"backend 'flash' needs CUDA tensors, got device {device}; use 'auto' or 'reference'")
    from . import flash

    return flash
