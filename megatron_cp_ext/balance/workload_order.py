"""Local order of the ``workload`` balance's ranges on each rank (see :mod:`.workload`): the
same order on every rank, so that what a peer sends and what this rank's queries expect line
up, and each p2p step's rows are one slice."""

from __future__ import annotations

import numpy as np

__all__ = ["local_order", "merge_adjacent"]


def local_order(pieces: list[list[tuple[int, int, int, int, int]]], window: int) -> list[list[tuple[int, int, int]]]:
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


def merge_adjacent(segs: list[tuple[int, int, int]]) -> np.ndarray:
    """Join position-adjacent ranges of one sequence (consecutive chunk units)."""
    out: list[list[int]] = []
    for s, a, b in segs:
        if out and out[-1][0] == s and out[-1][2] == a:
            out[-1][2] = b
        else:
            out.append([s, a, b])
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)
