"""Row sets: sorted, disjoint, half-open row ranges of a buffer, and planned row selections.

The p2p ring plan describes every transfer as a row set of the owner's KV block; these are
the few set operations it needs (host only, once per micro-batch) and :class:`Rows`, the
device-side form of a selection: a slice when contiguous (a view, no copy), else an index
uploaded once per device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["RowSet", "merge", "size", "clip", "minus", "relative", "Rows"]

RowSet = list[tuple[int, int]]


def merge(ranges: Sequence[tuple[int, int]]) -> RowSet:
    """Any ranges -> a row set (sorted, disjoint, touching ranges joined)."""
    out: RowSet = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def size(rs: RowSet) -> int:
    """Number of rows."""
    return sum(b - a for a, b in rs)


def clip(rs: RowSet, lo: int, hi: int) -> RowSet:
    """``rs ∩ [lo, hi)``."""
    i = max(bisect.bisect_right(rs, (lo, lo)) - 1, 0)
    out = []
    for a, b in rs[i:]:
        if a >= hi:
            break
        if b > lo:
            out.append((max(a, lo), min(b, hi)))
    return out


def minus(a: RowSet, b: RowSet) -> RowSet:
    out: RowSet = []
    for lo, hi in a:
        cur = lo
        for x, y in clip(b, lo, hi):
            if x > cur:
                out.append((cur, x))
            cur = y
        if cur < hi:
            out.append((cur, hi))
    return out


def relative(outer: RowSet, inner: RowSet) -> RowSet:
    """Where the rows of ``inner`` (a subset of ``outer``) sit in a buffer packing ``outer``."""
    starts, offs, off = [], [], 0
    for a, b in outer:
        starts.append(a)
        offs.append(off)
        off += b - a
    out = []
    for a, b in inner:
        i = bisect.bisect_right(starts, a) - 1
        out.append((offs[i] + a - starts[i], offs[i] + b - starts[i]))
    return merge(out)


@dataclass
class Rows:
    """A planned selection of buffer rows: a slice (a view, no copy) when contiguous."""

    n: int
    sl: tuple[int, int] | None = None
    idx: torch.Tensor | None = None
    _dev: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, rs: RowSet) -> Rows:
        rs = merge(rs)
        if len(rs) <= 1:
            return cls(size(rs), rs[0] if rs else None)
        return cls(size(rs), None, torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in rs]))

    def index_on(self, device: torch.device) -> torch.Tensor | None:
        """The gather index on ``device`` (uploaded once), or None for a slice."""
        if self.idx is None:
            return None
        key = str(device)
        if key not in self._dev:
            self._dev[key] = self.idx.to(device, non_blocking=True)
        return self._dev[key]

    def rows(self) -> list[int]:
        """The selected rows, in order (for plan checks)."""
        if self.idx is not None:
            return self.idx.tolist()
        return list(range(*self.sl)) if self.sl else []
