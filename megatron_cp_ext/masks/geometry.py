"""Vectorised mask geometry: band blocks, visible-pair counts and chunk units, on numpy arrays.

Every plan is built from the same three questions, asked for thousands of (query range, key
range) pairs at once, so they are answered here on arrays instead of one Python call per
pair (that is what keeps a plan for 1M tokens at cp 64 in milliseconds):

* :func:`band_blocks` — the exact cover of a pair's visible (q, k) set by flash-expressible
  blocks (the array form of :func:`.masks.visible_blocks`, which stays the readable spec);
* :func:`band_count` — how many (q, k) pairs a band admits (work, useful tile entries);
* :func:`chunk_units` — chunked attention as re-segmentation: ranges are cut at chunk
  boundaries and each piece gets the *unit* (sequence, chunk) it belongs to, after which a
  chunked mask is a plain band inside each unit.

Conventions: positions are within a sequence; a band is ``q - lo <= k <= q + up`` where an
unbounded side is :data:`BIG`. All arrays are int64.
"""

from __future__ import annotations

import numpy as np

from . import MaskSpec

__all__ = ["BIG", "bounds", "band_blocks", "band_count", "chunk_units", "work_prefix", "tile_area"]

BIG = 1 << 40
"""Stands for an unbounded window side; large enough that no position arithmetic reaches it."""

TILE = 128
"""Flash tile edge (queries x keys) used for tile accounting and piece alignment."""


def bounds(mask: MaskSpec) -> tuple[int, int]:
    """``(lo, up)`` of the mask's band with :data:`BIG` for an unbounded side."""
    lo = BIG if mask.lower is None else mask.lower
    up = BIG if mask.upper is None else mask.upper
    return lo, up


def _sum_range(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``sum(range(u, v))`` elementwise (0 where ``v <= u``)."""
    v = np.maximum(u, v)
    return (v * (v - 1) - u * (u - 1)) // 2


def band_count(nq, nk, shift, lo: int, up: int) -> np.ndarray:
    """Pairs ``(i, j)`` with ``0 <= i < nq``, ``0 <= j < nk`` and
    ``i + shift - lo <= j <= i + shift + up``: the visible entries of one band block.

    ``shift`` is where query 0's diagonal meets the keys (``nk - nq`` for a flash entry,
    ``0`` for a whole unit). Closed form, so counting a 1M-token document costs nothing.
    """
    nq, nk, shift = (np.asarray(x, dtype=np.int64) for x in (nq, nk, shift))
    a, b = shift + min(up, BIG), shift - min(lo, BIG)  # hi(i) = min(nk-1, i+a), lo(i) = max(0, i+b)
    i0 = np.clip(-a, 0, nq)  # rows before i0 see nothing (hi < 0)
    i1 = np.clip(nk - b, i0, nq)  # rows from i1 on see nothing (lo > nk - 1)
    m = np.clip(nk - 1 - a, i0, i1)  # hi slides below m, is nk - 1 from m on
    hi_sum = _sum_range(i0, m) + (m - i0) * a + (i1 - m) * (nk - 1)
    p = np.clip(-b, i0, i1)  # lo is 0 below p, slides from p on
    lo_sum = _sum_range(p, i1) + (i1 - p) * b
    return hi_sum - lo_sum + (i1 - i0)


def work_prefix(n, x, lo: int, up: int) -> np.ndarray:
    """Visible pairs of the first ``x`` queries of a unit of ``n`` tokens under band (lo, up)."""
    return band_count(x, n, 0, lo, up)


def band_blocks(qs, qe, ks, ke, lo: int, up: int):
    """The visible pairs of ``[qs, qe) x [ks, ke)`` under the band as one flash entry per pair.

    Returns ``(pair, bqs, bqe, bks, bke, causal, left, right)``, one row per pair that has
    visible keys (``pair`` indexes the input). Queries are trimmed to those that see a key and
    keys to those some query sees; then the band is exactly flash's bottom-right window
    ``(left, right)`` of the entry, whose clamping to the entry's keys does the rest — no
    split at the points where a bound stops sliding. Sides that never bind are -1 (so fully
    visible entries are plain full entries) and ``right == 0`` is reported as causal.
    """
    qs, qe, ks, ke = (np.asarray(x, dtype=np.int64) for x in (qs, qe, ks, ke))
    a = np.maximum(qs, ks - up)  # first query that sees key ks
    b = np.minimum(qe, ke + lo)  # one past the last query that sees key ke - 1
    k0 = np.maximum(ks, a - lo)  # first key a query of [a, b) sees
    k1 = np.minimum(ke, b + up)  # one past the last
    keep = (a < b) & (k0 < k1)
    pair = np.nonzero(keep)[0]
    a, b, k0, k1 = a[keep], b[keep], k0[keep], k1[keep]
    sq, sk = b - a, k1 - k0
    c = sk - sq  # bottom-right diagonal of the entry
    left = np.minimum(lo, BIG) + k1 - b  # flash window: query i sees keys [i + c - left, i + c + right]
    right = np.minimum(up, BIG) + b - k1
    left = np.where((lo >= BIG) | ((sq - 1) + c - left <= 0), -1, left)  # lower bound never binds
    right = np.where((up >= BIG) | (c + right >= sk - 1), -1, right)  # upper bound never binds
    causal = right == 0
    return pair, a, b, k0, k1, causal, left, right


def chunk_units(seq, start, end, chunk: int | None):
    """Cut ranges at chunk boundaries: ``(src, unit, start, end)``, one row per piece.

    ``src`` indexes the input rows; ``unit`` identifies (sequence, chunk) — without chunks it
    is the sequence. Pieces keep positions within the sequence.
    """
    seq, start, end = (np.asarray(x, dtype=np.int64) for x in (seq, start, end))
    if chunk is None:
        return np.arange(len(seq)), seq.copy(), start.copy(), end.copy()
    first = start // chunk
    count = np.where(end > start, (end - 1) // chunk - first + 1, 1)
    src = np.repeat(np.arange(len(seq)), count)
    offs = np.arange(len(src)) - np.repeat(np.cumsum(count) - count, count)
    c = first[src] + offs
    s = np.maximum(start[src], c * chunk)
    e = np.minimum(end[src], (c + 1) * chunk)
    e = np.maximum(s, e)
    return src, seq[src] * (1 << 32) + c, s, e


def tile_area(nq, nk, left, right) -> np.ndarray:
    """Score entries a flash kernel visits per entry: 128x128 tiles touched by the entry's
    bottom-right window ``(left, right)`` (-1 = unbounded; tiles anchored at the entry's first
    query and key), times the tile area."""
    nq, nk, left, right = (np.asarray(x, dtype=np.int64) for x in (nq, nk, left, right))
    rows = (nq + TILE - 1) // TILE
    e = np.repeat(np.arange(len(nq)), rows)
    i = np.arange(len(e)) - np.repeat(np.cumsum(rows) - rows, rows)
    shift = (nk - nq)[e]
    r0 = i * TILE
    r1 = np.minimum(r0 + TILE, nq[e]) - 1
    hi = np.where(right[e] >= 0, np.minimum(nk[e] - 1, r1 + shift + right[e]), nk[e] - 1)
    lo = np.where(left[e] >= 0, np.maximum(0, r0 + shift - left[e]), 0)
    tiles = np.where(hi >= lo, hi // TILE - lo // TILE + 1, 0)
    return np.bincount(e, weights=tiles, minlength=len(nq)).astype(np.int64) * TILE * TILE
