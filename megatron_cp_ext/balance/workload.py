"""``balance="workload"``: equal tokens per rank, balanced attention work, documents whole.

A layer's linear work follows tokens and its attention follows visible pairs, so every rank
must get its token count exactly (the counts :func:`.sharding.rank_counts` deals out) *and*
the batch's average work per token. The work of a query depends only on its position and its
document's length (how many keys the mask lets it see), never on where the query is placed,
so a rank's work is a sum over the ranges it holds, in closed form (:func:`.geometry.work_prefix`).

The balance is a dual-chunk split of one **stream**: the mask's independent units (documents,
or their chunks under chunked attention) laid end to end, sorted by density (work per token,
lightest first). Inside a unit density never falls with position under causal, causal
windowed, chunked or unmasked attention, so the stream's front is its lightest material and
its back its densest. Under a non-causal finite left window it falls near a unit's end (a
bidirectional sliding window is ∩-shaped, low near both ends): each unit then enters the
stream as two halves split on its plateau, the second traversed in mirrored position order,
both rising (:mod:`.workload_mirror`); their pieces map back to contiguous ranges at the end.
Rank after rank takes exactly its token count as ``x`` tokens off the front plus ``t - x``
off the back; more front means less work, so ``x`` is found by bisection to land on
the rank's work target (what is left divided in proportion to the tokens left).

* Units stay whole except where a rank boundary falls: at most two cuts per rank, so short
  documents are almost never cut and their KV never travels.
* Where a cut costs nothing, it sits at a multiple of 128 positions or at a unit boundary:
  among the nearby ``x`` whose cuts are tile-aligned, the one within :data:`TOLERANCE` of the
  target is taken (flash tiles stay full).
* The remainders of cut units are sorted back into the stream, so its ends stay its lightest
  and densest material, and a target is always reachable.
* One long document is the dual-chunk split of its positions; a long document among short ones
  is eaten from its back by consecutive ranks, each holding at most two pieces of it.

Deterministic, host-only, a few dozen closed-form evaluations per rank; no communication.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..masks import MaskSpec
from ..masks.geometry import BIG, TILE, bounds, work_prefix
from .workload_mirror import halves, mirror_split, unmirror
from .workload_order import local_order, merge_adjacent

__all__ = ["workload_segments", "unit_table", "Step", "Probes", "TOLERANCE"]

TOLERANCE = 1e-3
"""Relative work miss a rank accepts to keep its cuts at tile multiples (the misses of
earlier ranks are spread over the later ones, so the worst rank stays within a few of them)."""

LONG = 8
"""Units longer than this many tiles are long: a cut inside one costs more than in a short one."""
SPAN = 8
"""Tile-aligned positions tried on each side of a dense cut (each pairs with its own front piece)."""
Entry = tuple[float, int, int, int]
"""``(density, unit, a, b)``: positions [a, b) of a unit, still in the stream."""


Side = tuple[list[Entry], list[int], list[int]]
"""Entries off one end of the stream covering a rank's count, with cumulative tokens and work."""


class Probes(NamedTuple):
    """What one take evaluated: another pass at the same stream, count and target reuses it."""

    front: Side
    """The light end."""
    back: Side
    """The dense end."""
    cost: dict
    """``x -> (work, cut cost)`` of ``x`` tokens off the front and the rest off the back."""
    three: dict
    """``(y, q) -> {i: (work, cut cost, x) or None}``: the probes of :meth:`_Stream._three`."""


class Step(NamedTuple):
    """One rank's take in a pass (see ``trace`` and ``replay`` of :func:`workload_segments`)."""

    t: int
    """Tokens the rank took."""
    probes: Probes | None
    """What the take evaluated (None for an empty rank)."""
    decision: tuple
    """Its choice, ``(x, f, cut entry)``: equal choices leave equal streams."""


