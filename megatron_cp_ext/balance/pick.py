"""The ``workload`` balance on small ranks: a few candidate shardings, scored on the host.

With a few hundred or thousand tokens per rank, equal counts force cuts through most
documents, and where those cuts land decides both the attention work per rank and how full
the flash tiles are; one greedy pass can then come out slightly less balanced than the plain
dual-chunk split, or waste tiles a neighbouring choice would not. On batches of at most
:data:`SEARCH_TOKENS` tokens (where one more pass costs a few milliseconds), and on larger
ones of up to a few hundred documents (:data:`SEARCH_PIECES`: there a pass's tile-aligned
cuts can leave it up to 0.15 % above dual-chunk's work), :func:`pick` scores these candidates exactly in
work and approximately in tiles (other large batches keep the one pass, so planning time does
not grow where it is largest):

* the workload stream with its default tolerance, with a tighter and a looser one, and with
  the ranks served in reverse order (the last ranks absorb earlier misses: another set of
  boundaries);
* the dual-chunk split (``balance="dualchunk"``); under a full mask the contiguous split,
  whose per-rank work is the same there with one piece per document instead of two (below,
  "the dual-chunk split" means whichever of the two the mask takes).

and keeps the candidate with the fewest estimated tiles among the admissible ones: work max/mean within
:data:`WORK_BOUND`, not above the dual-chunk split's by more than :data:`WORK_SLACK`, nor (where
the default pass meets those) above the default's by more. So
``workload`` is as balanced as ``dualchunk`` there, while a ten-thousandth of work (one
token's share on such ranks) never costs a quarter of the tile efficiency.

Tiles are estimated per unit (document, or chunk under chunked attention) from its pieces'
row tiles: a unit cut into pieces of lengths ``l_i`` occupies ``sum(ceil(l_i / 128))`` row
(and key) tiles instead of ``ceil(n / 128)``, and its tile area grows with their square.
Where the pick then misses the tile goal by a little, the tile step
(:func:`refine`) counts exact per-rank tile areas and may trade the estimate's
pick for one with a shorter largest rank (:mod:`.tile_pick`).

Under a sliding window or chunks, balancing *work* exactly can cost the step more than it
saves: on a few long documents the cheap positions (a window's first keys, each chunk's
start) are dealt out to every rank as a small extra piece, whose keys lie on many ranks, so
each rank runs a call per ring step over ragged pieces (65 calls per layer at cp 64 against
2 for the contiguous split, and a largest rank with up to 3x the tile area). The reference
step (:func:`shorter_reference`, for every batch size) compares the pick with plain splits
(in packed order, contiguous, dual-chunk) by what the kernels and the ring pay and keeps a
reference where it is no longer on any of it, and shorter, while it meets the work goal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..masks import MaskSpec
from ..masks.geometry import TILE, bounds, chunk_units, tile_area, work_prefix
from .tile_pick import ESTIMATE_HIGH, GOAL, GOAL_OF_ONE, LOOSE, MAX_RANKS, REACH, rank_paths, rank_tiles
from .workload import TOLERANCE, Step, workload_segments

__all__ = ["pick", "rank_work", "tile_estimate", "Search", "SEARCH_TOKENS", "SEARCH_PIECES", "TILE_STEP", "PATH_STEP"]
__all__ += ["shorter_reference", "References"]

SEARCH_TOKENS = 1 << 18
"""Batches of at most this many tokens get the candidate search (a few milliseconds each);
larger ones, where planning time is largest and one pass already lands within 0.1 %, do not,
but for :data:`SEARCH_PIECES`."""
SEARCH_PIECES = 1 << 16
"""Larger batches get the search too where the dual-chunk split has at most this many pieces
(documents x 2·cp: up to 512 documents at cp 64): there one pass can land up to 0.0015 above
dual-chunk's work (a long document's cuts at tile multiples move a visible share of a rank's
work), and the search costs 20-65 ms of host time at 1M tokens and cp 64. With more
documents, dual-chunk's own split is no more even than the pass (both about 0.1 %)."""
WORK_BOUND = 1.03
"""Largest work max/mean a candidate may have (the balance's goal)."""
WORK_SLACK = 5e-4
"""How far a candidate's work max/mean may exceed the dual-chunk split's and still count as
balanced as it: about one token's share of a rank's work at a few hundred tokens per rank."""
TILE_STEP = True
"""Whether :func:`pick` ends with the exact tile step (off: the estimates' pick alone)."""
PATH_STEP = True
"""Whether :func:`pick` ends with the reference step (:func:`shorter_reference`)."""
PATH_GAIN = 0.97
"""A reference split replaces the pick only where its largest rank's tile area is at most
this share of the pick's: the area counts a partly masked tile as a full one, so a few
percent are left to what it does not see (a judgement, not a measured knee)."""
PATH_PIECES = 1 << 15
"""The reference step runs where dual-chunk's split has at most this many pieces (documents x
2·cp): its work, the step's bound, is then scored in a few milliseconds."""
PATH_PAIRS = 1 << 16
"""The contiguous and dual-chunk references are counted exactly where their pieces pair up at
most this many times (documents x pieces per document squared): the count grows with that
product (about 10 ms for both at cp 64 on one document); the in-order split, a piece or two
per rank, is always counted."""
TOLERANCES = (TOLERANCE, 0.0, 3 * TOLERANCE)
"""Work misses the stream's candidates accept for tile-aligned cuts (the first is the default)."""

