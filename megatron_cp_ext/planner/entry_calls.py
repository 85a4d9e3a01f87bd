"""Varlen calls and tile area of many entries at once, as ``plan.calls.plan_steps`` groups them.

The pricing half of :mod:`.estimate`: given the band entries of many (rank, buffer) pairs as
arrays, it fuses fully visible neighbours, assigns levels and splits slice runs exactly as the
plans do, vectorised over all pairs (one sort per pass instead of one plan per rank).
"""

from __future__ import annotations

import numpy as np

from ..masks.geometry import BIG, TILE, tile_area
from ..plan.calls import MAX_SLICE_CALLS, one_row_causal
from ..plan.levels import interval_levels
from .chains import expand

__all__ = ["Overlap", "price_entries", "starts"]


class Overlap(Exception):
    """A rank holding merged chain entries needs the general interval partitioning: price
    again without merging (:mod:`.chains`)."""


def price_entries(buf, size, per_rank: int, q0, sq, k0, sk, left, right, fixed=None, merged=None):
    """Tile area and calls per ``buf`` id of entries ``[q0, q0 + sq) x [k0, k0 + sk)`` (rows)
    with flash windows ``(left, right)``, after fusing adjacent fully visible entries as
    ``plan.calls._entries`` does. ``fixed``: merged chain entries (:mod:`.chains`), which are
    never fused and price no area here; ``merged``: ``(qm, km, members)``, their merged query
    and key pieces and :attr:`.chains.Chains.members`, to price the members' own entries on a
    rank that needs the general interval partitioning. Returns ``(area, calls)``."""
    fixed = None if fixed is None or not fixed.any() else fixed
    full = (left < 0) & (right < 0) if fixed is None else (left < 0) & (right < 0) & ~fixed
    f = [x[full] for x in (buf, q0, q0 + sq, k0, k0 + sk)]
    for _ in range(3 if len(f[0]) else 0):
        m = len(f[0])
        f = list(_fuse_rows(*f, by_q=True))
        f = list(_fuse_rows(*f, by_q=False))
        if len(f[0]) == m:
            break
    band = ~full
    none = np.full(len(f[0]), -1)
    buf, q0, q1, k0, k1 = (np.concatenate([x, y[band]]) for x, y in zip(f, (buf, q0, q0 + sq, k0, k0 + sk)))
    left, right = np.concatenate([none, left[band]]), np.concatenate([none, right[band]])
    nf = len(none)  # the fused fully visible entries come first: whole tiles, closed form
    tiles = ((q1[:nf] - q0[:nf] + TILE - 1) // TILE) * ((k1[:nf] - k0[:nf] + TILE - 1) // TILE) * (TILE * TILE)
    area = np.bincount(buf[:nf], weights=tiles, minlength=size).astype(np.float64)  # int64 when empty
    p = slice(nf, None) if fixed is None else nf + np.nonzero(~fixed[band])[0]
    band_area = tile_area(q1[p] - q0[p], k1[p] - k0[p], left[p], right[p]).astype(np.float64)
    area += np.bincount(buf[p], weights=band_area, minlength=size)
    right = one_row_causal(buf, q0, q1, left, right)  # as the plans group them (area unchanged)
    keys = [buf // per_rank, buf, left, right, q0, q1, k0, k1]
    if fixed is None:
        return area, _runs(keys, buf, size, None)[0]
    fixed = np.concatenate([np.zeros(nf, bool), fixed[band]])
    calls, redo = _runs(keys, buf, size, fixed)
    if not len(redo):
        return area, calls
    if merged is None:
        raise Overlap(redo)
    # those ranks' entries again, the merged ones as their members' own (area already priced)
    qm, km, members = merged
    qm, km = (np.concatenate([np.full(nf, -1), x[band]]) for x in (qm, km))
    mine = np.isin(keys[0], redo)
    sel = np.nonzero(fixed & mine)[0]
    rep, qo, ql, ko, kl = expand(sel, qm, km, members)
    keep = mine & ~fixed
    q0r, k0r = q0[rep] + qo, k0[rep] + ko
    cols = [np.concatenate([x[keep], x[rep]]) for x in (buf, left, right)]
    cols += [np.concatenate([x[keep], y]) for x, y in ((q0, q0r), (q1, q0r + ql), (k0, k0r), (k1, k0r + kl))]
    return area, calls + _runs([cols[0] // per_rank, *cols], cols[0], size, None)[0]


def _runs(keys: list[np.ndarray], out: np.ndarray, size: int, fixed: np.ndarray | None):
    """Per ``out`` id, the calls of entries grouped by ``keys`` (the first: the rank; the last
    four: ``q0, q1, k0, k1`` rows), as :func:`~megatron_cp_ext.plan.calls.plan_steps` splits
    them: entries over the same query rows go to separate calls (``plan.calls._levels``); a
    level whose entries form at most ``MAX_SLICE_CALLS`` runs of consecutive rows is that many
    slice calls, else one gather. Returns ``(calls, redo)``: ``redo``, the ranks holding
    ``fixed`` entries that need the general interval partitioning, count no calls here."""
    redo = np.zeros(0, np.int64)
    if not len(out):
        return np.zeros(size, np.int64), redo
    *group, q0, q1, k0, k1 = keys
    order = _order([*group, q0, k0])
    group, q0, q1, k0, k1, out = [g[order] for g in group], q0[order], q1[order], k0[order], k1[order], out[order]
    level, redo = _rank_levels(group[0], q0, q1, starts(group), None if fixed is None else fixed[order])
    if len(redo):  # ranks are independent (the rank is the first group key): drop those
        keep = ~np.isin(group[0], redo)
        group, q0, q1, k0, k1, out, level = [g[keep] for g in group], q0[keep], q1[keep], k0[keep], k1[keep], \
            out[keep], level[keep]  # fmt: skip
        if not len(out):
            return np.zeros(size, np.int64), redo
    if level.any():  # else the entries are already sorted by group, level, q0, k0
        order = _order([*group, level, q0, k0])
        group, q0, q1, k0, k1, out, level = ([g[order] for g in group], q0[order], q1[order], k0[order], k1[order],
                                             out[order], level[order])  # fmt: skip
    head = starts([*group, level])
    brk = head.copy()
    brk[1:] |= (q0[1:] != q1[:-1]) | (k0[1:] != k1[:-1])
    first = np.nonzero(head)[0]
    runs = np.add.reduceat(brk, first)
    calls = np.where(runs <= MAX_SLICE_CALLS, runs, 1)
    return np.bincount(out[first], weights=calls, minlength=size).astype(np.int64), redo


def _rank_levels(rank, q0: np.ndarray, q1: np.ndarray, head: np.ndarray, fixed: np.ndarray | None):
    """``plan.calls._levels`` of every rank's entries (sorted by ``rank``, group, query start;
    ``head``: group starts) as if computed rank by rank: entries over the very same query rows
    take one level each, unless that leaves overlaps in a rank, which then gets the general
    interval partitioning."""
    gid = np.cumsum(head) - 1
    idx = np.arange(len(q0))
    level = idx - np.maximum.accumulate(np.where(starts([gid, q0, q1]), idx, 0))
    top = int(level.max()) if len(level) else 0
    if top:  # by group, level; a stable sort keeps query-start order inside (as lexsort does)
        order = np.argsort(gid * (top + 1) + level, kind="stable")
        q0s, q1s, first = q0[order], q1[order], starts([gid[order], level[order]])
    else:  # one level: already in that order
        order, q0s, q1s, first = idx, q0, q1, head
    prev = np.concatenate([[-1], q1s[:-1]])
    prev[first] = -1
    off = (np.cumsum(first) - 1) * (4 * BIG)  # keeps the running maximum inside each call
    bad = q0s < np.maximum.accumulate(prev + off) - off
    redo = np.unique(rank[order][bad])
    if len(redo) and fixed is not None and np.isin(redo, rank[fixed]).any():
        return level, redo  # their merged entries go back to the members' own first
    if len(redo):  # such a rank fails both of _levels' quick checks: interval partitioning
        mine = _member(rank, redo)
        # a group of disjoint entries stays in one call (the partitioning reuses it throughout)
        prev = np.concatenate([[-1], q1[:-1]])
        prev[head] = -1
        off = gid * (4 * BIG)
        clash = q0 < np.maximum.accumulate(prev + off) - off
        sel = mine & _member(gid, gid[clash])
        level[mine & ~sel] = 0
        level[sel] = interval_levels(q0[sel], q1[sel], gid[sel])
    return level, np.zeros(0, np.int64)


def _member(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.isin(x, values)`` for small non-negative ids (a lookup table, no sort)."""
    hit = np.zeros(int(x.max()) + 1, bool)
    hit[values] = True
    return hit[x]


def _order(cols: list[np.ndarray]) -> np.ndarray:
    """``np.lexsort`` by ``cols`` (most significant first) with neighbouring columns packed
    into one int64 key while their value ranges fit (fewer, faster sort passes)."""
    keys, cur, span = [], None, 1
    for c in cols:
        lo = int(c.min())
        r = int(c.max()) - lo + 1
        c = c - lo
        if cur is not None and span * r < 1 << 62:
            cur, span = cur * r + c, span * r
        else:
            if cur is not None:
                keys.append(cur)
            cur, span = c, r
    keys.append(cur)
    return np.lexsort(keys[::-1]) if len(keys) > 1 else np.argsort(keys[0], kind="stable")


def _fuse_rows(buf, q0, q1, k0, k1, by_q: bool):
    """``plan.calls._fuse`` (fully visible entries with the same rows on one side and
    adjacent rows on the other become one) with packed sort keys."""
    a0, a1, b0, b1 = (q0, q1, k0, k1) if by_q else (k0, k1, q0, q1)
    order = _order([buf, a0, a1, b0])
    buf, a0, a1, b0, b1 = buf[order], a0[order], a1[order], b0[order], b1[order]
    head = starts([buf, a0, a1])
    head[1:] |= b0[1:] != b1[:-1]
    first = np.nonzero(head)[0]
    last = np.append(first[1:], len(buf))[: len(first)] - 1  # no runs: none
    out = buf[first], a0[first], a1[first], b0[first], b1[last]
    return out if by_q else (out[0], out[3], out[4], out[1], out[2])


def starts(cols: list[np.ndarray]) -> np.ndarray:
    """Start flags of runs of equal rows of ``cols`` (sorted)."""
    flag = np.zeros(len(cols[0]), bool)
    flag[:1] = True  # no rows: no runs
    for c in cols:
        flag[1:] |= c[1:] != c[:-1]
    return flag