@functools.lru_cache(maxsize=1 << 16)
def _work(n: int, x: int, lo: int, up: int) -> int:
    """Visible pairs of the first ``x`` queries of a unit of ``n`` tokens under band (lo, up)
    (scalar :func:`.geometry.work_prefix`, pure Python and memoised: the searches probe the
    same boundaries again and again; branches instead of min/max calls, as it is hot)."""
    a = up if up < BIG else BIG
    b = -lo if lo < BIG else -BIG
    i0 = -a if -a > 0 else 0
    if i0 > x:
        i0 = x
    i1 = n - b if n - b > i0 else i0
    if i1 > x:
        i1 = x
    m = n - 1 - a if n - 1 - a > i0 else i0
    if m > i1:
        m = i1
    p = -b if -b > i0 else i0
    if p > i1:
        p = i1
    s_m = (m * (m - 1) - i0 * (i0 - 1)) // 2  # sum(range(i0, m))
    s_p = (i1 * (i1 - 1) - p * (p - 1)) // 2  # sum(range(p, i1))
    return s_m + (m - i0) * a + (i1 - m) * (n - 1) - s_p - (i1 - p) * b + (i1 - i0)


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


class _Stream:
    """The sorted stream: entries (pieces of units) lightest first; ranks take from both ends."""

    def __init__(self, ulen: np.ndarray, uwork: np.ndarray, lo: int, up: int, tolerance: float,
                 params: list[tuple[int, int, int]] | None = None, phase: list[int] | None = None) -> None:  # fmt: skip
        self.ulen, self.tolerance = ulen.tolist(), tolerance
        # per unit: (n, lo, up) of its work prefix ``_work(n, x, lo, up)`` and the traversal
        # positions that are tile multiples (``p % TILE == phase``); see .workload_mirror
        self.par = params if params is not None else [(n, lo, up) for n in self.ulen]
        self.phase = phase if phase is not None else [0] * len(self.ulen)
        self.mirrored = phase is not None  # units in halves: ``2u`` and ``2u + 1`` (.workload_mirror)
        self.probes: Probes | None = None  # the last take's
        self.decision: tuple = ()  # the last take's choice: (x, f, cut entry)
        units = np.nonzero(ulen > 0)[0]
        dens = uwork[units] / ulen[units]
        order = np.lexsort((units, dens))  # as the entries' tuples sort: density, then unit
        self.ents: list[Entry] = list(zip(dens[order].tolist(), units[order].tolist(), [0] * len(units),
                                          ulen[units][order].tolist(), strict=True))  # fmt: skip

    def work(self, k: int, x: int, y: int) -> int:
        n, lo, up = self.par[k]
        return _work(n, y, lo, up) - _work(n, x, lo, up) if y > x else 0

    def entry(self, k: int, a: int, b: int) -> Entry:
        return (self.work(k, a, b) / (b - a), k, a, b)

    def side(self, t: int, back: bool) -> tuple[list[Entry], list[int], list[int]]:
        """Entries from one end covering ``t`` tokens, with cumulative tokens and work."""
        ents, tok, wk = [], [0], [0]
        order = reversed(self.ents) if back else iter(self.ents)
        for e in order:
            if tok[-1] >= t:
                break
            ents.append(e)
            tok.append(tok[-1] + e[3] - e[2])
            wk.append(wk[-1] + self.work(e[1], e[2], e[3]))
        return ents, tok, wk

    def take(self, t: int, target: float, reuse: Probes | None = None) -> list[tuple[int, int, int]]:
        """One rank: ``t`` tokens, ``x`` off the front and ``t - x`` off the back, its work as
        close to ``target`` as a bisection on ``x`` gets; then tile-aligned cuts nearby.

        Every probe (the work and cut cost of one choice) is memoised in ``self.probes``; a pass
        that reaches the same stream with the same ``t`` and target passes them as ``reuse``
        and only redoes the choices (which depend on its tolerance)."""
        if reuse is None:
            reuse = Probes(self.side(t, False), self.side(t, True), {}, {})
        self.probes = reuse
        front, back, memo = reuse.front, reuse.back, reuse.cost
        fents, ftok, fwk = front
        bents, btok, bwk = back
        par, tol = self.par, self.tolerance

        def at_front(x: int) -> tuple[int, int, int | None]:
            """``(work, entry, cut)`` of ``x`` tokens off the front; ``cut`` is the position
            where the entry is cut, None at a boundary between entries."""
            j = bisect.bisect_right(ftok, x) - 1
            if x == ftok[j]:
                return fwk[j], j, None
            _, k, a, _ = fents[j]
            pos, (n, lo, up) = a + x - ftok[j], par[k]
            return fwk[j] + _work(n, pos, lo, up) - _work(n, a, lo, up), j, pos

        def at_back(y: int) -> tuple[int, int, int | None]:
            j = bisect.bisect_right(btok, y) - 1
            if y == btok[j]:
                return bwk[j], j, None
            _, k, _, b = bents[j]
            pos, (n, lo, up) = b - (y - btok[j]), par[k]
            return bwk[j] + _work(n, b, lo, up) - _work(n, pos, lo, up), j, pos

        def cost(x: int) -> tuple[int, int]:
            got = memo.get(x)
            if got is None:
                wf, jf, pf = at_front(x)
                wb, jb, pb = at_back(t - x)
                got = memo[x] = (wf + wb, self._ugly(fents, jf, pf) + self._ugly(bents, jb, pb))
            return got

        lo_x, hi_x = 0, t  # work falls as x grows
        if cost(0)[0] <= target:
            hi_x = 0
        elif cost(t)[0] >= target:
            lo_x = t
        while hi_x - lo_x > 1:
            mid = (lo_x + hi_x) // 2
            lo_x, hi_x = (mid, hi_x) if cost(mid)[0] >= target else (lo_x, mid)
        cands = {lo_x, hi_x}
        for (ents, tok, _), is_back in ((front, False), (back, True)):
            _, j, pos = at_back(t - lo_x) if is_back else at_front(lo_x)
            if pos is None:
                continue
            _, k, a, b = ents[j]
            ph = self.phase[k]
            for q in (a, b, (pos - ph) // TILE * TILE + ph, -(-(pos - ph) // TILE) * TILE + ph):  # ends, tiles
                q = min(max(q, a), b)
                x = tok[j] + (b - q if is_back else q - a)
                cands.add(t - x if is_back else x)
        best = None
        for x in sorted(c for c in cands if 0 <= c <= t):
            w, ugly = cost(x)
            err = abs(w - target) / max(target, 1.0)
            key = (ugly if err <= tol else 9, err)
            if best is None or key < best[0]:
                best = (key, x, 0, None)
        if best[0][0]:
            three = self._three(t, target, t - best[1], at_front, at_back)
            if three is not None and three[0] < best[0]:
                best = three
        self.decision = best[1:]
        return self._commit(front, back, best[1], t - best[1] - best[2], best[3], best[2])

    def _three(self, t: int, target: float, y: int, at_front, at_back):
        """The dense cut moved to a tile multiple and the miss made up by a tile-aligned front
        piece of the same unit (the dual-chunk shape): the rank's one unaligned cut is then on
        the light side, in a short document, instead of between pieces of a long one."""
        _, j, pos = at_back(y)
        (fents, ftok, fwk), (ents, tok, wk), memo = self.probes.front, self.probes.back, self.probes.three
        if pos is None or self._ugly(ents, j, pos) < 2:
            return None
        e = ents[j]
        _, k, a, b = e
        ulen, par, phase, tol = self.ulen, self.par, self.phase, self.tolerance
        n, lo, up = par[k]
        ph = phase[k]
        w_a = _work(n, a, lo, up)
        cap = ftok[fents.index(e)] if e in fents else ftok[-1]  # light tokens before e
        if self.mirrored:  # nor from the other half of e's unit (its third piece on the rank)
            cap = min([cap] + [ftok[i] for i, g in enumerate(fents) if g[1] == k ^ 1])
        best = None
        q0 = (pos - ph) // TILE * TILE + ph
        first = -(-(a + 1 - ph) // TILE) * TILE + ph  # the first tile multiple inside the entry
        for q in sorted(range(q0 - SPAN * TILE, q0 + (SPAN + 1) * TILE, TILE), key=lambda q: abs(q - pos)):
            if not a < q <= b:
                continue
            n_f = 1 + max(0, (q - first) // TILE + 1)  # front sizes: 0, then up to tile multiples <= q
            base = tok[j] + b - q
            fixed = wk[j] + self.work(k, q, b)

            seen = memo.setdefault((y, q), {})

            def total(i: int, base=base, fixed=fixed, seen=seen):
                """``(work, front cut cost, x)`` with the ``i``-th front piece; None where the
                light side cannot supply the rest (inlined probes: this is the hot loop)."""
                got = seen.get(i, seen)
                if got is seen:
                    f = 0 if i == 0 else first + (i - 1) * TILE - a
                    x = t - base - f
                    got = None
                    if 0 <= x <= cap:
                        jf = bisect.bisect_right(ftok, x) - 1
                        wf, ugly = fwk[jf], 0
                        if x != ftok[jf]:  # cut inside front entry jf (see _ugly)
                            _, kf, af, _ = fents[jf]
                            pf, (nf, lf, uf) = af + x - ftok[jf], par[kf]
                            wf += _work(nf, pf, lf, uf) - _work(nf, af, lf, uf)
                            if (pf - phase[kf]) % TILE and pf != ulen[kf]:
                                ugly = 2 if nf > LONG * TILE else 1
                        got = wf + fixed + (_work(n, a + f, lo, up) - w_a if f else 0), ugly, x
                    seen[i] = got
                return got

            lo_i, hi_i = 0, n_f - 1  # work grows with the front piece
            while hi_i - lo_i > 1:
                mid = (lo_i + hi_i) // 2
                got = total(mid)
                f = 0 if mid == 0 else first + (mid - 1) * TILE - a
                small = t - base - f > cap if got is None else got[0] <= target
                lo_i, hi_i = (mid, hi_i) if small else (lo_i, mid)
            for i in {lo_i, hi_i, min(hi_i + 1, n_f - 1)}:
                got = total(i)
                if got is not None:
                    err = abs(got[0] - target) / max(target, 1.0)
                    key = ((got[1] if err <= tol else 9), err)
                    if best is None or key < best[0]:
                        best = (key, got[2], 0 if i == 0 else first + (i - 1) * TILE - a, e)
            if best is not None and best[0][0] <= 1:  # within tolerance, one cut in a short document at most
                break
        return best

    def _ugly(self, ents: list[Entry], j: int, pos: int | None) -> int:
        """What a cut costs in flash tiles: 0 between entries, at a unit's end or at a tile
        multiple of its unit; 2 inside a long unit (all its pieces' blocks get a ragged edge);
        1 inside a short one."""
        if pos is None:
            return 0
        k = ents[j][1]
        if (pos - self.phase[k]) % TILE == 0 or pos == self.ulen[k]:
            return 0
        return 2 if self.par[k][0] > LONG * TILE else 1

    def _commit(self, front, back, x: int, y: int, cut: Entry | None, f: int) -> list[tuple[int, int, int]]:
        """Remove ``x`` tokens off the front and ``y`` off the back, and ``f`` off the front of
        entry ``cut`` (where the back cut falls); re-sort the remainders."""
        taken: dict[tuple[int, int, int], list[int]] = {}  # entry -> [a, b) still left
        out, touched = [], [0, 0]
        for (ents, tok, _), n, is_back in ((front, x, False), (back, y, True)):
            for i, e in enumerate(ents):
                if tok[i] >= n:
                    break
                touched[is_back] = i + 1
                _, k, a, b = e
                left = taken.setdefault(e[1:], [a, b])
                p = min(n - int(tok[i]), left[1] - left[0])
                piece = (k, left[1] - p, left[1]) if is_back else (k, left[0], left[0] + p)
                left[:] = [left[0], left[1] - p] if is_back else [left[0] + p, left[1]]
                out.append(piece)
        if f:
            touched[1] = max(touched[1], back[0].index(cut) + 1)
            left = taken.setdefault(cut[1:], [cut[2], cut[3]])
            out.append((cut[1], left[0], left[0] + f))
            left[0] += f
        nf, nb = touched  # the touched entries are a prefix and a suffix of the stream
        self.ents = self.ents[nf : len(self.ents) - nb] if nf + nb < len(self.ents) else []
        for (k, _, _), (a, b) in taken.items():
            if b > a:
                bisect.insort(self.ents, self.entry(k, a, b))
        return [p for p in out if p[2] > p[1]]


def workload_segments(
    lens: np.ndarray,
    counts: list[int],
    mask: MaskSpec,
    tolerance: float = TOLERANCE,
    *,
    trace: list[Step] | None = None,
    replay: list[Step] | None = None,
    give_up: Callable[[int], bool] | None = None,
) -> list[np.ndarray] | None:
    """Per rank ``[k, 3]`` ``(seq, start, end)`` segments: rank r holds ``counts[r]`` tokens;
    ``tolerance`` is the relative work miss a rank accepts for tile-aligned cuts.

    ``trace`` (a list) receives every rank's :class:`Step`. ``replay``, the trace of an earlier
    pass over the same lengths, counts and mask, lets this pass reuse that pass's probes for as
    long as its choices agree (the stream is then the same), redoing only the choices: the
    passes of :func:`.pick.pick` differ only in tolerance, so they share most probes.
    ``give_up(work)`` true of a rank's work ends the pass early with None (a search that
    already knows the pass cannot win)."""
    lo, up = bounds(mask)
    useq, ustart, ulen = unit_table(lens, mask.chunk)
    split = mirror_split(ulen, lo, up)
    if split is None:  # density never falls inside a unit: the units are the stream's
        vlen, vwork = ulen, work_prefix(ulen, ulen, lo, up)
        stream = _Stream(vlen, vwork, lo, up, tolerance)
    else:  # a non-causal finite window: each unit as two rising halves
        vlen, vwork, params, phase = halves(ulen, split, lo, up)
        stream = _Stream(vlen, vwork, lo, up, tolerance, params, phase)
    left_t, left_w = int(vlen.sum()), int(vwork.sum())
    per_rank: list[list[tuple[int, int, int]]] = []
    shared = replay is not None and len(replay) == len(counts)
    for r, t in enumerate(counts):
        t = int(t)
        target = left_w * t / left_t if left_t else 0.0
        shared = shared and replay[r].t == t
        pieces = stream.take(t, target, replay[r].probes if shared else None) if t else []
        step = Step(t, stream.probes, stream.decision) if t else Step(0, None, ())
        shared = shared and step.decision == replay[r].decision
        if trace is not None:
            trace.append(step)
        per_rank.append(pieces)
        work = sum(stream.work(k, a, b) for k, a, b in pieces)
        if give_up is not None and give_up(work):
            return None
        left_t -= t
        left_w -= work
    if split is not None:
        per_rank = unmirror(per_rank, ulen)
    cut = {k for ps in per_rank for k, a, b in ps if a > 0 or b < ulen[k]}
    tagged = [[(k, int(k in cut), int(useq[k]), int(ustart[k]) + a, int(ustart[k]) + b) for k, a, b in ps]
              for ps in per_rank]  # fmt: skip
    return [merge_adjacent(seg) for seg in local_order(tagged, lo)]
