"""Exact PyTorch varlen attention with flash-attn varlen semantics (CPU, tests, fallback).

Implements the local kernel contract of design §2 exactly: per batch entry, causal and
windows are bottom-right aligned. It refuses calls a flash kernel could not express, so a
plan verified on the CPU is a plan the GPU can run. Forward returns ``(out, lse_NH)`` with
an fp32 log-sum-exp (fp64 for fp64 input); backward recomputes probabilities from the saved
(final) lse, the same way a flash backward does — there is no autograd through this file.

Entries are computed as a padded batch ``[E, Wq] x [E, Wk]`` (one row of the batch per
entry, short entries padded with zero rows), never as one dense ``[N, M]`` block over
several entries: a product between two entries' rows would turn ``0 x NaN`` into NaN and
leak a NaN (or inf) from one document into the outputs and gradients of another.

Shapes: ``N`` query rows, ``M`` key rows, ``E`` entries, ``W`` padded entry width,
``K``/``G`` KV heads and query heads per KV head (``H = K * G``), ``D``/``Dv`` dims.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.autocast import autocast_off

__all__ = ["attn_fwd", "attn_bwd", "max_logit"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: tuple[int, int]) -> None:
    left, right = window
    assert left >= -1 and right >= -1, f"window {window} is not flash-expressible"
    assert not (causal and right not in (0, -1)), f"causal call with right window {right}"
    assert q.shape[1] % k.shape[1] == 0 and k.shape[:2] == v.shape[:2], "bad head layout"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_contract_lse(lse_TH: torch.Tensor) -> torch.Tensor:
    """``lse_TH`` (any strides, e.g. a kernel's ``[H, T]`` transposed) as the contract's
    contiguous fp32 ``[T, H]``, every infinity at ``-inf`` (a row that saw no key, whichever
    infinity the kernel wrote); a NaN stays a NaN. One pass."""
    inf = float("inf")
    out = torch.empty(lse_TH.shape, dtype=torch.float32, device=lse_TH.device)
    return torch.nan_to_num(lse_TH.float(), nan=float("nan"), posinf=-inf, neginf=-inf, out=out)


class _Group(NamedTuple):
    """Consecutive entries computed as one padded batch."""

    q0: int
    q1: int | None
    k0: int
    k1: int | None
    cu_q: torch.Tensor
    """Offsets of the group's entries, relative to ``q0`` (int64)."""
    cu_k: torch.Tensor
    wq: int
    """Padded query width: the longest query entry of the group."""
    wk: int


def _group_bounds(cq: list[int], ck: list[int]) -> list[tuple[int, int, int, int]]:
    """``(first entry, end entry, Wq, Wk)`` of each run of consecutive entries sharing one
    padded batch: entries join while the padded area ``E * Wq * Wk`` stays within twice the
    useful area (plus a small constant), so many tiny entries and a few large ones both stay
    cheap."""
    out: list[tuple[int, int, int, int]] = []
    start, useful, wq, wk = 0, 0, 0, 0
    for e in range(len(cq) - 1):
        lq, lk = cq[e + 1] - cq[e], ck[e + 1] - ck[e]
        nq, nk = max(wq, lq), max(wk, lk)
        if e > start and (e + 1 - start) * nq * nk > 2 * (useful + lq * lk) + 4096:
            out.append((start, e, wq, wk))
            start, useful, nq, nk = e, 0, lq, lk
        useful += lq * lk
        wq, wk = nq, nk
    if len(cq) > 1:
        out.append((start, len(cq) - 1, wq, wk))
    return out


def visited_area(cu_seqlens_q: list[int], cu_seqlens_k: list[int]) -> int:
    """Score entries per head this backend materialises for one call on CPU (padded
    rectangles, masked or not): what the cost model prices for the ``reference`` kernel."""
    return sum((b - a) * wq * wk for a, b, wq, wk in _group_bounds(cu_seqlens_q, cu_seqlens_k))


def _entry_groups(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, entries=None) -> list[_Group]:
    """Runs of consecutive entries sharing one padded batch (:func:`_group_bounds`).

    Needs host offsets: the call's host ``entries`` (``[E, 4]`` rows of a
    :class:`~..plan.calls.VarlenCall`) where given, the groups' offsets then uploaded once per
    call object (:data:`_CALL_GROUPS`); else read from ``cu_q``/``cu_k`` on CPU. On a device
    without ``entries`` (a debug fallback), and while dynamo traces the call (``fullgraph``:
    the offsets are graph inputs, their values unknown), the call is one group padded to the
    plan's ``max_seqlen`` (host ints), so nothing reads a tensor's value.
    """
    if torch.compiler.is_compiling() or (cu_q.device.type != "cpu" and entries is None):
        return [_Group(0, None, 0, None, cu_q.long(), cu_k.long(), max_q, max_k)]
    if entries is None:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        return [_group(cq, ck, a, b, wq, wk) for a, b, wq, wk in _group_bounds(cq, ck)]
    cached = _CALL_GROUPS.get(cu_q)
    if cached is None or cached[0] is not entries:
        cq, ck = ([0, *np.cumsum(entries[:, hi] - entries[:, lo]).tolist()] for lo, hi in ((0, 1), (2, 3)))
        groups = [_group(cq, ck, a, b, wq, wk) for a, b, wq, wk in _group_bounds(cq, ck)]
        move = lambda t: t.to(cu_q.device, non_blocking=True)  # noqa: E731
        cached = _CALL_GROUPS[cu_q] = (entries, [g._replace(cu_q=move(g.cu_q), cu_k=move(g.cu_k)) for g in groups])
    return cached[1]


_CALL_GROUPS = WeakIdKeyDictionary()
"""A call's groups (:func:`_entry_groups`) by its ``cu_seqlens_q`` tensor, which lives
as long as the plan's device calls: a layer's calls after the first upload nothing."""


def _group(cq: list[int], ck: list[int], a: int, b: int, wq: int, wk: int) -> _Group:
    sub_q = torch.tensor([x - cq[a] for x in cq[a : b + 1]], dtype=torch.int64)
    sub_k = torch.tensor([x - ck[a] for x in ck[a : b + 1]], dtype=torch.int64)
    return _Group(cq[a], cq[b], ck[a], ck[b], sub_q, sub_k, wq, wk)


def _pad(x: torch.Tensor, cu: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, ...]`` -> ``[E, width, ...]``: entry e's rows first, then zero rows."""
    n_e = cu.numel() - 1
    if n_e == 1 and x.shape[0] == width:
        return x.unsqueeze(0)
    ar = torch.arange(width, device=x.device)
    valid = ar[None, :] < (cu[1:] - cu[:-1])[:, None]
    idx = torch.where(valid, cu[:-1, None] + ar[None, :], x.shape[0])  # row N: the zero row
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return padded.index_select(0, idx.flatten()).view(n_e, width, *x.shape[1:])


def _unpad(xp: torch.Tensor, cu: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`_pad`: ``[E, W, ...]`` -> ``[rows, ...]`` (padding dropped)."""
    if xp.shape[0] == 1 and xp.shape[1] == rows:
        return xp[0]
    r = torch.arange(rows, device=xp.device)
    e = torch.searchsorted(cu[1:], r, right=True)
    return xp.flatten(0, 1).index_select(0, e * xp.shape[1] + r - cu[e])


def _visibility(cu_q: torch.Tensor, cu_k: torch.Tensor, wq: int, wk: int, causal: bool, window) -> torch.Tensor:
    """``[E, Wq, Wk]`` bool: flash varlen visibility per entry (bottom-right aligned), padding off."""
    return _tile_visibility(cu_q, cu_k, (0, wq), (0, wk), causal, window)


def _probs(qh, kh, vis, scale, lse=None):
    """Probabilities ``[E, K, G, Wq, Wk]`` in the compute dtype and the lse ``[E, K, G, Wq]``.

    Invisible scores are replaced (not multiplied) by -inf, so their probability is exactly
    0 whatever the inputs hold; a NaN only reaches the rows and keys of its own entry.
    """
    e, hk, wk = kh.shape[0], kh.shape[1], kh.shape[2]
    # explicit sizes: -1 is ambiguous when a group has no query rows or no keys (Wq or Wk = 0)
    g = lse.shape[2] if lse is not None else qh.shape[2] // max(vis.shape[1], 1)
    s = ((qh * scale) @ kh.transpose(-1, -2)).view(e, hk, g, vis.shape[1], wk)
    s = torch.where(vis[:, None, None], s, float("-inf"))
    if lse is None:  # forward: max-subtracted, so the probabilities keep log(sum) however large the logits
        lse = torch.logsumexp(s, dim=-1)
        if s.shape[-1] == 0:  # no keys in the group: nothing to normalise (amax needs one)
            return s, lse
        top = s.amax(dim=-1, keepdim=True)
        p = s.sub_(torch.where(torch.isneginf(top), 0.0, top)).exp_()  # a row that sees nothing: all 0
        total = p.sum(-1, keepdim=True)
        return p.div_(total.masked_fill_(total == 0, 1.0)), lse
    # Rows that see nothing have lse -inf: subtract 0 there, so every entry is exp(-inf) = 0.
    # Only there: a +inf lse (a sink of +inf takes every probability) gives exp(s - inf) = 0,
    # and a NaN lse NaN probabilities, as dense attention would.
    ref = torch.where(torch.isneginf(lse), 0.0, lse)
    return s.sub_(ref[..., None]).exp_(), lse


def _heads(xp: torch.Tensor) -> torch.Tensor:
    """``[E, W, K, (G,) D]`` -> ``[E, K, (G *) W, D]``: one matrix per (entry, KV head)."""
    if xp.dim() == 4:
        return xp.permute(0, 2, 1, 3)
    e, w, hk, g, d = xp.shape
    return xp.permute(0, 2, 3, 1, 4).reshape(e, hk, g * w, d)


def _rows_of(x: torch.Tensor, grp: _Group, keys: bool) -> torch.Tensor:
    a, b = (grp.k0, grp.k1) if keys else (grp.q0, grp.q1)
    return x[a:b] if b is not None else x


def _query_side(x: torch.Tensor, grp: _Group, cu_q: torch.Tensor, hk: int, ct: torch.dtype) -> torch.Tensor:
    """A per-query tensor ``[N, H, ...]`` of the group as ``[E, K, G*Wq, ...]`` in ``ct``."""
    xp = _pad(_rows_of(x, grp, False).to(ct), cu_q, grp.wq)
    return _heads(xp.unflatten(2, (hk, x.shape[1] // hk)))


def _inputs(grp: _Group, q, k, v, ct):
    """The group's q ``[E, K, G*Wq, D]``, k ``[E, K, Wk, D]``, v ``[E, K, Wk, Dv]`` in ``ct``."""
    hk = k.shape[1]
    cu_q, cu_k = grp.cu_q.to(q.device), grp.cu_k.to(q.device)
    qh = _query_side(q, grp, cu_q, hk, ct)
    kh = _heads(_pad(_rows_of(k, grp, True).to(ct), cu_k, grp.wk))
    vh = _heads(_pad(_rows_of(v, grp, True).to(ct), cu_k, grp.wk))
    return qh, kh, vh, cu_q, cu_k


def _unheads(xh: torch.Tensor, g: int, cu: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`_heads` and :func:`_pad`: ``[E, K, G*W, D]`` -> ``[rows, K*G, D]``."""
    e, hk, gw, d = xh.shape
    xp = xh.view(e, hk, g, gw // g, d).permute(0, 3, 1, 2, 4).reshape(e, gw // g, hk * g, d)
    return _unpad(xp, cu, rows)


@autocast_off
def attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """``q [N,H,D], k [M,K,D], v [M,K,Dv] -> (out [N,H,Dv] in q.dtype, lse [N,H] fp32/fp64)``."""
    _check(q, k, v, causal, window)
    ct, g = _compute_dtype(q), q.shape[1] // k.shape[1]
    outs, lses = [], []
    for grp in _entry_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        qh, kh, vh, cu_q, cu_k = _inputs(grp, q, k, v, ct)
        p, lse = _probs(qh, kh, _visibility(cu_q, cu_k, grp.wq, grp.wk, causal, window), scale)
        o = p.flatten(2, 3) @ vh  # [E, K, G*Wq, Dv]
        n = _rows_of(q, grp, False).shape[0]
        outs.append(_unheads(o, g, cu_q, n).to(q.dtype))
        lses.append(_unheads(lse.flatten(2, 3)[..., None], g, cu_q, n)[..., 0])
    if not outs:
        return q.new_zeros((0, q.shape[1], v.shape[2])), q.new_zeros((0, q.shape[1]), dtype=ct)
    return torch.cat(outs), torch.cat(lses)


@autocast_off
def attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """Gradients of :func:`attn_fwd` given the *final* (merged) ``out`` and ``lse [N,H]``.

    Using the merged lse makes each call's probabilities the true global ones, so partial
    gradients from different KV blocks simply add up. Partials come back in fp32 (fp64 for
    fp64 input): callers accumulate them across KV blocks without extra rounding.
    """
    _check(q, k, v, causal, window)
    ct, hk = _compute_dtype(q), k.shape[1]
    g = q.shape[1] // hk
    dqs, dks, dvs = [], [], []
    for grp in _entry_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        qh, kh, vh, cu_q, cu_k = _inputs(grp, q, k, v, ct)
        doh, outh = _query_side(dout, grp, cu_q, hk, ct), _query_side(out, grp, cu_q, hk, ct)
        lse_h = _query_side(lse[..., None], grp, cu_q, hk, ct)[..., 0].unflatten(2, (g, grp.wq))
        vis = _visibility(cu_q, cu_k, grp.wq, grp.wk, causal, window)
        p = _probs(qh, kh, vis, scale, lse_h)[0].flatten(2, 3)  # [E, K, G*Wq, Wk]
        dvh = p.transpose(-1, -2) @ doh
        delta = (doh * outh).sum(-1, keepdim=True)  # [E, K, G*Wq, 1]
        ds = (doh @ vh.transpose(-1, -2)).sub_(delta).mul_(p)
        nq, nk = _rows_of(q, grp, False).shape[0], _rows_of(k, grp, True).shape[0]
        dqs.append(_unheads(ds @ kh * scale, g, cu_q, nq))
        dks.append(_unheads((ds.transpose(-1, -2) @ qh) * scale, 1, cu_k, nk))
        dvs.append(_unheads(dvh, 1, cu_k, nk))
    if not dqs:
        z = lambda x: torch.zeros(x.shape, dtype=ct, device=x.device)  # noqa: E731
        return z(q), z(k), z(v)
    return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


MAX_LOGIT_TILE = 1024
"""Query rows x key rows of one score tile in :func:`max_logit`."""

MAX_LOGIT_SCORES = 1 << 26
"""Scores (fp32) of one tile in :func:`max_logit` at most, over its entries and heads: tiles
span as many of a group's entries as fit (one at least), so memory stays bounded whatever the
number and lengths of the entries."""


@autocast_off
def max_logit(
    q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale, entries=None
) -> torch.Tensor:
    """Per query head, the largest scaled logit ``scale * q.k`` over the pairs this call sees.

    ``q [N,H,D], k [M,K,D] -> [H]`` float32; ``-inf`` for a head that sees no pair. Computed
    exactly from the scores (the same visibility as :func:`attn_fwd`), never from the lse,
    which only bounds it. Entries are padded in groups of similar lengths (the call's host
    ``entries`` give them on a device; :func:`_entry_groups`), so the padded rows stay within
    about twice the call's own, and scores are made in tiles of :data:`MAX_LOGIT_TILE` rows
    and keys over at most :data:`MAX_LOGIT_SCORES` scores, all counted on the host (no sync).
    Only runs when a caller asks for max logits.
    """
    _check(q, k, k, causal, window)
    ct, hk = _compute_dtype(q), k.shape[1]
    best = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
    t = MAX_LOGIT_TILE
    for grp in _entry_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, entries):
        cu_q, cu_k = grp.cu_q.to(q.device), grp.cu_k.to(q.device)
        qp = _pad(_rows_of(q, grp, False).to(ct), cu_q, grp.wq).unflatten(2, (hk, -1))  # [E, Wq, K, G, D]
        kp = _pad(_rows_of(k, grp, True).to(ct), cu_k, grp.wk)  # [E, Wk, K, D]
        n_e = cu_q.numel() - 1
        per_entry = q.shape[1] * min(grp.wq, t) * min(grp.wk, t)
        step = max(1, MAX_LOGIT_SCORES // max(per_entry, 1))
        for e0 in range(0, n_e, step):
            e1 = min(n_e, e0 + step)
            cq, ck = cu_q[e0 : e1 + 1], cu_k[e0 : e1 + 1]
            for i0 in range(0, grp.wq, t):
                for j0 in range(0, grp.wk, t):
                    qt, kt = qp[e0:e1, i0 : i0 + t] * scale, kp[e0:e1, j0 : j0 + t]
                    s = torch.einsum("eikgd,ejkd->ekgij", qt, kt)
                    vis = _tile_visibility(cq, ck, (i0, i0 + qt.shape[1]), (j0, j0 + kt.shape[1]), causal, window)
                    s.masked_fill_(~vis[:, None, None], float("-inf"))
                    best = torch.maximum(best, s.amax(dim=(0, 3, 4)).flatten().float())
    return best


def _tile_visibility(cu_q, cu_k, rows: tuple[int, int], cols: tuple[int, int], causal: bool, window) -> torch.Tensor:
    """:func:`_visibility` restricted to padded rows ``[i0, i1)`` and keys ``[j0, j1)``."""
    dev = cu_q.device
    lq, lk = (cu_q[1:] - cu_q[:-1])[:, None, None], (cu_k[1:] - cu_k[:-1])[:, None, None]
    i = torch.arange(*rows, device=dev)[None, :, None]
    j = torch.arange(*cols, device=dev)[None, None, :]
    vis = (i < lq) & (j < lk)
    diag = i + lk - lq
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        vis = vis & (j <= diag + right)
    if left >= 0:
        vis = vis & (j >= diag - left)
    return vis
