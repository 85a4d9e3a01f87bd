"""Host-side attention plans: for one rank's queries and some KV buffers, the exact varlen calls.

A :class:`Layout` says which global (sequence, position) ranges sit at which rows of which buffer
(the own KV block, a received block, the gathered keys, ...). :func:`plan_steps` turns the queries'
layout and the buffers' layout into, per buffer, the list of :class:`VarlenCall` s that compute every
visible (query, key) pair exactly once and nothing else. Everything runs once per micro-batch on the
host, on numpy arrays (thousands of ranges per call, no Python loop per range); index tensors are
uploaded once per device and reused by every layer and by the backward.

How entries become calls, cheapest first (design: "plans shaped for the GPU"):

* **compressed causal** — under a causal mask, a query set and a key set that are the same pieces of
  one sequence (the own block of a rank holding several pieces) are one causal entry, whatever the
  gaps between the pieces: causality only compares positions;
* **fused full blocks** — fully visible blocks with the same query rows and adjacent key rows (or the
  same key rows and adjacent query rows) are one entry;
* **slice calls** — a call's entries, sorted by query row, must be consecutive in both the
  query and the key buffer; then the call runs on two slices (views, no copy). A group that
  breaks into at most :data:`MAX_SLICE_CALLS` such runs becomes that many calls; anything
  more fragmented becomes one call on gathered rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import MaskSpec
from ..masks.geometry import BIG, band_blocks, bounds, chunk_units
from .levels import interval_levels

__all__ = ["Layout", "VarlenCall", "StepPlan", "plan_steps", "visible_rows", "merge_ranges", "MAX_SLICE_CALLS"]

MAX_SLICE_CALLS = 2
"""Most calls one (buffer, mask alignment) group is split into to avoid a gather."""

_I64 = np.int64


@dataclass
class Layout:
    """Buffers' contents: row ``i`` holds positions ``[start[i], end[i])`` of ``seq[i]`` at rows
    ``[row[i], row[i] + end[i] - start[i])`` of buffer ``buf[i]``."""

    seq: np.ndarray
    start: np.ndarray
    end: np.ndarray
    row: np.ndarray
    buf: np.ndarray

    @classmethod
    def packed(cls, seq, start, end, *, row0: int = 0, buf: int = 0) -> Layout:
        """Ranges stored back to back from row ``row0`` of buffer ``buf``."""
        seq, start, end = (np.asarray(x, dtype=_I64) for x in (seq, start, end))
        n = end - start
        row = row0 + np.cumsum(n) - n
        return cls(seq, start, end, row, np.full(len(seq), buf, dtype=_I64))

    @classmethod
    def concat(cls, parts: list[Layout]) -> Layout:
        if not parts:
            z = np.zeros(0, dtype=_I64)
            return cls(z, z, z, z, z)
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("seq", "start", "end", "row", "buf")))

    def __len__(self) -> int:
        return len(self.seq)


@dataclass
class VarlenCall:
    """One flash-attn varlen call: entries of (query rows, key rows) with one mask alignment."""

    causal: bool
    """Bottom-right causal (the window's right side is 0)."""
    window: tuple[int, int]
    """Flash ``(left, right)`` window, -1 = unbounded; every entry is aligned bottom-right."""
    entries: np.ndarray
    """``[E, 4]``: per entry ``q_lo, q_hi, k_lo, k_hi`` rows of the query and key buffers."""
    q_slice: tuple[int, int] | None = None
    """Query rows as one slice (a view), or None when they are gathered by ``q_index``."""
    q_index: torch.Tensor | None = None
    k_slice: tuple[int, int] | None = None
    k_index: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @classmethod
    def build(cls, window: tuple[int, int], entries: np.ndarray) -> VarlenCall:
        lq, lk = entries[:, 1] - entries[:, 0], entries[:, 3] - entries[:, 2]
        call = cls(window[1] == 0, window, entries)
        call.q_slice, call.q_index = _slice_or_index(entries[:, 0], entries[:, 1])
        call.k_slice, call.k_index = _slice_or_index(entries[:, 2], entries[:, 3])
        cq, ck = (torch.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lq, lk))
        call.cu_seqlens_q, call.cu_seqlens_k = cq, cq if np.array_equal(lq, lk) else ck  # equal entries: one tensor
        call.max_seqlen_q, call.max_seqlen_k = int(lq.max()), int(lk.max())
        return call

    @property
    def gathered_rows(self) -> int:
        """Rows copied for this call (query and key side), 0 for a slice call."""
        q = 0 if self.q_index is None else int(self.q_index.numel())
        return q + (0 if self.k_index is None else int(self.k_index.numel()))

    def to(self, device: torch.device) -> VarlenCall:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        cu_q = move(self.cu_seqlens_q)  # equal entries keep sharing it (cu_seqlens_k is cu_seqlens_q)
        return VarlenCall(
            self.causal, self.window, self.entries, self.q_slice, move(self.q_index), self.k_slice, move(self.k_index),
            cu_q, cu_q if self.cu_seqlens_k is self.cu_seqlens_q else move(self.cu_seqlens_k), self.max_seqlen_q,
            self.max_seqlen_k,
        )  # fmt: skip


