"""Host-side attention plans: for one rank and one KV buffer, the exact varlen kernel calls.

A *layout* says which global (sequence, position) ranges sit at which rows of a buffer. Given
the layout of this rank's queries and of a KV buffer (a ring step's block, the gathered
keys, ...), :func:`plan_step` emits the list of :class:`VarlenCall` s that compute every
visible (query, key) pair exactly once and nothing else. Everything here runs once per
micro-batch on the host; the index tensors it builds are uploaded once per device and
reused by every layer and by the backward.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .masks import Block, MaskSpec, visible_blocks
from .sharding import Segment

__all__ = ["Piece", "Layout", "VarlenCall", "StepPlan", "layout_of", "plan_step"]


class Piece(NamedTuple):
    """Positions ``[start, end)`` of sequence ``seq`` stored at rows ``[row, row + end - start)``."""

    seq: int
    start: int
    end: int
    row: int


Layout = list[Piece]


def layout_of(segments: Iterable[Segment], row0: int = 0) -> Layout:
    """Layout of a buffer holding ``segments`` back to back from row ``row0``."""
    out, row = [], row0
    for s in segments:
        out.append(Piece(s.seq, s.start, s.end, row))
        row += s.length
    return out


def _runs(layout: Layout) -> dict[int, list[list[Piece]]]:
    """Per sequence, maximal runs of position-adjacent pieces (rows may jump)."""
    by_seq: dict[int, list[Piece]] = defaultdict(list)
    for p in layout:
        if p.end > p.start:
            by_seq[p.seq].append(p)
    runs: dict[int, list[list[Piece]]] = {}
    for seq, pieces in by_seq.items():
        pieces.sort(key=lambda p: p.start)
        cur = [pieces[0]]
        out = [cur]
        for p in pieces[1:]:
            if p.start == cur[-1].end:
                cur.append(p)
            else:
                cur = [p]
                out.append(cur)
        runs[seq] = out
    return runs


def rows_of(run: list[Piece], start: int, end: int, out: list | None = None) -> list[tuple[int, int]]:
    """Row ranges holding positions ``[start, end)`` of a run, in position order, merged
    (appended to ``out`` when given, merging with its last range)."""
    out = [] if out is None else out
    for p in run:
        a, b = max(start, p.start), min(end, p.end)
        if a < b:
            r0, r1 = p.row + a - p.start, p.row + b - p.start
            if out and out[-1][1] == r0:
                out[-1] = (out[-1][0], r1)
            else:
                out.append((r0, r1))
    return out


@dataclass
class VarlenCall:
    """One flash-attn varlen call: entries of (query rows, key rows) with one mask alignment."""

    causal: bool
    window: tuple[int, int]
    q_rows: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per entry, row ranges of the query buffer (position order)."""
    k_rows: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per entry, row ranges of the KV buffer (position order)."""
    q_index: torch.Tensor | None = None
    """Query rows gathered for the call, or None when they are ``q_slice``."""
    q_slice: tuple[int, int] | None = None
    k_index: torch.Tensor | None = None
    k_slice: tuple[int, int] | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    def _finalize(self) -> None:
        self.q_index, self.q_slice = _index_or_slice(r for e in self.q_rows for r in e)
        self.k_index, self.k_slice = _index_or_slice(r for e in self.k_rows for r in e)
        lq = [sum(b - a for a, b in e) for e in self.q_rows]
        lk = [sum(b - a for a, b in e) for e in self.k_rows]
        self.cu_seqlens_q = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.cu_seqlens_k = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.max_seqlen_q, self.max_seqlen_k = max(lq), max(lk)

    def to(self, device: torch.device) -> VarlenCall:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return VarlenCall(
            self.causal, self.window, self.q_rows, self.k_rows,
            move(self.q_index), self.q_slice, move(self.k_index), self.k_slice,
            move(self.cu_seqlens_q), move(self.cu_seqlens_k), self.max_seqlen_q, self.max_seqlen_k,
        )  # fmt: skip


def expand_rows(ranges: list[tuple[int, int]]) -> list[int]:
    """Row ranges -> the rows, in order (for plan checks)."""
    return [i for a, b in ranges for i in range(a, b)]


def _index_or_slice(ranges: Iterable[tuple[int, int]]) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
    """A contiguous, ordered set of rows becomes a slice (no gather, no copy)."""
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    if len(merged) == 1:
        return None, merged[0]
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in merged]), None


@dataclass
class StepPlan:
    """All calls of one step (this rank's queries against one KV buffer)."""

    calls: list[VarlenCall]
    _device_calls: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> list[VarlenCall]:
        """The calls with index tensors on ``device``, uploaded once and cached."""
        key = str(device)
        if key not in self._device_calls:
            self._device_calls[key] = [c.to(device) for c in self.calls]
        return self._device_calls[key]

    @property
    def empty(self) -> bool:
        return not self.calls


class _Entry(NamedTuple):
    seq: int
    qs: int
    qe: int
    k_pos: list[tuple[int, int]]
    causal: bool
    window: tuple[int, int]


def _entries(q_layout: Layout, kv_layout: Layout, mask: MaskSpec) -> list[tuple[_Entry, list, list]]:
    q_runs, k_runs = _runs(q_layout), _runs(kv_layout)
    out = []
    for seq, qruns in q_runs.items():
        for qrun in qruns:
            qs, qe = qrun[0].start, qrun[-1].end
            blocks: list[tuple[Block, list[Piece]]] = []
            for krun in k_runs.get(seq, []):
                blocks += [(b, krun) for b in visible_blocks(mask, qs, qe, krun[0].start, krun[-1].end)]
            # Fully visible blocks of one query range fuse into one entry: key order is free there.
            full: dict[tuple[int, int], list[tuple[Block, list[Piece]]]] = defaultdict(list)
            for b, krun in blocks:
                if not b.causal and b.window == (-1, -1):
                    full[(b.qs, b.qe)].append((b, krun))
                else:
                    e = _Entry(seq, b.qs, b.qe, [(b.ks, b.ke)], b.causal, b.window)
                    out.append((e, rows_of(qrun, b.qs, b.qe), rows_of(krun, b.ks, b.ke)))
            for (a, b), group in full.items():
                krows = [r for blk, krun in group for r in rows_of(krun, blk.ks, blk.ke)]
                e = _Entry(seq, a, b, [(blk.ks, blk.ke) for blk, _ in group], False, (-1, -1))
                out.append((e, rows_of(qrun, a, b), krows))
    return out


def plan_step(q_layout: Layout, kv_layout: Layout, mask: MaskSpec) -> StepPlan:
    """Varlen calls for queries laid out as ``q_layout`` against keys laid out as ``kv_layout``.

    Entries with the same mask alignment share a call unless their query rows overlap (each
    call's output rows must be distinct so the merge is a plain row update).
    """
    calls: list[VarlenCall] = []
    # per call: per sequence, sorted disjoint query position intervals already used
    used: list[dict[int, list[tuple[int, int]]]] = []
    for e, qrows, krows in _entries(q_layout, kv_layout, mask):
        for ci, call in enumerate(calls):
            if (call.causal, call.window) != (e.causal, e.window):
                continue
            ivs = used[ci].setdefault(e.seq, [])
            i = bisect.bisect_left(ivs, (e.qs, e.qe))
            if (i > 0 and ivs[i - 1][1] > e.qs) or (i < len(ivs) and ivs[i][0] < e.qe):
                continue
            ivs.insert(i, (e.qs, e.qe))
            break
        else:
            calls.append(VarlenCall(e.causal, e.window))
            used.append({e.seq: [(e.qs, e.qe)]})
            ci = len(calls) - 1
        calls[ci].q_rows.append(qrows)
        calls[ci].k_rows.append(krows)
    for c in calls:
        c._finalize()
    return StepPlan(calls)
