"""Local varlen attention backends behind one contract (design §2).

``get_backend(device, name)`` picks: on CPU the exact ``reference``; on CUDA flash-attn when
installed, else PyTorch's built-in varlen flash (``flash``), with ``reference`` available
for debugging. The choice is made once per plan, never inside forward/backward.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference

__all__ = ["BACKENDS", "get_backend"]

BACKENDS = ("auto", "reference", "flash")


def get_backend(device: torch.device, name: str = "auto") -> ModuleType:
    """The module implementing ``attn_fwd``/``attn_bwd`` for ``device``."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return reference
    if device.type != "cuda":
        raise ValueError(f"backend 'flash' needs CUDA tensors, got device {device}")
    from . import flash

    return flash
