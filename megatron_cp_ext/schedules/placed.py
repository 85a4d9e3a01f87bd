"""Accumulators for calls whose query rows do not overlap: partials copied into place.

Where every query row of a rank is in at most one call (``all_gather``'s document-ordered keys:
one or two calls whose rows partition the rank's queries), nothing needs merging: a merge into
an empty accumulator returns the partial exactly, so copying it into its rows in its own dtype
gives the same values without the fp32 accumulator, its zero fill, the merges and the final
rounding. :func:`placement` says, on the host at plan time, where that holds.
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import VarlenCall
from ..runtime.ops import floor_lse_, lse_floor
from .common import new_accumulators

__all__ = ["PlacedOut", "PlacedGrad", "KeptRows", "placement"]


class PlacedOut:
    """The forward's accumulator where every query row is in at most one call (``all_gather``'s
    document-ordered keys): each partial is copied into its rows in its own dtype — no fp32
    accumulator, no merge, nothing to round back. The same values as merging each partial into
    an empty accumulator (such a merge returns the partial exactly). A call over every row is
    adopted; ``covered`` (every row in some call) spares the zero fill that rows no call
    covers need (output 0, lse :data:`~..ops.LSE_FLOOR`)."""

    def __init__(self, q: torch.Tensor, dv: int, covered: bool) -> None:
        self.q, self.dv, self.covered = q, dv, covered
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def merge(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, o: torch.Tensor, lse_c: torch.Tensor) -> None:
        lse_c = floor_lse_(lse_c)
        t, h = self.q.shape[:2]
        if self.out is None:
            if sl == (0, t) and o.is_contiguous():
                self.out, self.lse = o, lse_c
                return
            if self.covered:
                self.out, self.lse = o.new_empty((t, h, self.dv)), lse_c.new_empty((t, h))
            else:
                self.out, self.lse = o.new_zeros((t, h, self.dv)), lse_c.new_full((t, h), lse_floor(lse_c.dtype))
        if sl is not None:
            self.out[sl[0] : sl[1]].copy_(o)
            self.lse[sl[0] : sl[1]].copy_(lse_c)
        else:
            self.out.index_copy_(0, idx, o)
            self.lse.index_copy_(0, idx, lse_c)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:  # no call: no query sees a key
            return new_accumulators(self.q, self.dv)
        return self.out, self.lse


class PlacedGrad:
    """:class:`PlacedOut`'s twin for a gradient whose rows each come from at most one call
    (dq of those calls): each partial is copied into its rows in its own dtype (``0 + x`` is
    ``x``); rows no call covers are 0."""

    def __init__(self, like: torch.Tensor, covered: bool, into: torch.Tensor | None = None) -> None:
        self.like, self.covered = like, covered
        self.t: torch.Tensor | None = None
        self._into = into
        """A caller's buffer (``like``'s shape; a head group's slice) to copy into instead."""

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        if self.t is None and self._into is not None:
            self.t, self._into = self._into, None
            if not self.covered:
                self.t.zero_()
        if self.t is None:
            if sl == (0, self.like.shape[0]) and src.shape == self.like.shape and src.is_contiguous():
                self.t = src
                return
            self.t = (src.new_empty if self.covered else src.new_zeros)(self.like.shape)
        if sl is not None:
            self.t[sl[0] : sl[1]].copy_(src)
        else:
            self.t.index_copy_(0, idx, src)

    def result(self) -> torch.Tensor:
        if self.t is None and self._into is not None:
            self.t, self._into = self._into.zero_(), None
        return self.t if self.t is not None else torch.zeros_like(self.like)


class KeptRows:
    """dK or dV partials of ``all_gather``'s kept KV rows placed straight at their gathered rows
    of ``dst`` (one half of the zero-filled fp32 buffer the reduce-scatter sums), widened, where
    every kept row is in at most one call: no kept-row accumulator, no adds, no copy between."""

    def __init__(self, dst: torch.Tensor, keep: torch.Tensor) -> None:
        self.dst, self.keep = dst, keep

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        rows = self.keep[sl[0] : sl[1]] if sl is not None else self.keep.index_select(0, idx)
        self.dst.index_copy_(0, rows, src.to(self.dst.dtype))


def placement(calls: list[VarlenCall], rows: int, side: str = "q") -> tuple[bool, bool]:
    """``(once, covered)`` of a step's calls (host, at plan time): whether every query row
    (``side="k"``: key row) is in at most one call entry, and whether also every one of the
    ``rows`` rows is in one. Where ``once``, :class:`PlacedOut` and :class:`PlacedGrad` copy
    partials into place (:class:`KeptRows` for keys)."""
    if not calls:
        return True, rows == 0
    cols = slice(0, 2) if side == "q" else slice(2, 4)
    e = np.concatenate([c.entries[:, cols] for c in calls])
    e = e[e[:, 1] > e[:, 0]]
    e = e[np.argsort(e[:, 0], kind="stable")]
    once = bool((e[1:, 0] >= e[:-1, 1]).all())
    return once, once and int((e[:, 1] - e[:, 0]).sum()) == rows
