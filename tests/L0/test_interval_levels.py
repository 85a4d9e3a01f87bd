"""``plan.levels.interval_levels`` (the general case of ``plan.calls._levels``, shared by the
plans and the ``auto`` estimate) against the per-entry heap it replaces, on random interval
sets rich in runs over the very same rows and in equal ends: the same call per entry, and no
call repeats a query row."""

import heapq

import numpy as np
import pytest

from megatron_cp_ext.plan.calls import _groups, _levels
from megatron_cp_ext.plan.levels import interval_levels


def _heap_reference(q0, q1, gid):
    """Per-entry greedy partitioning: reuse the earliest-ending call if it ended, else open one."""
    out, ends, prev = [], [], None
    for a, b, g in zip(q0.tolist(), q1.tolist(), gid.tolist()):
        if g != prev:
            ends, prev = [], g
        if ends and ends[0][0] <= a:
            lvl = heapq.heappop(ends)[1]
        else:
            lvl = len(ends)
        heapq.heappush(ends, (b, lvl))
        out.append(lvl)
    return np.array(out, np.int64)


def _random_set(rng):
    n = int(rng.integers(1, 80))
    gid = np.sort(rng.integers(0, int(rng.integers(1, 4)), n))
    a = rng.integers(0, int(rng.integers(2, 40)), n)
    length = rng.integers(1, int(rng.integers(2, 20)), n)
    if rng.random() < 0.6:  # runs over the very same rows (one query piece, many key pieces)
        pick = rng.integers(0, max(1, n // 4), n)
        a, length = a[pick], length[pick]
    order = np.lexsort((rng.random(n), a, gid))  # group, then start; ties in any order
    return a[order], a[order] + length[order], gid


@pytest.mark.parametrize("seed", range(2))
def test_interval_levels_equal_the_heap_and_never_repeat_a_row(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        q0, q1, gid = _random_set(rng)
        level = interval_levels(q0, q1, gid)
        np.testing.assert_array_equal(level, _heap_reference(q0, q1, gid))
        for g, lv in set(zip(gid.tolist(), level.tolist())):  # one call: disjoint query rows
            sel = (gid == g) & (level == lv)
            rows = np.concatenate([np.arange(x, y) for x, y in zip(q0[sel], q1[sel])])
            assert len(np.unique(rows)) == len(rows)
        head = _groups(gid)
        quick = _levels(q0, q1, head)  # its quick paths must not repeat a row either
        for g, lv in set(zip(gid.tolist(), quick.tolist())):
            sel = (gid == g) & (quick == lv)
            rows = np.concatenate([np.arange(x, y) for x, y in zip(q0[sel], q1[sel])])
            assert len(np.unique(rows)) == len(rows)
