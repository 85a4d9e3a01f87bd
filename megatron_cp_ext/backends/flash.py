"""Local varlen attention on GPU: flash-attn when installed, else PyTorch's built-in flash.

Both follow the contract of :mod:`.reference` (bottom-right aligned causal/windows per
entry, fp32 lse returned as ``[N, H]``). Multi-head-latent attention (``Dv != D``) is run by
zero-padding V to ``D`` — exact, since padded output columns are sliced away and carry zero
gradient. These paths need a CUDA device and are covered by ``tests/gpu``.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

# Max logits: a separate exact computation on the scores, run only when requested (flash kernels
# return the lse, which only bounds the max).
from .reference import max_logit  # noqa: F401

__all__ = ["HAS_FLASH_ATTN", "attn_fwd", "attn_bwd", "max_logit"]

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _pad_v(v: torch.Tensor, d: int) -> torch.Tensor:
    return v if v.shape[-1] == d else F.pad(v, (0, d - v.shape[-1]))


def _window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    return (window[0], 0) if causal else window


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    dv = v.shape[-1]
    vp = _pad_v(v, q.shape[-1])
    left, right = _window(causal, window)
    if HAS_FLASH_ATTN:
        from flash_attn.flash_attn_interface import flash_attn_varlen_func

        out, lse, _ = flash_attn_varlen_func(
            q, k, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=scale, causal=causal, window_size=(left, right), return_attn_probs=True,
        )  # fmt: skip
    else:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
    return out[..., :dv], lse.float().t()


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    d, dv = q.shape[-1], v.shape[-1]
    vp, outp, doutp = _pad_v(v, d), _pad_v(out, d), _pad_v(dout.to(q.dtype), d)
    lse_HN = lse.t().contiguous()
    left, right = _window(causal, window)
    if HAS_FLASH_ATTN:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        dq, dk, dvp = torch.empty_like(q), torch.empty_like(k), torch.empty_like(vp)
        _flash_attn_varlen_backward(
            doutp, q, k, vp, outp, lse_HN, dq, dk, dvp, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, 0.0, scale, causal, left, right, 0.0, None, False, None,
        )  # fmt: skip
    else:
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        dq, dk, dvp = torch.ops.aten._flash_attention_backward(
            doutp, q, k, vp, outp, lse_HN, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            0.0, causal, rng, torch.empty(0, device=q.device),
            scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
    return dq, dk, dvp[..., :dv]
