"""Candidate local kernel: FlashAttention-4 (``flash_attn.cute``, CuTe DSL kernels for Hopper
and Blackwell) under the contract of :mod:`.reference`.

``pip install "megatron_cp_ext[fa4]"`` brings ``flash-attn-4`` and its CUTLASS DSL runtime.
Varlen calls pass ``cu_seqlens`` as they are; the mask, the lse layouts and what a JIT compile
depends on are :mod:`.fa4_args`' (checked on CPU). Every mask of the contract is expressible
(bottom-right causal, windows on either side, none), GQA/MQA are native, ``Dv != D`` runs
where FA4 has it (not with GQA on Hopper: :func:`.fa4_args.supports`). Sinks never reach a
local kernel (they enter at the final merge). A call FA4 refuses at run time falls back to the
flash kernels (or the reference where they cannot express it), with one logged line per
refused configuration.

Kernels compile on the first call of each configuration (seconds each);
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` with ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` keeps
them on disk between runs. :func:`compile_counts` says how many configurations were met.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any

import torch

from . import fa4_args as fa

__all__ = ["available", "supports", "attn_fwd", "attn_bwd", "compile_counts", "MAX_HEAD_DIM"]

log = logging.getLogger("megatron_cp_ext.kernels")

MAX_HEAD_DIM = fa.MAX_HEAD_DIM
_SEEN: set[tuple] = set()
_REFUSED: set[tuple] = set()
_LOCK = threading.Lock()


def _interface() -> Any:
    """``flash_attn.cute.interface``, or None where it does not import (not installed, no
    CUTLASS DSL runtime, no CUDA driver)."""
    try:
        from flash_attn.cute import interface  # noqa: PLC0415 - optional: flash-attn-4
    except Exception:
        return None
    return interface


@functools.cache
def available() -> bool:
    """FA4 imports and a Hopper or Blackwell GPU (SM 9.x-11.x) is present."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        return False
    return _interface() is not None


@functools.cache
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def supports(dtype: torch.dtype, d: int, dv: int, gqa: int) -> bool:
    """Whether a call is expressible (host values only): :func:`.fa4_args.supports` for this
    device (Hopper's GQA backward rule applies unless the device is a Blackwell)."""
    return fa.supports(dtype, d, dv, gqa, hopper=not torch.cuda.is_available() or _hopper())


def compile_counts() -> dict:
    """Distinct kernel configurations met so far (each a JIT compile the first time), forward
    and backward, and those refused."""
    return {
        "fwd": sum(1 for c in _SEEN if not c[0]),
        "bwd": sum(1 for c in _SEEN if c[0]),
        "refused": len(_REFUSED),
    }


def _config(bwd: bool, q, k, v, causal, window, det: bool = False) -> tuple:
    cfg = fa.compile_config(bwd=bwd, dtype=q.dtype, d=q.shape[-1], dv=v.shape[-1], gqa=q.shape[1] // k.shape[1],
                            causal=causal, window=window)  # fmt: skip
    cfg = (*cfg, "deterministic") if det else cfg
    if cfg not in _SEEN:
        with _LOCK:
            _SEEN.add(cfg)
    return cfg


_REFUSALS = (AssertionError, NotImplementedError, ValueError, RuntimeError, TypeError)
"""What FA4 raises for a call it cannot run; ``TypeError``: an installed FA4 whose interface
takes other arguments than the pinned one (a release without windows, say) falls back too."""


def _refused(cfg: tuple, exc: BaseException):
    """Note a configuration FA4 refused (logged once) and return the fallback backend."""
    from . import flash, reference

    with _LOCK:
        first = cfg not in _REFUSED
        _REFUSED.add(cfg)
    if first:
        log.warning("fa4 candidate: call refused, falling back (%s): %s", cfg, str(exc).splitlines()[0][:300])
    _, dtype, d, dv = cfg[:4]
    return flash if flash.supports(False, (-1, -1), dtype, d, dv) else reference


@functools.cache
def _takes_deterministic(bwd_fn: Any) -> bool:
    """Whether this FA4's backward has a ``deterministic`` argument (later releases do; without
    it dQ is accumulated with atomics, in no fixed order)."""
    try:
        return "deterministic" in inspect.signature(bwd_fn).parameters
    except (TypeError, ValueError):
        return False


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    n, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    if n == 0 or k.shape[0] == 0:  # nothing to compute: the contract's empty rows
        return q.new_zeros(n, hq, dv), torch.full((n, hq), float("-inf"), device=q.device)
    cfg = _config(False, q, k, v, causal, window)
    m = fa.mask(causal, window)
    if cfg not in _REFUSED:
        try:
            out, lse, *_ = _interface()._flash_attn_fwd(
                _dense(q), _dense(k), _dense(v), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), softmax_scale=float(scale),
                causal=m.causal, window_size_left=m.left, window_size_right=m.right, return_lse=True,
            )  # fmt: skip
            return out, fa.contract_lse(lse)
        except _REFUSALS as exc:
            fallback = _refused(cfg, exc)
    else:
        fallback = _refused(cfg, RuntimeError("refused before"))
    return fallback.attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # torch.use_deterministic_algorithms: FA4's deterministic backward (its own kernel, so its own
    # configuration), or, where this FA4 has none, the fallback (FA2 honours the flag)
    det = torch.are_deterministic_algorithms_enabled()
    cfg = _config(True, q, k, v, causal, window, det)
    m = fa.mask(causal, window)
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)
    if cfg not in _REFUSED:
        try:
            bwd = _interface()._flash_attn_bwd
            if det and not _takes_deterministic(bwd):
                raise NotImplementedError("this flash_attn.cute backward has no deterministic mode")
            dq, dk, dv, *_ = bwd(
                _dense(q), _dense(k), _dense(v), _dense(out.to(q.dtype)), _dense(dout.to(q.dtype)),
                fa.kernel_lse(lse), softmax_scale=float(scale), causal=m.causal, window_size_left=m.left,
                window_size_right=m.right, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                **({"deterministic": True} if det else {}),
            )  # fmt: skip
            return dq, dk, dv
        except _REFUSALS as exc:
            fallback = _refused(cfg, exc)
    else:
        fallback = _refused(cfg, RuntimeError("refused before"))
    return fallback.attn_bwd(dout, q, k, v, out, lse, *args)
