"""Local varlen attention on GPU: flash-attn when installed, else PyTorch's built-in flash.

Both follow the contract of :mod:`.reference` (bottom-right aligned causal/windows per
entry, fp32 lse returned as ``[N, H]``). Multi-head-latent attention (``Dv != D``) is run by
zero-padding V to ``D`` — exact, since padded output columns are sliced away and carry zero
gradient. These paths need a CUDA device and are covered by ``tests/gpu``.

``attn_fwd``/``attn_bwd`` (``backend="flash"``) take flash-attn when it is installed; the
per-kernel functions (``fa_*``: flash-attn's varlen API, ``aten_*``: PyTorch's
``aten._flash_attention_forward``) are the separate candidates :mod:`.pick` chooses between.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

# Max logits: a separate exact computation on the scores, run only when requested (flash kernels
# return the lse, which only bounds the max).
from .reference import as_contract_lse, max_logit  # noqa: F401

__all__ = ["HAS_FLASH_ATTN", "attn_fwd", "attn_bwd", "max_logit", "supports"]
__all__ += ["fa_fwd", "fa_bwd", "aten_fwd", "aten_bwd"]


def _has_fa2() -> bool:
    """flash-attn (2.x) is installed: its interface module, not only the ``flash_attn``
    namespace that flash-attn-4 (``flash_attn.cute``) also creates."""
    try:
        return importlib.util.find_spec("flash_attn.flash_attn_interface") is not None
    except (ImportError, ValueError):
        return False


HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None and _has_fa2()
MAX_HEAD_DIM = 256
"""Largest q/k head dim the flash kernels take (V is padded to it)."""


def supports(causal: bool, window: tuple[int, int], dtype: torch.dtype, d: int, dv: int) -> bool:
    """Whether a call is expressible by the flash kernels (host values only): fp16/bf16, head
    dims up to :data:`MAX_HEAD_DIM` (``Dv <= D``, as V is padded to D); every mask."""
    return dtype in (torch.float16, torch.bfloat16) and dv <= d <= MAX_HEAD_DIM and d % 8 == 0


def _pad_v(v: torch.Tensor, d: int) -> torch.Tensor:
    return v if v.shape[-1] == d else F.pad(v, (0, d - v.shape[-1]))


def _kernel_args(q, k, causal: bool, window: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, ...]:
    """``(left, right, max_seqlen_q, max_seqlen_k)`` as the FlashAttention-2 kernels must be given them.

    FA2 reads a window against ``max_seqlen_k`` as if every entry had as many queries as
    keys: a right side ``>= max_seqlen_k`` is dropped as unbounded, and an open right side next
    to a finite left one (``(L, -1)``, not causal) becomes ``right = max_seqlen_k``. Bottom-right
    aligned, query ``i`` of an entry with ``sq`` queries and ``sk`` keys stops at key
    ``i + sk - sq + right``, so both cut or open keys wrongly for the first queries of an entry
    with more queries than keys (measured on an H100: a ``(0, -1)`` call of 50 queries over 13
    keys, a window's lower edge on a ring step). The kernel uses ``max_seqlen_k`` only to size
    its grid over keys and for these two rules, so an upper bound is handed instead: above
    ``right`` (no drop), and ``max_seqlen_q + max_seqlen_k`` under an open right side (a stop
    past every key).

    With ``max_seqlen_q == 1``, GQA and no mask, FA2 folds the query heads into the sequence
    dim assuming every entry holds exactly one query. Plans emit no empty entries, but the
    wrappers take any varlen call, so ``max_seqlen_q`` goes up to 2 there (the general varlen
    path, same results). ``tests/L0/test_flash_args.py`` emulates these rules."""
    left, right = (window[0], 0) if causal else window
    if right > 0:
        max_seqlen_k = max(max_seqlen_k, right + 1)
    elif left >= 0 and right < 0:
        max_seqlen_k = max_seqlen_k + max_seqlen_q
    if max_seqlen_q == 1 and q.shape[1] > k.shape[1] and left < 0 and right < 0:
        max_seqlen_q = 2
    return left, right, max_seqlen_q, max_seqlen_k


def _lse_nh(lse_HN: torch.Tensor) -> torch.Tensor:
    """The kernel's ``[H, N]`` lse as the contract's ``[N, H]`` fp32, rows that see no key at -inf.

    FlashAttention-2 (flash-attn's and PyTorch's copy) writes ``+inf`` for a row whose keys are
    all masked out (a window or a short key entry can leave rows of a call empty); the online
    merge reads that as infinite weight and would wipe out what the row gathered from other
    calls. One elementwise pass into a row-major buffer, no host sync: the merges' CUDA kernel
    takes contiguous tensors only (a transposed view would send every merge to the fallback)."""
    return as_contract_lse(lse_HN.t())


def fa_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    from flash_attn.flash_attn_interface import flash_attn_varlen_func

    dv, args = v.shape[-1], _kernel_args(q, k, causal, window, max_seqlen_q, max_seqlen_k)
    left, right, max_seqlen_q, max_seqlen_k = args
    out, lse, _ = flash_attn_varlen_func(
        q, k, _pad_v(v, q.shape[-1]), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=scale, causal=causal, window_size=(left, right), return_attn_probs=True,
    )  # fmt: skip
    return out[..., :dv], _lse_nh(lse)


def aten_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    dv, args = v.shape[-1], _kernel_args(q, k, causal, window, max_seqlen_q, max_seqlen_k)
    left, right, max_seqlen_q, max_seqlen_k = args
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, _pad_v(v, q.shape[-1]), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return out[..., :dv], _lse_nh(lse)


def _bwd_inputs(dout, q, v, out, lse):
    d = q.shape[-1]
    return _pad_v(v, d), _pad_v(out, d), _pad_v(dout.to(q.dtype), d), lse.t().contiguous()


def fa_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    vp, outp, doutp, lse_HN = _bwd_inputs(dout, q, v, out, lse)
    left, right, max_seqlen_q, max_seqlen_k = _kernel_args(q, k, causal, window, max_seqlen_q, max_seqlen_k)
    dq, dk, dvp = torch.empty_like(q), torch.empty_like(k), torch.empty_like(vp)
    _flash_attn_varlen_backward(
        doutp, q, k, vp, outp, lse_HN, dq, dk, dvp, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, 0.0, scale, causal, left, right, 0.0, None,
        torch.are_deterministic_algorithms_enabled(), None,  # deterministic dQ accumulation when asked
    )  # fmt: skip
    return dq, dk, dvp[..., : v.shape[-1]]


def aten_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    vp, outp, doutp, lse_HN = _bwd_inputs(dout, q, v, out, lse)
    left, right, max_seqlen_q, max_seqlen_k = _kernel_args(q, k, causal, window, max_seqlen_q, max_seqlen_k)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dvp = torch.ops.aten._flash_attention_backward(
        doutp, q, k, vp, outp, lse_HN, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        0.0, causal, rng, torch.empty(0, device=q.device),
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return dq, dk, dvp[..., : v.shape[-1]]


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    fn = fa_fwd if HAS_FLASH_ATTN else aten_fwd
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    fn = fa_bwd if HAS_FLASH_ATTN else aten_bwd
    return fn(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)
