"""What the FlashAttention-4 candidate hands ``flash_attn.cute``, computed without it.

Plain torch and host values only, so CI checks the translation on CPU
(``tests/L0/test_fa4_args.py``) against the reference contract; :mod:`.fa4` calls the kernels
with these values.

FA4's conventions (``flash_attn.cute.interface``, 4.0.0b36):

- A window side is an int or ``None`` (unbounded); a negative int is *not* read as unbounded
  unless both sides are negative, so the contract's ``-1`` must become ``None``.
- ``causal`` sets the right side to 0; a mask of ``(None, 0)`` is run as causal, any other
  finite side as a local window, ``(None, None)`` as no mask.
- Per varlen entry with ``sq`` queries and ``sk`` keys, query ``i`` sees keys from
  ``i + sk - sq - left`` to ``i + sk - sq + right``: bottom-right aligned, as the contract.
- A row that sees no key gets output 0 and lse ``-inf``; lse is fp32 ``(H, total_q)``.
- Kernels are JIT-compiled per configuration: dtype, head dims, query heads per KV head,
  causal or local, which window sides are set, forward or backward. Lengths and window sizes
  are runtime values, so a training run compiles a handful, not one per micro-batch.
- The Hopper (SM90) backward with GQA needs ``d == dv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import as_contract_lse

__all__ = ["Mask", "mask", "supports", "compile_config", "contract_lse", "kernel_lse", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
"""Largest q/k and v head dim of FA4's Hopper kernels."""


@dataclass(frozen=True, kw_only=True)
class Mask:
    """FA4's mask arguments for one call."""

    causal: bool
    left: int | None
    """``window_size_left``: None unbounded."""
    right: int | None
    """``window_size_right``: None unbounded."""


def mask(causal: bool, window: tuple[int, int]) -> Mask:
    """The contract's ``(causal, window)`` as FA4's arguments (module docstring): ``-1`` sides
    become None, causal passes ``right = 0``."""
    left, right = window
    right = 0 if causal else right
    return Mask(causal=causal, left=left if left >= 0 else None, right=right if right >= 0 else None)


def supports(dtype: torch.dtype, d: int, dv: int, gqa: int, hopper: bool = True) -> bool:
    """Whether a call is expressible (host values only): fp16/bf16, head dims multiples of 8 up
    to :data:`MAX_HEAD_DIM`; on Hopper, GQA/MQA only with ``d == dv`` (its backward)."""
    if dtype not in (torch.float16, torch.bfloat16) or d % 8 or dv % 8 or max(d, dv) > MAX_HEAD_DIM:
        return False
    return not (hopper and gqa > 1 and d != dv)


def compile_config(
    *, bwd: bool, dtype: torch.dtype, d: int, dv: int, gqa: int, causal: bool, window: tuple[int, int]
) -> tuple:
    """What an FA4 JIT compile of a call depends on (of the call's own values; the module
    docstring): calls with equal configs reuse one compiled kernel."""
    m = mask(causal, window)
    resolved_causal = m.left is None and m.right == 0
    local = not resolved_causal and (m.left is not None or m.right is not None)
    return (bwd, dtype, d, dv, gqa, resolved_causal, local, m.left is None, m.right is None)


def contract_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """FA4's ``(H, T)`` lse as the contract's ``[T, H]`` fp32: a row that saw no key at
    ``-inf`` (whatever infinity the kernel wrote); a NaN stays a NaN."""
    return as_contract_lse(lse_HT.t())


def kernel_lse(lse_TH: torch.Tensor) -> torch.Tensor:
    """The contract's ``[T, H]`` lse as the backward takes it: ``(H, T)`` fp32, contiguous (a
    ``-inf`` row stays ``-inf``: FA4's backward reads it as a row with no probabilities)."""
    return lse_TH.float().t().contiguous()
