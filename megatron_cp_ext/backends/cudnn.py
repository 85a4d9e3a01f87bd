"""Candidate local kernel: cuDNN's varlen attention through PyTorch
(``aten._cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q/k``), under the contract of
:mod:`.reference`.

What PyTorch's op can express decides what this candidate accepts (:func:`supports`): the op
has no window arguments and its causal mask is not documented as bottom-right aligned per
entry, so only calls with no mask at all qualify — in a plan, the fully visible KV blocks,
which carry most of the FLOPs at long context. GQA/MQA are run by repeating KV heads (the
op's schema says nothing of head counts; the suite measures whether it pays), ``Dv != D`` by
zero-padding V as in :mod:`.flash`. The op returns its log-sum-exp in its own layout; it is
turned into the contract's ``[N, H]`` fp32 and back for the backward.

This is a candidate of the per-call pick (:mod:`.pick`): ``backend="auto"`` runs it only for
calls the measured table (``kernel_table.json``) names it for on this device class, and only
where :func:`supports` holds. ``benchmarks/gpu_suite.py`` times it against the flash kernels
per call shape and writes that table entry; ``tests/gpu/test_local_kernels.py`` checks it
call by call against the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["available", "supports", "attn_fwd", "attn_bwd"]


BACKWARD_REACHABLE = False
"""Whether PyTorch's cuDNN backward can be called on a varlen batch from Python. Not on torch
2.11 (H100, measured): ``_cudnn_attention_backward`` takes ``attn_bias`` as a required
``Tensor``; an empty one is taken for a bias and fails (``Dimension out of range``), and only
C++ autograd can pass the undefined tensor that means "no bias" (``benchmarks/gpu_probe_cudnn.py``).
The candidate stays off until that changes."""


def available() -> bool:
    """cuDNN is present, PyTorch exposes its varlen attention op, and its backward is reachable."""
    return (
        BACKWARD_REACHABLE
        and torch.cuda.is_available()
        and torch.backends.cudnn.is_available()
        and hasattr(torch.ops.aten, "_cudnn_attention_forward")
    )


def supports(causal: bool, window: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether a call with this mask and dtype is exactly expressible here (host values only)."""
    return not causal and tuple(window) == (-1, -1) and dtype in (torch.float16, torch.bfloat16)


def _heads(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _lse_nh(lse: torch.Tensor, n: int, h: int) -> torch.Tensor:
    """The op's log-sum-exp (``[N, H]``, ``[H, N]`` or either with a trailing 1) -> ``[N, H]`` fp32."""
    lse = lse.reshape(lse.shape[:2]) if lse.dim() == 3 else lse
    return (lse if tuple(lse.shape) == (n, h) else lse.t()).float()


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    assert supports(causal, window, q.dtype), "cudnn candidate: only unmasked fp16/bf16 calls"
    dv = v.shape[-1]
    kx, vx = _heads(q, k), _heads(q, F.pad(v, (0, q.shape[-1] - dv)) if dv != q.shape[-1] else v)
    res = torch.ops.aten._cudnn_attention_forward(
        q, kx, vx, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, True, 0.0, False, False,
        scale=scale,
    )  # fmt: skip
    out, lse = res[0], res[1]
    return out[..., :dv], _lse_nh(lse, q.shape[0], q.shape[1])


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    assert supports(causal, window, q.dtype), "cudnn candidate: only unmasked fp16/bf16 calls"
    d, dv, g = q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1]
    pad = (lambda x: F.pad(x, (0, d - dv))) if dv != d else (lambda x: x)
    kx, vx = _heads(q, k), _heads(q, pad(v))
    lse_op = lse.t().contiguous().unsqueeze(-1)  # [H, N, 1]: the layout the op's varlen path keeps
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dvx = torch.ops.aten._cudnn_attention_backward(
        pad(dout.to(q.dtype)).contiguous(), q, kx, vx, pad(out).contiguous(), lse_op, seed, seed,
        torch.empty(0, device=q.device, dtype=q.dtype), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        0.0, False, scale=scale,
    )  # fmt: skip
    if g > 1:  # the repeated KV heads' gradients add up on their KV head
        dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
        dvx = dvx.unflatten(1, (k.shape[1], g)).sum(2)
    return dq, dk, dvx[..., :dv]
