"""``balance="workload"``: documents whole where possible, tile-aligned pieces where needed,
per-rank attention work and tokens both balanced under the mask.

The work of a query depends only on its position and its document's length (how many keys
the mask lets it see), never on where the query is placed, so a rank's work is a sum over
the ranges it holds, in closed form (:func:`.geometry.work_prefix`). Every rank must end
with the batch's average *density* (work per token), but units differ in density (a causal
document of n tokens averages about n/2). So, as dual-chunk pairs a sequence's early chunks
with its late ones, the balance pairs light material with dense material, batch-wide:

* units (documents; under chunked attention, chunks of them) are sorted by density;
  *short* ones stay whole, *long* ones (more than :data:`ALPHA` of a rank's work or tokens)
  are divisible at multiples of 128 positions;
* ranks are filled in order, each from both ends of the sorted list: whole units (or the
  front of a long one) from the light end, then from the dense end whole units while they
  fit and finally a **front and a back piece** of a long unit. The back is dense (late
  queries see many keys), the front light; the light share, the back size and the front
  size are searched so the rank's work lands on its target first and its tokens on theirs
  second (within a few tiles) — fine tuning that whole documents alone cannot give;
* targets are what is left divided by the ranks left, so a miss is spread over the ranks
  after it instead of piling up on the last one.

A long unit is taken in order by the ranks that reach it, fronts ascending and backs
descending: every rank holds at most two pieces of it, adjacent in its local order, so each
transfer of its KV is one slice. Deterministic, host-only, a few dozen cheap evaluations
per rank; no communication.
"""

from __future__ import annotations

import functools

import numpy as np

from .geometry import BIG, TILE, bounds, work_prefix
from .masks import MaskSpec

__all__ = ["workload_segments", "unit_table", "ALPHA"]

ALPHA = 0.05
"""A unit whose work or tokens exceed this share of one rank's is divisible (cut in pieces):
small enough that whole units are fine steps, large enough that short documents stay whole."""
TOKEN_WEIGHT = 0.1
"""How much a relative token miss counts against a relative work miss for one rank."""

Piece = tuple[int, int, int, int]
"""``(unit index, unit length, a, b)``: positions [a, b) of a unit of the stream."""


@functools.lru_cache(maxsize=1 << 16)
def _work(n: int, x: int, lo: int, up: int) -> int:
    """Scalar :func:`.geometry.work_prefix` (pure Python and memoised: the searches probe the
    same tile boundaries again and again)."""
    a, b = min(up, BIG), -min(lo, BIG)
    i0 = min(max(-a, 0), x)
    i1 = min(max(n - b, i0), x)
    m = min(max(n - 1 - a, i0), i1)
    s = lambda u, v: (v * (v - 1) - u * (u - 1)) // 2  # noqa: E731 - sum(range(u, v))
    p = min(max(-b, i0), i1)
    return s(i0, m) + (m - i0) * a + (i1 - m) * (n - 1) - s(p, i1) - (i1 - p) * b + (i1 - i0)


