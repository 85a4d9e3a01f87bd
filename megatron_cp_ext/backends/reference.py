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


def _entry_groups(
    cu_q: torch.Tensor, cu_k: torch.Tensor
) -> list[tuple[int, int, int, int, torch.Tensor, torch.Tensor]]:
    """Runs of consecutive entries computed as one dense block.

    A call's entries are block-diagonal; one dense ``[N, M]`` block over all of them wastes
    work quadratic in the number of entries. Entries are grouped while the dense area stays
    within twice the useful area (plus a small constant), so both many tiny entries and a few
    large ones stay cheap. Needs host offsets: on CUDA (debug fallback) it is one group.
    """
    if cu_q.device.type != "cpu":
        return [(0, -1, 0, -1, cu_q, cu_k)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out, start, useful = [], 0, 0
    for e in range(len(cq) - 1):
        area = (cq[e + 1] - cq[e]) * (ck[e + 1] - ck[e])
        if e > start and (cq[e + 1] - cq[start]) * (ck[e + 1] - ck[start]) > 2 * (useful + area) + 4096:
            out.append(_start_end(cq, ck, start, e))
            start, useful = e, 0
        useful += area
    out.append(_start_end(cq, ck, start, len(cq) - 1))
    return out


def _start_end(cq: list[int], ck: list[int], a: int, b: int):
    sub_q = torch.tensor([x - cq[a] for x in cq[a : b + 1]], dtype=torch.int64)
    sub_k = torch.tensor([x - ck[a] for x in ck[a : b + 1]], dtype=torch.int64)
    return cq[a], cq[b], ck[a], ck[b], sub_q, sub_k


def _rows(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x if b < 0 else x[a:b]


def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """``q [N,H,D], k [M,Hk,D], v [M,Hk,Dv] -> (out [N,H,Dv] in q.dtype, lse [N,H] fp32)``."""
    _check(q, k, v, causal, window)
    outs, lses = [], []
    for q0, q1, k0, k1, cq, ck in _entry_groups(cu_seqlens_q, cu_seqlens_k):
        qg, kg, vg = _rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1)
        p, lse_HN, ct, groups = _probs(qg, kg, cq, ck, causal, window, scale)
        outs.append(torch.einsum("hnm,mhd->nhd", p, _expand(vg, groups).to(ct)).to(q.dtype))
        lses.append(lse_HN.t().float())
    return torch.cat(outs), torch.cat(lses)


def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """Gradients of :func:`attn_fwd` given the *final* (merged) ``out`` and ``lse [N,H]``.

    Using the merged lse makes each call's probabilities the true global ones, so partial
    gradients from different KV blocks simply add up.
    """
    _check(q, k, v, causal, window)
    grads = []
    for q0, q1, k0, k1, cq, ck in _entry_groups(cu_seqlens_q, cu_seqlens_k):
        qd, qq, qo, ql = (_rows(x, q0, q1) for x in (dout, q, out, lse))
        kk, kv = _rows(k, k0, k1), _rows(v, k0, k1)
        grads.append(_bwd_dense(qd, qq, kk, kv, qo, ql, cq, ck, causal, window, scale))
    return tuple(torch.cat([g[i] for g in grads]) for i in range(3))


def _bwd_dense(dout, q, k, v, out, lse, cu_q, cu_k, causal, window, scale):
    lse_HN = lse.t().to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    p, _, ct, groups = _probs(q, k, cu_q, cu_k, causal, window, scale, lse_HN)
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