def _slice_or_index(lo: np.ndarray, hi: np.ndarray) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """Rows ``[lo_i, hi_i)`` in order: a slice when consecutive, else a gather index."""
    if len(lo) == 1 or bool((lo[1:] == hi[:-1]).all()):
        return (int(lo[0]), int(hi[-1])), None
    n = hi - lo
    idx = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    return None, torch.from_numpy(idx.astype(np.int64))


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

    def __getstate__(self) -> dict:  # device copies never travel (plans are built in loaders)
        return {"calls": self.calls, "_device_calls": {}}


# ---- pieces ---------------------------------------------------------------------------------
@dataclass
class _Pieces:
    """Layout ranges cut at chunk boundaries and joined into runs, with their unit."""

    unit: np.ndarray
    start: np.ndarray
    end: np.ndarray
    row: np.ndarray
    buf: np.ndarray


def _pieces(lay: Layout, chunk: int | None, muted: frozenset[int] = frozenset()) -> _Pieces:
    src, unit, s, e = chunk_units(lay.seq, lay.start, lay.end, chunk)
    row, buf = lay.row[src] + (s - lay.start[src]), lay.buf[src]
    keep = (e > s) & ~np.isin(lay.seq[src], sorted(muted)) if muted else e > s  # muted sequences: no part
    unit, s, e, row, buf = unit[keep], s[keep], e[keep], row[keep], buf[keep]
    order = np.lexsort((row, buf))
    unit, s, e, row, buf = unit[order], s[order], e[order], row[order], buf[order]
    # join rows that continue the previous one in the buffer and in position
    cont = np.zeros(len(s), dtype=bool)
    same_place = (buf[1:] == buf[:-1]) & (row[1:] == row[:-1] + e[:-1] - s[:-1])
    cont[1:] = same_place & (unit[1:] == unit[:-1]) & (s[1:] == e[:-1])
    head = ~cont
    last = np.concatenate([np.nonzero(head)[0][1:] - 1, [len(s) - 1]]) if len(s) else np.zeros(0, _I64)
    return _Pieces(unit[head], s[head], e[last], row[head], buf[head]) if len(s) else _Pieces(unit, s, e, row, buf)