def unit_table(lens: np.ndarray, chunk: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seq, start, length)`` of the mask's independent units: whole sequences, or their
    chunks under chunked attention (no query sees across a chunk boundary)."""
    seq = np.arange(len(lens), dtype=np.int64)
    if chunk is None:
        return seq, np.zeros_like(seq), lens.astype(np.int64)
    count = (lens + chunk - 1) // chunk
    useq = np.repeat(seq, count)
    k = np.arange(len(useq)) - np.repeat(np.cumsum(count) - count, count)
    start = k * chunk
    return useq, start, np.minimum(lens[useq] - start, chunk)


def _snap(x: int, base: int) -> int:
    """``x`` moved to the nearest tile boundary counted from ``base``."""
    return base + ((x - base + TILE // 2) // TILE) * TILE


class _Pour:
    """Units sorted by density, handed out from both ends; each unit shrinks from its ends.

    Entry k is positions ``[a[k], b[k])`` (still to hand out) of a unit. The light end ``L``
    gives whole units and cuts a divisible one front first; the dense end ``R`` gives whole
    units and cuts a divisible one into a front and a back piece.
    """

    def __init__(self, entries: list[tuple[int, int, int, int, int, bool]], lo: int, up: int) -> None:
        self.units = [e[:3] for e in entries]  # (seq, unit start, unit length)
        self.a = [e[3] for e in entries]
        self.b = [e[4] for e in entries]
        self.cut_ok = [e[5] for e in entries]
        self.lo, self.up = lo, up
        self.flat = lo < BIG  # sliding window: density is flat past the window, one piece per unit
        self.L, self.R = 0, len(entries) - 1
        self.rest = [self.work(k, self.a[k], self.b[k]) for k in range(len(entries))]  # work left per entry

    def work(self, k: int, x: int, y: int) -> int:
        n = self.units[k][2]
        return _work(n, y, self.lo, self.up) - _work(n, x, self.lo, self.up) if y > x else 0

    def light(self, tokens: float) -> tuple[list[Piece], dict, int, int]:
        """From the light end: whole entries while they fit, a divisible one cut front first."""
        out, moved, t, w, k = [], {}, 0, 0, self.L
        while k <= self.R and tokens - t >= TILE / 2:
            a, b = self.a[k], self.b[k]
            if b - a <= tokens - t + TILE // 2:
                y, wy = b, self.rest[k]
            elif self.cut_ok[k]:
                y = min(b, _snap(a + int(tokens - t), a))
                wy = self.work(k, a, y)
            else:
                break
            if y > a:
                out.append((k, self.units[k][2], a, y))
                moved[k] = y
                t, w = t + y - a, w + wy
            if y < b:
                break
            k += 1
        return out, moved, t, w

    def dense(self, front: int, back: int, moved: dict) -> tuple[list[Piece], int, int]:
        """From the dense end (after what the light end ``moved``): ``back`` tokens off the back
        and ``front`` tokens off the front of the densest entry, whole entries when they fit."""
        out, t, w, k = [], 0, 0, self.R
        while k >= self.L and front + back - t >= TILE / 2:
            a, b = moved.get(k, self.a[k]), self.b[k]
            left = front + back - t
            if b <= a:
                k -= 1
                continue
            if b - a <= left + TILE // 2:
                pieces = [(a, b)]
                if a == self.a[k]:  # untouched by the light end: its work is known
                    out.append((k, self.units[k][2], a, b))
                    t, w = t + b - a, w + self.rest[k]
                    k -= 1
                    continue
            elif self.cut_ok[k]:
                share = front / max(front + back, 1)
                f = min(b, _snap(a + int(left * share), a))
                p = b if not back else min(b, b - (left - (f - a)))
                p = p if p == b else min(b, max(f, _snap(p, a)))
                pieces = [(a, f), (p, b)]
            else:
                break
            for x, y in pieces:
                if y > x:
                    out.append((k, self.units[k][2], x, y))
                    t, w = t + y - x, w + self.work(k, x, y)
            if len(pieces) == 2:
                break
            k -= 1
        return out, t, w

    def commit(self, pieces: list[Piece], dest: list[tuple[int, int, int, int, int]]) -> None:
        for k, n, x, y in pieces:
            seq, start, _ = self.units[k]
            dest.append((k, int(x > 0 or y < n), seq, start + x, start + y))
            if x == self.a[k]:
                self.a[k] = y
            elif y == self.b[k]:
                self.b[k] = x
            else:
                raise AssertionError("pieces are cut from an entry's ends")
            self.rest[k] = self.work(k, self.a[k], self.b[k])
        while self.L <= self.R and self.a[self.L] >= self.b[self.L]:
            self.L += 1
        while self.R >= self.L and self.a[self.R] >= self.b[self.R]:
            self.R -= 1

    def fill(self, want_t: float, want_w: float) -> tuple[list[Piece], int, int]:
        """One rank: light tokens chosen so an even dense split lands near ``want_w``; then the
        dense back size near that, and its front size (light tiles: fine steps) searched for the
        work. Work is hit first; tokens stay within a few tiles of their share."""

        lights: dict = {}

        def light(y: float):
            if y not in lights:
                lights[y] = self.light(y)
            return lights[y]

        def total(y: float, front: int, back: int):
            lp, moved, lt, lw = light(y)
            dp, dt, dw = self.dense(front, back, moved)
            return lp + dp, lt + dt, lw + dw

        def even(y: float):
            x = int(max(want_t - light(y)[2], 0))
            return total(y, x, 0) if self.flat else total(y, x // 2, x - x // 2)

        lo_y, hi_y = 0.0, want_t  # more light: less work
        while hi_y - lo_y > TILE / 4:
            mid = (lo_y + hi_y) / 2
            lo_y, hi_y = (mid, hi_y) if even(mid)[2] >= want_w else (lo_y, mid)
        best = None
        for y in (lo_y, hi_y):
            x = int(max(want_t - light(y)[2], 0))
            for back in (0,) if self.flat else sorted({max(0, x // 2 + d * TILE) for d in (-1, 0, 1)}):
                lo_f, hi_f = 0, int(want_t) + TILE  # more front: more work (and tokens)
                while hi_f - lo_f > TILE // 2:
                    mid = (lo_f + hi_f) // 2
                    lo_f, hi_f = (mid, hi_f) if total(y, mid, back)[2] <= want_w else (lo_f, mid)
                for front in (lo_f, hi_f):
                    cand = total(y, front, back)
                    miss_t = abs(cand[1] - want_t) / max(want_t, 1.0)
                    err = abs(cand[2] - want_w) / max(want_w, 1.0) + TOKEN_WEIGHT * miss_t
                    if best is None or err < best[0]:
                        best = (err, cand)
        return best[1]


def workload_segments(lens: np.ndarray, cp: int, mask: MaskSpec) -> list[np.ndarray]:
    """Per rank ``[k, 3]`` ``(seq, start, end)`` segments of the workload balance."""
    lo, up = bounds(mask)
    useq, ustart, ulen = unit_table(lens, mask.chunk)
    uwork = work_prefix(ulen, ulen, lo, up)
    tt, wt = float(ulen.sum()) / cp, float(uwork.sum()) / cp
    long = (ulen >= 2 * TILE) & ((uwork > ALPHA * wt) | (ulen > ALPHA * tt))
    units = np.nonzero(ulen > 0)[0]
    units = units[np.lexsort((units, uwork[units] / ulen[units]))]  # lightest first
    entries = [(int(useq[u]), int(ustart[u]), int(ulen[u]), 0, int(ulen[u]), bool(long[u])) for u in units]
    pour = _Pour(entries, lo, up)
    pieces: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(cp)]
    left_t, left_w = float(ulen.sum()), float(uwork.sum())
    for r in range(cp):
        if r == cp - 1:  # the last rank takes the rest
            pour.commit(pour.light(BIG)[0], pieces[r])
            break
        chosen, t, w = pour.fill(left_t / (cp - r), left_w / (cp - r))
        pour.commit(chosen, pieces[r])
        left_t, left_w = left_t - t, left_w - w
    return [_merge_adjacent(seg) for seg in _local_order(pieces, lo)]


def _local_order(pieces: list[list[tuple[int, int, int, int, int]]], window: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's ranges in local order: whole units first (by sequence), then the pieces of cut
    units, each unit's pieces adjacent in position order, units ordered by their run's first
    rank, then its last: the units a rank shares with any one peer are then adjacent, so each
    step's rows are one slice. Under a sliding window ``window``, ranges longer than it come
    last."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for r, ps in enumerate(pieces):
        for k, cut, *_ in ps:
            if cut:
                first.setdefault(k, r)
                last[k] = r
    out = []
    for r, ps in enumerate(pieces):
        # ranges longer than a sliding window (their own calls carry the window) go after the
        # others, so each of the own block's two alignments covers consecutive rows
        def key(p, r=r):
            # one order on every rank (so a sender's buffer and its receiver's queries agree):
            # by the run's first rank, then its last. Units shared with a lower peer o (first
            # <= o) are then a prefix, and those shared with a higher one (last >= o) a suffix.
            return (p[4] - p[3] > window + 1, p[1], first.get(p[0], r), last.get(p[0], r), p[2:])

        out.append([p[2:] for p in sorted(ps, key=key)])
    return out


def _merge_adjacent(segs: list[tuple[int, int, int]]) -> np.ndarray:
    """Join position-adjacent ranges of one sequence (consecutive chunk units)."""
    out: list[list[int]] = []
    for s, a, b in segs:
        if out and out[-1][0] == s and out[-1][2] == a:
            out[-1][2] = b
        else:
            out.append([s, a, b])
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)
