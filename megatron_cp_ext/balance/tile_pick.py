"""Exact per-rank flash tile area of candidate shardings, for the tile step of the balance search.

The ``p2p`` kernels of a rank visit the 128x128 tiles of its calls' entries: its queries
against its own block and against the rows each peer sends it (see
:func:`.schedules.p2p_plan.build_plan`). A call's tiles start at its pieces' first rows and
adjacent fully visible blocks are fused, so the area depends on every piece's length and on
which blocks the planner fuses, not on the unit a piece belongs to alone. :func:`rank_tiles`
runs the planner's own entry builder (:func:`.plan.calls._entries`) on every rank of every
candidate at once, so the count is the one :func:`.inspect.inspect_plan` reports, at a few
milliseconds per candidate batch instead of a plan per rank.

:func:`.pick.refine`, the last step of :func:`.pick.pick`, uses it: where
the picked sharding misses the tile goal (efficiency >= :data:`GOAL`, or >= :data:`GOAL_OF_ONE` of the batch
unsharded), it runs the search's other passes (and, where dual-chunk's own work is out of
:data:`.pick.WORK_BOUND`, passes with looser tolerances) and keeps the admissible one
whose largest rank's tile area — the step's critical path — is smallest, ties by total area.
The pick itself stays a candidate, so no rank's critical path can grow.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..masks import MaskSpec
from ..masks.geometry import tile_area
from ..plan.calls import Layout, _entries, _pieces, visible_rows

__all__ = ["rank_tiles", "rank_paths", "Paths", "GOAL", "GOAL_OF_ONE", "LOOSE", "MAX_RANKS", "REACH"]

GOAL = 0.90
"""Tile efficiency (useful score entries over visited tile area) the goal asks for."""
GOAL_OF_ONE = 0.95
"""Or this share of the batch's efficiency unsharded (short documents bound both)."""
LOOSE = (25.0,)
"""Tolerances (in units of the default) of the extra passes where dual-chunk's work is out of
bounds, so only the 3 % goal binds."""
REACH = 1.10
"""Batches whose tile area is above the goal's by more than this are left alone: the passes
move cuts by a few tiles (they lower the area by at most 12 % on the balance families), and
most such batches are small ranks whose row tiles alone miss the goal."""
MAX_RANKS = 32
"""The step runs up to this CP size: each extra pass at cp 64 on ranks of 1K-4K tokens costs
about as much as the whole pick (35-40 ms of host time per pass, up to three passes), for a
largest-rank tile area 2-8 % smaller on the balance families."""
ESTIMATE_HIGH = 1.4
"""How far above the exact area the per-unit estimate (:func:`.pick.tile_estimate`)
may lie (at most 1.33 on the balance families): above that, the exact count is skipped."""

Segs = list[np.ndarray]


class Paths(NamedTuple):
    """Per candidate and rank (each ``[len(cands), cp]``), what a rank's ``p2p`` layer pays:
    the terms of its critical path that a sharding decides."""

    area: np.ndarray
    """Exact tile area (per head) its calls visit."""
    steps: np.ndarray
    """Ring steps with at least one call, its own block included (a step's calls share one
    received buffer: fewer steps, fewer launches and merges)."""
    sent: np.ndarray
    """KV rows it sends (exactly the rows its peers' queries see)."""
    received: np.ndarray
    """KV rows it receives."""


def rank_tiles(cands: list[Segs], mask: MaskSpec) -> np.ndarray:
    """``[len(cands), cp]`` exact tile area (per head) each rank's ``p2p`` calls visit."""
    return rank_paths(cands, mask).area


def rank_paths(cands: list[Segs], mask: MaskSpec) -> Paths:
    """:class:`Paths` of every rank of every candidate, counted as the ``p2p`` plans count them.

    Every (candidate, rank) is one viewer ``g``: its sequences are renamed ``seq * G + g``
    so that the planner's joins only pair a viewer's queries with its own buffers, and its
    buffers are numbered ``g * cp + step`` (0: the own block; step s: the rows rank
    ``r - s`` sends, exactly the rows its queries see, packed in row order)."""
    n = len(cands[0])
    segs = [s for c in cands for s in c]
    count = np.array([len(s) for s in segs], np.int64)
    views = len(segs)
    seg = np.concatenate(segs) if segs else np.zeros((0, 3), np.int64)
    owner = np.repeat(np.arange(views, dtype=np.int64), count)  # viewer g = candidate * cp + rank
    seq, start, end = seg[:, 0], seg[:, 1], seg[:, 2]
    size = end - start
    row = np.cumsum(size) - size  # every block at its own rows of one global row space
    row_end = row + size
    queries = Layout(seq * views + owner, start, end, row, np.zeros(len(seq), np.int64))
    # each viewer against the other ranks' segments of the sequences it holds, renamed to it
    key = owner // n * (int(seq.max(initial=0)) + 1) + seq  # (candidate, sequence)
    order = np.argsort(key, kind="stable")
    head = np.ones(len(key), bool)
    head[1:] = key[order][1:] != key[order][:-1]
    first = np.nonzero(head)[0]
    size_g = np.diff(np.append(first, len(key)))
    grp = np.cumsum(head) - 1
    reps = size_g[grp]  # every segment pairs with every segment of its group
    mine = np.repeat(order, reps)
    i = order[np.repeat(first[grp], reps) + np.arange(len(mine)) - np.repeat(np.cumsum(reps) - reps, reps)]
    other = owner[i] != owner[mine]
    pair = np.unique(owner[mine][other] * len(seq) + i[other])  # one per (viewer, other's segment)
    v, i = pair // max(len(seq), 1), pair % max(len(seq), 1)
    peers = Layout(seq[i] * views + v, start[i], end[i], row[i], (v - owner[i]) % n)
    qg = Layout(queries.seq, start, end, row, owner)
    g, step, lo, hi = visible_rows(qg, peers, mask)
    # the received rows, cut back into the owner's segments (see p2p_plan._recv_layout)
    i0 = np.searchsorted(row_end, lo, "right")
    c = np.maximum(np.searchsorted(row, hi, "left") - i0, 0)
    r = np.repeat(np.arange(len(lo)), c)
    j = np.repeat(i0, c) + np.arange(len(r)) - np.repeat(np.cumsum(c) - c, c)
    a_row, b_row = np.maximum(lo[r], row[j]), np.minimum(hi[r], row_end[j])
    a = start[j] + (a_row - row[j])
    got = b_row - a_row
    recv_row = int(row_end[-1]) if len(row_end) else 0
    keys = Layout(
        np.concatenate([queries.seq, seq[j] * views + g[r]]), np.concatenate([start, a]),
        np.concatenate([end, a + got]), np.concatenate([row, recv_row + np.cumsum(got) - got]),
        np.concatenate([owner * n, g[r] * n + step[r]]),
    )  # fmt: skip
    buf, q0, q1, k0, k1, left, right = _entries(_pieces(queries, mask.chunk), _pieces(keys, mask.chunk), mask)
    area = tile_area(q1 - q0, k1 - k0, left, right)
    per = lambda who, w=None: np.bincount(who, weights=w, minlength=views).astype(np.int64).reshape(len(cands), n)  # noqa: E731
    # buffers are numbered viewer * cp + step: one per step a viewer computes on
    return Paths(per(buf // n, area), per(np.unique(buf) // n), per(owner[j], got), per(g[r], got))