def _join(q: _Pieces, kv: _Pieces) -> tuple[np.ndarray, np.ndarray]:
    """All (query piece, key piece) index pairs of the same unit."""
    order = np.argsort(kv.unit, kind="stable")
    ku = kv.unit[order]
    lo = np.searchsorted(ku, q.unit, "left")
    cnt = np.searchsorted(ku, q.unit, "right") - lo
    qi = np.repeat(np.arange(len(q.unit)), cnt)
    ki = order[np.repeat(lo, cnt) + np.arange(len(qi)) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
    return qi, ki


def _groups(*keys: np.ndarray) -> np.ndarray:
    """Start flags of runs of equal keys (arrays already sorted by them)."""
    n = len(keys[0])
    flag = np.zeros(n, dtype=bool)
    if n:
        flag[0] = True
        for k in keys:
            flag[1:] |= k[1:] != k[:-1]
    return flag


def _compressed(q: _Pieces, kv: _Pieces) -> tuple[np.ndarray, np.ndarray]:
    """(buf, unit) groups whose query and key pieces are the same >= 2 pieces, each side in
    position order at consecutive rows: returns their ``(buf, unit)`` keys and entries."""
    qo = np.lexsort((q.start, q.unit))
    qu, qs, qe, qr = q.unit[qo], q.start[qo], q.end[qo], q.row[qo]
    qhead = _groups(qu)
    qcont = np.ones(len(qu), dtype=bool)
    qcont[1:] = qhead[1:] | (qr[1:] == qr[:-1] + qe[:-1] - qs[:-1])
    qfirst = np.nonzero(qhead)[0]
    qcount = np.diff(np.append(qfirst, len(qu)))
    qok = np.logical_and.reduceat(qcont, qfirst) if len(qfirst) else np.zeros(0, dtype=bool)

    ko = np.lexsort((kv.start, kv.unit, kv.buf))
    kb, ku, ks, ke, kr = kv.buf[ko], kv.unit[ko], kv.start[ko], kv.end[ko], kv.row[ko]
    khead = _groups(kb, ku)
    kcont = np.ones(len(ku), dtype=bool)
    kcont[1:] = khead[1:] | (kr[1:] == kr[:-1] + ke[:-1] - ks[:-1])
    kfirst = np.nonzero(khead)[0]
    if not len(kfirst) or not len(qfirst):
        return np.zeros((0, 2), _I64), np.zeros((0, 4), _I64)
    kcount = np.diff(np.append(kfirst, len(ku)))
    kok = np.logical_and.reduceat(kcont, kfirst)
    g = np.searchsorted(qu[qfirst], ku[kfirst])  # matching query group per key group
    g = np.minimum(g, len(qfirst) - 1)
    cand = (qu[qfirst][g] == ku[kfirst]) & (kcount >= 2) & kok & qok[g] & (qcount[g] == kcount)
    # elementwise comparison of the candidate groups' pieces
    kidx = np.repeat(kfirst, kcount)
    member = np.arange(len(ku)) - kidx
    qidx = qfirst[np.repeat(g, kcount)] + member
    qidx = np.minimum(qidx, len(qu) - 1)
    same = (qs[qidx] == ks) & (qe[qidx] == ke)
    cand &= np.logical_and.reduceat(same, kfirst)
    sel = np.nonzero(cand)[0]
    total = np.add.reduceat(ke - ks, kfirst)[sel]
    q0 = qr[qfirst[g[sel]]]
    k0 = kr[kfirst[sel]]
    keys = np.stack([kb[kfirst[sel]], ku[kfirst[sel]]], axis=1)
    return keys, np.stack([q0, q0 + total, k0, k0 + total], axis=1)


# ---- entries --------------------------------------------------------------------------------
def _fuse(buf, q0, q1, k0, k1, by_q: bool):
    """Fuse fully visible entries: same query rows and adjacent key rows (``by_q``), or same
    key rows and adjacent query rows."""
    if not len(buf):
        return buf, q0, q1, k0, k1
    a0, a1, b0, b1 = (q0, q1, k0, k1) if by_q else (k0, k1, q0, q1)
    order = np.lexsort((b0, a1, a0, buf))
    buf, a0, a1, b0, b1 = buf[order], a0[order], a1[order], b0[order], b1[order]
    head = _groups(buf, a0, a1)
    head[1:] |= b0[1:] != b1[:-1]
    first = np.nonzero(head)[0]
    last = np.append(first[1:], len(buf)) - 1
    out = buf[first], a0[first], a1[first], b0[first], b1[last]
    return out if by_q else (out[0], out[3], out[4], out[1], out[2])


def _entries(q: _Pieces, kv: _Pieces, mask: MaskSpec):
    """Arrays ``buf, q0, q1, k0, k1, left, right`` of exact entries (rows), fused; the flash
    window ``(left, right)`` is the entry's mask alignment (``right == 0``: causal)."""
    lo, up = bounds(mask)
    qi, ki = _join(q, kv)
    pair, a, b, bks, bke, _, left, right = band_blocks(q.start[qi], q.end[qi], kv.start[ki], kv.end[ki], lo, up)
    qi, ki = qi[pair], ki[pair]
    q0 = q.row[qi] + a - q.start[qi]
    k0 = kv.row[ki] + bks - kv.start[ki]
    buf, q1, k1, unit = kv.buf[ki], q0 + (b - a), k0 + (bke - bks), q.unit[qi]
    extra = np.zeros((0, 4), _I64)
    xbuf = np.zeros(0, _I64)
    if lo == BIG and up == 0:  # plain causal: same pieces on both sides -> one causal entry
        keys, extra = _compressed(q, kv)
        keep = ~np.isin(_code(buf, unit), _code(keys[:, 0], keys[:, 1]))
        buf, q0, q1, k0, k1, left, right = (x[keep] for x in (buf, q0, q1, k0, k1, left, right))
        xbuf = keys[:, 0]
    full = (left < 0) & (right < 0)
    f = [x[full] for x in (buf, q0, q1, k0, k1)]
    for _ in range(3):
        n = len(f[0])
        f = list(_fuse(*f, by_q=True))
        f = list(_fuse(*f, by_q=False))
        if len(f[0]) == n:
            break
    band, nx = ~full, len(xbuf)
    cat = lambda full_part, band_part, extra_part: np.concatenate([full_part, band_part, extra_part]).astype(_I64)  # noqa: E731
    none, ones = np.full(len(f[0]), -1), np.full(nx, -1)
    return (
        cat(f[0], buf[band], xbuf), cat(f[1], q0[band], extra[:, 0]), cat(f[2], q1[band], extra[:, 1]),
        cat(f[3], k0[band], extra[:, 2]), cat(f[4], k1[band], extra[:, 3]),
        cat(none, left[band], ones), cat(none, right[band], np.zeros(nx)),
    )  # fmt: skip


def _code(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 per (buffer, unit) pair (buffers < 2**20, units < 2**43)."""
    return a * (1 << 43) + b


# ---- calls ----------------------------------------------------------------------------------
def _disjoint(q0: np.ndarray, q1: np.ndarray, head: np.ndarray) -> bool:
    """Whether the query ranges of every group (entries sorted by group, then start) are disjoint."""
    gid = np.cumsum(head) - 1
    prev = np.concatenate([[-1], q1[:-1]])
    prev[head] = -1
    off = gid * (4 * BIG)  # keeps the running maximum inside each group
    return bool((q0 >= np.maximum.accumulate(prev + off) - off).all())


def _levels(q0: np.ndarray, q1: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Per entry (sorted by group, then query start) the call it goes to inside its group, so
    that no call repeats a query row (its output rows are updated in place)."""
    if _disjoint(q0, q1, head):
        return np.zeros(len(q0), _I64)
    # usual overlap: several entries with the very same query rows -> one call each
    same = _groups(np.cumsum(head), q0, q1)
    idx = np.arange(len(q0))
    level = idx - np.maximum.accumulate(np.where(same, idx, 0))
    order = np.lexsort((q0, level, np.cumsum(head)))
    if _disjoint(q0[order], q1[order], _groups(np.cumsum(head)[order], level[order])):
        return level
    return interval_levels(q0, q1, np.cumsum(head) - 1)  # general case: interval partitioning


def one_row_causal(buf: np.ndarray, q0: np.ndarray, q1: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``right``, one-row full entries made causal where their buffer has causal and no other full
    ones: one row sees every key either way, and their own call would split the causal rows."""
    full = (left < 0) & (right < 0)
    one = full & (q1 - q0 == 1)
    if not one.any():
        return right
    move = one & np.isin(buf, buf[(left < 0) & (right == 0)]) & ~np.isin(buf, buf[full & ~one])
    return np.where(move, 0, right)


def _calls(buf, q0, q1, k0, k1, left, right, max_slices: int) -> dict[int, list[VarlenCall]]:
    right = one_row_causal(buf, q0, q1, left, right)
    order = np.lexsort((k0, q0, right, left, buf))
    buf, q0, q1, k0, k1, left, right = (x[order] for x in (buf, q0, q1, k0, k1, left, right))
    level = _levels(q0, q1, _groups(buf, left, right))
    order = np.lexsort((k0, q0, level, right, left, buf))
    buf, q0, q1, k0, k1, left, right, level = (x[order] for x in (buf, q0, q1, k0, k1, left, right, level))
    head = _groups(buf, left, right, level)
    brk = head.copy()
    brk[1:] |= (q0[1:] != q1[:-1]) | (k0[1:] != k1[:-1])  # starts of slice runs
    starts = np.nonzero(head)[0]
    ends = np.append(starts[1:], len(buf))
    runs_per_call = np.add.reduceat(brk, starts) if len(starts) else np.zeros(0, _I64)
    entries = np.stack([q0, q1, k0, k1], axis=1)
    out: dict[int, list[VarlenCall]] = {}
    run_starts = np.nonzero(brk)[0]
    for c, (s, e) in enumerate(zip(starts, ends)):
        pieces = [(s, e)]
        if 1 < runs_per_call[c] <= max_slices:
            rs = run_starts[(run_starts >= s) & (run_starts < e)]
            pieces = list(zip(rs, np.append(rs[1:], e)))
        for a, b in pieces:
            call = VarlenCall.build((int(left[s]), int(right[s])), entries[a:b])
            out.setdefault(int(buf[s]), []).append(call)
    return out


def plan_steps(q: Layout, kv: Layout, mask: MaskSpec, max_slices: int = MAX_SLICE_CALLS) -> dict[int, StepPlan]:
    """Per KV buffer id, the calls of queries laid out as ``q`` against keys laid out as ``kv``
    (``max_slices``: see :data:`MAX_SLICE_CALLS`). Buffers whose keys no query sees get no
    entry (callers treat a missing id as empty)."""
    qp, kp = _pieces(q, mask.chunk, mask.muted), _pieces(kv, mask.chunk, mask.muted)
    calls = _calls(*_entries(qp, kp, mask), max_slices)
    return {b: StepPlan(c) for b, c in calls.items()}


def merge_ranges(key: np.ndarray, r0: np.ndarray, r1: np.ndarray):
    """Union of row ranges per key: ``(key, lo, hi)`` sorted, disjoint, touching ones joined."""
    keep = r1 > r0
    key, r0, r1 = key[keep], r0[keep], r1[keep]
    order = np.lexsort((r0, key))
    key, r0, r1 = key[order], r0[order], r1[order]
    if not len(key):
        return key, r0, r1
    head = _groups(key)
    gid = np.cumsum(head) - 1
    off = gid * (4 * BIG)
    prev_max = np.maximum.accumulate(np.concatenate([[-1], r1[:-1]]) + np.concatenate([[0], off[:-1]]))
    start = head | (r0 + off > prev_max)  # a gap (or a new key) opens a range
    first = np.nonzero(start)[0]
    hi = np.maximum.reduceat(r1, first)
    return key[first], r0[first], hi


def visible_rows(q: Layout, kv: Layout, mask: MaskSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Key rows some query sees, per (query buffer, key buffer) pair: ``(qbuf, kvbuf, lo, hi)``
    row ranges of the key buffers, sorted and merged. This is what a p2p transfer carries."""
    qp, kp = _pieces(q, mask.chunk, mask.muted), _pieces(kv, mask.chunk, mask.muted)
    qi, ki = _join(qp, kp)
    lo, up = bounds(mask)
    ks = np.maximum(kp.start[ki], qp.start[qi] - lo)  # band of the query range, clipped to the keys
    ke = np.minimum(kp.end[ki], qp.end[qi] + up)
    r0 = kp.row[ki] + ks - kp.start[ki]
    r1 = r0 + (ke - ks)
    pair = qp.buf[qi] * (1 << 20) + kp.buf[ki]
    key, lo_r, hi_r = merge_ranges(pair, r0, r1)
    return key >> 20, key & ((1 << 20) - 1), lo_r, hi_r
