"""Interval partitioning of a call group's entries (``plan.calls._levels``' general case).

Entries of one call group whose query rows overlap must go to different varlen calls (a call
updates its output rows in place, so no call may repeat a query row). The rule is the greedy
partitioning in entry order: an entry reuses the call whose last entry ended earliest (ties:
the lower call), if that one has ended by the entry's first row, else it opens a new call.
Both the plans (:mod:`.calls`) and the ``auto`` estimate (:mod:`megatron_cp_ext.planner`) use
it, so both must get the very same levels.

The loop is sequential by nature, but the entries that need it mostly come in runs over the
very same query rows (one query piece against many key pieces with one mask alignment). A run
of ``m`` such entries takes ``m`` calls in one step, so the heap holds *buckets*: calls that
share one end row, sorted by call, taken in ``(end, call)`` order as the per-entry heap takes
them. Cost: one heap operation per run (per bucket touched), not per entry.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

__all__ = ["interval_levels"]


def interval_levels(q0: np.ndarray, q1: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """Per entry (sorted by group ``gid``, then query start ``q0``; rows ``[q0, q1)``) its call
    inside its group: equal, call for call, to the per-entry heap ``(end, call)`` that pops the
    earliest-ending call when it ended by ``q0``, else pushes a new one."""
    n = len(q0)
    if not n:
        return np.zeros(0, np.int64)
    head = np.ones(n, bool)
    head[1:] = (gid[1:] != gid[:-1]) | (q0[1:] != q0[:-1]) | (q1[1:] != q1[:-1])
    first = np.nonzero(head)[0]
    newg = np.ones(len(first), bool)
    newg[1:] = gid[first[1:]] != gid[first[:-1]]
    runs = zip(q0[first].tolist(), q1[first].tolist(), np.diff(np.append(first, n)).tolist(), newg.tolist())
    out: list[int] = []
    ends: list[tuple[int, int, list[int]]] = []  # buckets (end, first call, calls ascending)
    total = 0
    push, pop, replace, cut_at = heapq.heappush, heapq.heappop, heapq.heapreplace, bisect.bisect_left
    for a, b, m, new_group in runs:
        if new_group:
            ends, total = [], 0
        if not ends or ends[0][0] > a:  # every call still runs: m new ones
            got = list(range(total, total + m))
            total += m
            out.extend(got)
            push(ends, (b, got[0], got))
            continue
        if m == 1:  # the common case: the earliest call moves to the end b
            e, c0, calls = ends[0]
            if len(calls) == 1:
                replace(ends, (b, c0, calls))
            else:
                replace(ends, (e, calls[1], calls[1:]))
                push(ends, (b, c0, [c0]))
            out.append(c0)
            continue
        got: list[int] = []  # up to m calls ended by row a, in (end, call) order
        need = m
        while need and ends and ends[0][0] <= a:
            e, _, calls = ends[0]
            cut = need
            if len(ends) > 1:  # another bucket with the same end interleaves by call
                e2, c2, _ = ends[1] if len(ends) == 2 or ends[1] < ends[2] else ends[2]
                if e2 == e and c2 < calls[-1]:
                    cut = min(cut_at(calls, c2), need)
            if len(calls) <= cut:
                pop(ends)
                got += calls
                need -= len(calls)
            else:
                replace(ends, (e, calls[cut], calls[cut:]))
                got += calls[:cut]
                need -= cut
        out += got
        got.sort()
        if need:
            got += range(total, total + need)
            out += got[-need:]
            total += need
        push(ends, (b, got[0], got))
    return np.asarray(out, np.int64)
