"""Units whose density falls (a non-causal finite left window's) as two rising halves.

The ``workload`` stream (:mod:`.workload`) needs the work per token of every unit to never
fall in the order the unit is eaten: its front must be its lightest material and its back
its densest. Under a band ``q - lo <= k <= q + up`` a token at position ``p`` of an
``n``-token unit sees ``min(n - 1, p + up) - max(0, p - lo) + 1`` keys: that rises while the
left bound does not bind and falls once the right one is clamped by the unit's end while the
left one still slides. Causal, left-unbounded and unmasked bands never fall; a non-causal
band with a finite left side (a bidirectional sliding window) is ∩-shaped, low near both ends
of a unit (falling throughout when its right side is unbounded).

Such a unit becomes two halves split on its plateau: ``[0, m)`` in position order and
``[m, n)`` eaten in mirrored order (position ``p`` read as ``n - 1 - p``, where the band's
sides swap), each rising in its own order. A contiguous range of a mirrored half is a
contiguous range of positions, so pieces map straight back (:func:`unmirror`).
"""

from __future__ import annotations

import numpy as np

from ..masks.geometry import TILE, work_prefix
from .workload_order import merge_adjacent

__all__ = ["mirror_split", "halves", "unmirror"]


def mirror_split(ulen: np.ndarray, lo: int, up: int) -> np.ndarray | None:
    """Per unit the split ``m`` (``n``: rises throughout, ``0``: falls throughout, mirrored
    whole), or None where no unit's density falls (the stream is then unchanged).

    Density rises up to ``rise = max(lo, n - 1 - up)`` and falls from ``fall = min(lo, n - 1
    - up)`` on, so any ``m`` in ``[fall, rise + 1]`` works; the tile multiple nearest the
    middle is taken where there is one (the split is a cut wherever the halves part)."""
    n = ulen.astype(np.int64)
    rise = np.minimum(n - 1, np.maximum(lo, n - 1 - up))
    if not (rise[n > 0] < n[n > 0] - 1).any():
        return None
    fall = np.maximum(0, np.minimum(lo, n - 1 - up))
    first, last = -(-fall // TILE) * TILE, (rise + 1) // TILE * TILE  # tile multiples in range
    mid = np.clip((n + TILE) // (2 * TILE) * TILE, first, last)
    m = np.where(first <= last, mid, np.clip(n // 2, fall, rise + 1))
    m = np.where(fall == 0, 0, m)
    return np.where((rise >= n - 1) | (n == 0), n, m)


def halves(ulen: np.ndarray, m: np.ndarray, lo: int, up: int):
    """``(length, work, params, phase)`` of the halves, unit ``u``'s at ``2u`` (rising part)
    and ``2u + 1`` (mirrored part); ``params[v] = (n, lo, up)`` gives a half's work prefix as
    ``_work(n, x, lo, up)`` and ``phase[v]`` the traversal positions that are tile multiples
    in the unit (``p % TILE == phase``)."""
    n = ulen.astype(np.int64)
    vlen = np.stack([m, n - m], axis=1).reshape(-1)
    vwork = np.stack([work_prefix(n, m, lo, up), work_prefix(n, n - m, up, lo)], axis=1).reshape(-1)
    params = [p for k in n.tolist() for p in ((k, lo, up), (k, up, lo))]
    phase = [p for k in n.tolist() for p in (0, k % TILE)]
    return vlen, vwork, params, phase


def unmirror(per_rank: list[list[tuple[int, int, int]]], ulen: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """Pieces ``(half, a, b)`` in traversal order back to ``(unit, start, end)`` positions,
    position-adjacent pieces of one unit on one rank joined (a unit whose halves both stay
    whole on a rank is whole again)."""
    out = []
    for ps in per_rank:
        units = sorted((v // 2, a, b) if v % 2 == 0 else (v // 2, int(ulen[v // 2]) - b, int(ulen[v // 2]) - a)
                       for v, a, b in ps)  # fmt: skip
        out.append([(int(u), int(a), int(b)) for u, a, b in merge_adjacent(units)])
    return out
