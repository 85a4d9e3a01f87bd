"""The ``workload`` balance on small ranks: a few candidate shardings, scored on the host.

With a few hundred or thousand tokens per rank, equal counts force cuts through most
documents, and where those cuts land decides both the attention work per rank and how full
the flash tiles are; one greedy pass can then come out slightly less balanced than the plain
dual-chunk split, or waste tiles a neighbouring choice would not. On batches of at most
:data:`SEARCH_TOKENS` tokens (where one more pass costs a few milliseconds; larger batches
are left alone so planning time does not grow where it is largest), :func:`pick` scores
these candidates exactly in work and approximately in tiles:

* the workload stream with its default tolerance, with a tighter and a looser one, and with
  the ranks served in reverse order (the last ranks absorb earlier misses: another set of
  boundaries);
* the dual-chunk split (``balance="dualchunk"``).

and keeps the candidate with the fewest estimated tiles among the admissible ones: work max/mean within
:data:`WORK_BOUND`, not above the dual-chunk split's by more than :data:`WORK_SLACK`, nor (where
the default pass meets those) above the default's by more. So
``workload`` is as balanced as ``dualchunk`` there, while a ten-thousandth of work (one
token's share on such ranks) never costs a quarter of the tile efficiency.

Tiles are estimated per unit (document, or chunk under chunked attention) from its pieces'
row tiles: a unit cut into pieces of lengths ``l_i`` occupies ``sum(ceil(l_i / 128))`` row
(and key) tiles instead of ``ceil(n / 128)``, and its tile area grows with their square.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .geometry import TILE, bounds, chunk_units, tile_area, work_prefix
from .masks import MaskSpec
from .workload import TOLERANCE, workload_segments

__all__ = ["pick", "rank_work", "tile_estimate", "SEARCH_TOKENS"]

SEARCH_TOKENS = 1 << 18
"""Batches of at most this many tokens get the candidate search (a few milliseconds each);
larger ones, where planning time is largest and one pass already lands within 0.1 %, do not."""
WORK_BOUND = 1.03
"""Largest work max/mean a candidate may have (the balance's goal)."""
WORK_SLACK = 5e-4
"""How far a candidate's work max/mean may exceed the dual-chunk split's and still count as
balanced as it: about one token's share of a rank's work at a few hundred tokens per rank."""
TOLERANCES = (TOLERANCE, 0.0, 3 * TOLERANCE)
"""Work misses the stream's candidates accept for tile-aligned cuts (the first is the default)."""

Segs = list[np.ndarray]


def _units(lens: np.ndarray, per_rank: Segs, chunk: int | None):
    """``(rank, unit, start, end, unit start, unit length)`` of every piece, cut at chunks."""
    seg = np.concatenate(per_rank) if per_rank else np.zeros((0, 3), np.int64)
    rank = np.repeat(np.arange(len(per_rank)), [len(p) for p in per_rank])
    src, unit, s, e = chunk_units(seg[:, 0], seg[:, 1], seg[:, 2], chunk)
    if chunk is None:
        u0, n = np.zeros_like(s), lens[seg[src, 0]]
    else:
        u0 = s // chunk * chunk
        n = np.minimum(lens[seg[src, 0]] - u0, chunk)
    return rank[src], unit, s - u0, e - u0, n


def rank_work(lens: np.ndarray, per_rank: Segs, mask: MaskSpec) -> np.ndarray:
    """Exact visible (query, key) pairs of every rank's queries under ``mask``."""
    lo, up = bounds(mask)
    rank, _, s, e, n = _units(lens, per_rank, mask.chunk)
    w = work_prefix(n, e, lo, up) - work_prefix(n, s, lo, up)
    return np.bincount(rank, weights=w.astype(float), minlength=len(per_rank))


def tile_estimate(lens: np.ndarray, per_rank: Segs, mask: MaskSpec) -> float:
    """Estimated tile area of the sharded batch: each unit's unsharded tile area scaled by the
    square of (its pieces' row tiles over its own)."""
    _, unit, s, e, n = _units(lens, per_rank, mask.chunk)
    keep = e > s
    unit, s, e, n = unit[keep], s[keep], e[keep], n[keep]
    ids, inv = np.unique(unit, return_inverse=True)
    rows = np.bincount(inv, weights=(e - s + TILE - 1) // TILE, minlength=len(ids))
    first = np.unique(inv, return_index=True)[1]
    nu = n[first]
    own = (nu + TILE - 1) // TILE
    area = tile_area(nu, nu, np.full(len(nu), mask.left), np.full(len(nu), mask.right))
    return float((area * (rows / np.maximum(own, 1)) ** 2).sum())


def pick(lens: np.ndarray, counts: list[int], mask: MaskSpec, dualchunk: Callable[[], Segs]) -> Segs:
    """Per rank segments: the default workload stream, or on small batches the best candidate.

    The stream and the dual-chunk split are scored first (one pass and a few vectorised sums);
    the other passes run only where the stream is not admissible or the dual-chunk split
    looks fuller, so most batches pay for one pass."""
    first = workload_segments(lens, counts, mask)
    if not counts or sum(counts) > SEARCH_TOKENS:
        return first
    cands = [first, dualchunk()]
    work = [rank_work(lens, c, mask) for c in cands]
    imb = [w.max() / max(w.mean(), 1e-30) for w in work]
    tiles = [tile_estimate(lens, c, mask) for c in cands]
    bound = min(imb[1] + WORK_SLACK, WORK_BOUND)
    if imb[0] <= bound and (tiles[0] <= tiles[1] or imb[1] > bound):
        return first
    more = [workload_segments(lens, counts, mask, t) for t in TOLERANCES[1:]]
    more.append(workload_segments(lens, counts[::-1], mask)[::-1])
    for c in more:
        w = rank_work(lens, c, mask)
        cands.append(c)
        imb.append(w.max() / max(w.mean(), 1e-30))
        tiles.append(tile_estimate(lens, c, mask))
    if imb[0] <= bound:  # trade tiles for at most one token's share of work, never more
        bound = min(bound, imb[0] + WORK_SLACK)
    ok = [i for i in range(len(cands)) if imb[i] <= bound] or [int(np.argmin(imb))]
    return cands[min((tiles[i], imb[i], i) for i in ok)[2]]
