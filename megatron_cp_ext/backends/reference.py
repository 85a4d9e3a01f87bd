"""Exact PyTorch varlen attention with flash-attn varlen semantics (CPU, tests, fallback).

Implements the local kernel contract of design §2 exactly: per batch entry, causal and
windows are bottom-right aligned. It refuses calls a flash kernel could not express, so a
plan verified on the CPU is a plan the GPU can run. Forward returns ``(out, lse_NH)`` with
an fp32 log-sum-exp; backward recomputes probabilities from the saved (final) lse, the same
way a flash backward does — there is no autograd through this file.

Shapes: ``N`` query rows, ``M`` key rows, ``H``/``Hk`` query/key heads, ``D``/``Dv`` dims.
"""

from __future__ import annotations

import torch

__all__ = ["attn_fwd", "attn_bwd"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple[int, int]) -> None:
    left, right = window
    assert left >= -1 and right >= -1, f"window {window} is not flash-expressible"
    assert not (causal and right not in (0, -1)), f"causal call with right window {right}"
    assert q.shape[1] % k.shape[1] == 0 and k.shape[:2] == v.shape[:2], "bad head layout"


def _visibility(cu_q: torch.Tensor, cu_k: torch.Tensor, n: int, m: int, causal: bool, window: tuple[int, int]):
    """``[N, M]`` bool mask of the varlen call (segment-diagonal, bottom-right aligned)."""
    dev = cu_q.device
    cu_q, cu_k = cu_q.long(), cu_k.long()
    rq, rk = torch.arange(n, device=dev), torch.arange(m, device=dev)
    sid_q = torch.searchsorted(cu_q[1:], rq, right=True)
    sid_k = torch.searchsorted(cu_k[1:], rk, right=True)
    i = rq - cu_q[sid_q]
    j = rk - cu_k[sid_k]
    shift = (cu_k[1:] - cu_k[:-1] - (cu_q[1:] - cu_q[:-1]))[sid_q]
    diag = (i + shift)[:, None]
    vis = sid_q[:, None] == sid_k[None, :]
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        vis &= j[None, :] <= diag + right
    if left >= 0:
        vis &= j[None, :] >= diag - left
    return vis


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _probs(q, k, cu_q, cu_k, causal, window, scale, lse_HN=None):
    """Scores in fp32 (fp64 for fp64 input) and, given the row lse, probabilities."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,mhd->hnm", q.to(ct), _expand(k, groups).to(ct)) * scale
    vis = _visibility(cu_q, cu_k, q.shape[0], k.shape[0], causal, window)[None]
    s = s.masked_fill(~vis, float("-inf"))
    if lse_HN is None:
        lse_HN = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse_HN)[..., None]
    p = torch.where(vis & finite, torch.exp(s - torch.where(finite, lse_HN[..., None], 0.0)), 0.0)
    return p, lse_HN, ct, groups


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """``q [N,H,D], k [M,Hk,D], v [M,Hk,Dv] -> (out [N,H,Dv] in q.dtype, lse [N,H] fp32)``."""
    _check(q, k, v, causal, window)
    p, lse_HN, ct, groups = _probs(q, k, cu_seqlens_q, cu_seqlens_k, causal, window, scale)
    out = torch.einsum("hnm,mhd->nhd", p, _expand(v, groups).to(ct))
    return out.to(q.dtype), lse_HN.t().float()


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """Gradients of :func:`attn_fwd` given the *final* (merged) ``out`` and ``lse [N,H]``.

    Using the merged lse makes each call's probabilities the true global ones, so partial
    gradients from different KV blocks simply add up.
    """
    _check(q, k, v, causal, window)
    lse_HN = lse.t().to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    p, _, ct, groups = _probs(q, k, cu_seqlens_q, cu_seqlens_k, causal, window, scale, lse_HN)
    do = dout.to(ct)
    dv = torch.einsum("hnm,nhd->mhd", p, do)
    dp = torch.einsum("nhd,mhd->hnm", do, _expand(v, groups).to(ct))
    delta = (do * out.to(ct)).sum(-1).t()[..., None]  # [H, N, 1]
    ds = p * (dp - delta)
    dq = torch.einsum("hnm,mhd->nhd", ds, _expand(k, groups).to(ct)) * scale
    dk = torch.einsum("hnm,nhd->mhd", ds, q.to(ct)) * scale
    if groups > 1:
        dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], groups)).sum(2)
    # fp32 (fp64) partials: callers accumulate them across KV blocks without extra rounding.
    return dq, dk, dv