Segs = list[np.ndarray]


class _Scorer:
    """Scores candidates of one batch: the per-batch geometry (units, their lengths and
    unsharded tile areas) is computed once and shared by every candidate."""

    def __init__(self, lens: np.ndarray, mask: MaskSpec) -> None:
        self.lens, self.mask = lens, mask
        if mask.chunk is None:
            self.first_unit, unit_n = np.arange(len(lens)), lens.astype(np.int64)
        else:  # (sequence, chunk) ids packed in the order of chunk_units' ids
            count = -(-lens // mask.chunk)
            self.first_unit = np.cumsum(count) - count
            seq = np.repeat(np.arange(len(lens)), count)
            c = np.arange(len(seq)) - self.first_unit[seq]
            unit_n = np.minimum(lens[seq] - c * mask.chunk, mask.chunk)
        full = np.ones(len(unit_n), np.int64)
        self.area = tile_area(unit_n, unit_n, full * mask.left, full * mask.right)
        self.own = (unit_n + TILE - 1) // TILE

    def __call__(self, per_rank: Segs) -> tuple[np.ndarray, float]:
        """``(work per rank, estimated tile area)`` of one candidate (see :func:`rank_work`
        and :func:`tile_estimate`, which this equals)."""
        lo, up = bounds(self.mask)
        rank, s, e, n, cid = _units(self.lens, per_rank, self.mask.chunk, self.first_unit)
        w = work_prefix(n, e, lo, up) - work_prefix(n, s, lo, up)
        work = np.bincount(rank, weights=w.astype(float), minlength=len(per_rank))
        keep = e > s
        cid, rows = cid[keep], (e[keep] - s[keep] + TILE - 1) // TILE
        present = np.bincount(cid, minlength=len(self.own)) > 0
        rows = np.bincount(cid, weights=rows, minlength=len(self.own))[present]
        area, own = self.area[present], self.own[present]
        return work, float((area * (rows / np.maximum(own, 1)) ** 2).sum())


def _units(lens: np.ndarray, per_rank: Segs, chunk: int | None, first_unit: np.ndarray | None = None):
    """``(rank, start, end, unit length, unit)`` of every piece, cut at chunks; positions are
    within the unit; ``unit`` indexes the packed units when ``first_unit`` (each sequence's
    first unit) is given."""
    seg = np.concatenate(per_rank) if per_rank else np.zeros((0, 3), np.int64)
    rank = np.repeat(np.arange(len(per_rank)), [len(p) for p in per_rank])
    src, unit, s, e = chunk_units(seg[:, 0], seg[:, 1], seg[:, 2], chunk)
    if chunk is None:
        u0, n = np.zeros_like(s), lens[seg[src, 0]]
    else:
        u0 = s // chunk * chunk
        n = np.minimum(lens[seg[src, 0]] - u0, chunk)
        if first_unit is not None:
            unit = first_unit[seg[src, 0]] + s // chunk
    return rank[src], s - u0, e - u0, n, unit


def rank_work(lens: np.ndarray, per_rank: Segs, mask: MaskSpec) -> np.ndarray:
    """Exact visible (query, key) pairs of every rank's queries under ``mask``."""
    lo, up = bounds(mask)
    rank, s, e, n, _ = _units(lens, per_rank, mask.chunk)
    w = work_prefix(n, e, lo, up) - work_prefix(n, s, lo, up)
    return np.bincount(rank, weights=w.astype(float), minlength=len(per_rank))


def tile_estimate(lens: np.ndarray, per_rank: Segs, mask: MaskSpec) -> float:
    """Estimated tile area of the sharded batch: each unit's unsharded tile area scaled by the
    square of (its pieces' row tiles over its own)."""
    _, s, e, n, unit = _units(lens, per_rank, mask.chunk)
    keep = e > s
    unit, s, e, n = unit[keep], s[keep], e[keep], n[keep]
    ids, inv = np.unique(unit, return_inverse=True)
    rows = np.bincount(inv, weights=(e - s + TILE - 1) // TILE, minlength=len(ids))
    first = np.unique(inv, return_index=True)[1]
    nu = n[first]
    own = (nu + TILE - 1) // TILE
    area = tile_area(nu, nu, np.full(len(nu), mask.left), np.full(len(nu), mask.right))
    return float((area * (rows / np.maximum(own, 1)) ** 2).sum())


class Search:
    """The candidates of one batch: segments, exact work, estimated tiles, and the passes run
    (shared by :func:`pick` and the tile step, :func:`refine`)."""

    slack = WORK_SLACK
    bound_max = WORK_BOUND
    FIRST, DUAL = 0, 1
    """Indices of the two candidates every search starts with: the default workload pass and
    the dual-chunk split (the further passes follow them)."""

    def __init__(self, lens: np.ndarray, counts: list[int], mask: MaskSpec, dualchunk: Callable[[], Segs]) -> None:
        self.lens, self.counts, self.mask = lens, counts, mask
        self.traces: dict[bool, list[Step]] = {False: [], True: []}  # per direction, its first pass
        self.ran: dict[tuple[float, bool], float] = {}  # pass -> the bound it ran under
        self.score = _Scorer(lens, mask)
        self.cands: list[Segs] = []
        self.work: list[np.ndarray] = []
        self.tiles: list[float] = []
        self.imb: list[float] = []
        first = workload_segments(lens, counts, mask, trace=self.traces[False])
        self.ran[(TOLERANCE, False)] = float("inf")
        scored = self.score(first)
        self.mean = max(scored[0].mean(), 1e-30)  # every candidate's: the batch's work over the ranks
        self._add(first, scored)
        self._add(dualchunk())

    def dualchunk(self) -> Segs:
        """The dual-chunk split, the search's second candidate."""
        return self.cands[self.DUAL]

    def _add(self, segs: Segs, scored: tuple[np.ndarray, float] | None = None) -> None:
        work, tiles = self.score(segs) if scored is None else scored
        self.cands.append(segs)
        self.work.append(work)
        self.tiles.append(tiles)
        self.imb.append(work.max() / self.mean)

    def unsharded_area(self) -> float:
        """Tile area of the batch unsharded (every unit whole)."""
        return float(self.score.area.sum())

    def run(self, tol: float, rev: bool, bound: float | None) -> None:
        """One more pass (``rev``: ranks served in reverse order), added if it completes;
        ``bound``: stop it at the first rank whose work max/mean would exceed it."""
        if self.ran.get((tol, rev), -1.0) >= (float("inf") if bound is None else bound):
            return
        self.ran[(tol, rev)] = float("inf") if bound is None else bound
        give_up = None if bound is None else (lambda w: w / self.mean > bound)
        counts = self.counts[::-1] if rev else self.counts
        trace = self.traces[rev]
        kw = dict(replay=trace) if trace else dict(trace=trace)
        c = workload_segments(self.lens, counts, self.mask, tol, give_up=give_up, **kw)
        if c is not None:
            self.ran[(tol, rev)] = float("inf")
            self._add(c[::-1] if rev else c)

    def passes(self, loose: tuple[float, ...] = ()) -> list[tuple[float, bool]]:
        """The search's passes: the tolerances, then the reversed one (skipped where the counts
        read the same both ways: it would be the first pass's ranks reversed); given ``loose``
        multiples of the tolerance, the reversed one and those, reversed where the counts are
        not symmetric (the reversed passes win most often), else forward."""
        rev = self.counts != self.counts[::-1]
        if loose:
            return [(TOLERANCE, True)] * rev + [(f * TOLERANCE, rev) for f in loose]
        return [(t, False) for t in TOLERANCES[1:]] + [(TOLERANCE, True)] * rev

    def choose(self) -> int:
        """Index of the candidate the estimates pick (see :func:`pick`)."""
        imb, tiles, a, d = self.imb, self.tiles, self.FIRST, self.DUAL
        bound = min(imb[d] + WORK_SLACK, WORK_BOUND)
        if imb[a] <= bound and (tiles[a] <= tiles[d] or imb[d] > bound):
            return a
        if imb[a] <= bound:  # trade tiles for at most one token's share of work, never more
            bound = min(bound, imb[a] + WORK_SLACK)
        # a pass with one rank over the bound is inadmissible; while one of the first two is
        # admissible, such a pass cannot be picked (else the least imbalanced one is)
        give_up = bound if min(imb) <= bound else None
        for tol, rev in self.passes():
            self.run(tol, rev, give_up)
        ok = [i for i in range(len(self.cands)) if imb[i] <= bound] or [int(np.argmin(imb))]
        return min((tiles[i], imb[i], i) for i in ok)[2]


def pick(
    lens: np.ndarray, counts: list[int], mask: MaskSpec, dualchunk: Callable[[], Segs], refs: References | None = None
) -> Segs:
    """Per rank segments: the default workload stream, or on small batches the best candidate.

    The stream and the dual-chunk split are scored first (one pass and a few vectorised sums);
    the other passes run only where the stream is not admissible or the dual-chunk split
    looks fuller, so most batches pay for one pass. Those passes reuse the first pass's probes
    while their choices agree, and stop at the first rank whose work already makes them
    inadmissible (they could not be picked); the reversed pass is skipped where the counts
    read the same both ways (it would be the first pass's ranks reversed: the same scores,
    never picked before the first). Where the pick then misses the tile goal, the tile step
    (:func:`refine`, when :data:`TILE_STEP`) compares exact tile areas. Last, on every batch,
    the reference step (:func:`shorter_reference`, when :data:`PATH_STEP` and ``refs`` are
    given). ``dualchunk`` is the mask's even-work reference split (the search's candidate, and
    the reference step's work bound)."""
    if not counts:
        return workload_segments(lens, counts, mask)
    if sum(counts) > SEARCH_TOKENS and np.count_nonzero(lens) * 2 * len(counts) > SEARCH_PIECES:
        segs = workload_segments(lens, counts, mask)
    else:
        search = Search(lens, counts, mask, dualchunk)
        chosen = search.choose()
        segs = refine(search, chosen) if TILE_STEP else search.cands[chosen]
        dualchunk = search.dualchunk  # already built (and scored) by the search
    if PATH_STEP and refs is not None:
        segs = shorter_reference(lens, counts, mask, segs, dualchunk, refs)
    return segs


class References(NamedTuple):
    """The plain splits :func:`shorter_reference` weighs a pick against besides the dual-chunk
    one (:func:`pick`'s own reference under the masks the step runs for), each built only where
    the step needs it."""

    contiguous: Callable[[], Segs]
    """Slice r of every sequence (``balance="contiguous"``)."""
    in_order: Callable[[], Segs]
    """The batch cut in its packed order: rank r the ``counts[r]`` tokens after rank r - 1's."""


def shorter_reference(
    lens: np.ndarray, counts: list[int], mask: MaskSpec, segs: Segs, dualchunk: Callable[[], Segs], refs: References
) -> Segs:
    """``segs``, or the reference split whose ``p2p`` layer is no longer on any count a
    sharding decides and shorter on the main ones.

    Only under a sliding window or chunks (the cheap positions are few there and a rank's work
    is flat in between, so plain splits are balanced up to the window's first keys), only
    where a document spans ranks, and only where dual-chunk's pieces are few enough to score
    (:data:`PATH_PIECES`). The references are the in-order split and, where their pieces pair
    up few times (:data:`PATH_PAIRS`), the contiguous and dual-chunk ones. A reference is
    admissible where its work max/mean meets the goal (:data:`WORK_BOUND`) and is no more
    than :data:`WORK_SLACK` above dual-chunk's — the balance's own promises. It wins where its
    largest rank's exact tile area, ring steps, sent rows and received rows
    (:func:`.tile_pick.rank_paths`) are none of them more than the pick's, and its area is at
    most :data:`PATH_GAIN` of the pick's or its steps fewer: tokens are equal either way, so
    the layer's critical path is then shorter. The shortest winner is kept (area, then steps,
    then rows)."""
    if mask.left < 0 and mask.chunk is None:
        return segs
    cp, docs = len(counts), int(np.count_nonzero(lens))
    if lens.max(initial=0) <= max(counts) or docs * 2 * cp > PATH_PIECES:
        return segs
    dual = dualchunk()  # the mask's even-work split: dual-chunk under a window or chunks
    work_dual = rank_work(lens, dual, mask)
    mean = max(work_dual.mean(), 1e-30)  # every split's (exact pair counts: the same sum)
    imb_dual = work_dual.max() / mean
    bound = min(WORK_BOUND, imb_dual + WORK_SLACK)
    cands = [(refs.in_order(), None)]
    if docs * cp * cp <= PATH_PAIRS:
        cands.append((refs.contiguous(), None))
    if docs * 4 * cp * cp <= PATH_PAIRS:
        cands.append((dual, imb_dual))
    ok = [c for c, imb in cands if (rank_work(lens, c, mask).max() / mean if imb is None else imb) <= bound]
    if not ok:
        return segs
    top = [x.max(axis=1) for x in rank_paths([segs, *ok], mask)]  # largest rank's area, steps, rows
    best = None
    for k in range(1, len(ok) + 1):
        no_more = all(x[k] <= x[0] for x in top)
        shorter = top[0][k] <= PATH_GAIN * top[0][0] or top[1][k] < top[1][0]
        if no_more and shorter and (best is None or [x[k] for x in top] < [x[best] for x in top]):
            best = k
    return segs if best is None else ok[best - 1]


def refine(search: Search, chosen: int) -> Segs:
    """The picked candidate, or, where it misses the tile goal by at most :data:`REACH`, the
    admissible candidate with the smallest largest-rank tile area (then total area, work,
    order)."""
    a, d = search.FIRST, search.DUAL
    useful = float(search.work[a].sum())
    need = max(useful / GOAL, search.unsharded_area() / GOAL_OF_ONE)  # largest total area meeting the goal
    if chosen == d or len(search.counts) > MAX_RANKS or search.tiles[chosen] > REACH * ESTIMATE_HIGH * need:
        return search.cands[chosen]  # dual-chunk's pieces (every document on every rank) stay
    area = rank_tiles([search.cands[chosen]], search.mask)[0]
    if not need < area.sum() <= REACH * need:
        return search.cands[chosen]
    imb = search.imb
    if imb[d] <= search.bound_max or len(search.lens) == 1:  # dual-chunk's rules and the slack hold
        bound = min(imb[d] + search.slack, search.bound_max)
        if imb[a] <= bound:
            bound = min(bound, imb[a] + search.slack)
        passes = search.passes()
    else:  # only the 3 % goal binds
        bound, passes = search.bound_max, search.passes(LOOSE)
    for tol, rev in passes:
        search.run(tol, rev, bound)
    ok = [k for k in range(len(search.cands)) if k not in (a, d, chosen) and imb[k] <= bound]
    if not ok:
        return search.cands[chosen]
    areas = rank_tiles([search.cands[k] for k in ok], search.mask)
    best = (int(area.max()), int(area.sum()), imb[chosen], -1, chosen)
    for k, a in zip(ok, areas, strict=True):
        best = min(best, (int(a.max()), int(a.sum()), imb[k], k, k))
    return search.cands[best[-1]]
