"""Host plan of the staged ``p2p`` schedule: the ring's messages, two calls' worth of stages.

The ring (:mod:`.p2p_plan`) computes one block per step and merges every step's partial into
fp32 accumulators: on a long document cut over many ranks, each step reads and writes the
whole accumulator again, and every call is a block's size. The staged schedule moves exactly
the same rows (the ring plan's ``recv``/``send``, all posted at once) and computes in two
stages, with no merge at all:

1. **local** — the query rows that see no other rank's key, against the own block, while the
   messages are in flight;
2. **joined** — every other query row, against one buffer holding the keys they see — the
   own block's rows and every received row — in (sequence, position) order, so each document's
   keys are contiguous and one varlen call (or two) covers them all.

Each query row is in one stage, so outputs and dq are copied into place in the kernel's dtype
(:mod:`.placed`) instead of merged. The joined buffer costs one copy of the own rows it
holds (received pieces land in place, :class:`.staged_moves.StepPieces`); the ring's
per-step merges cost a read and a write of the fp32 accumulator each.

Names: ``rows`` are int64 row numbers; a :class:`Moves` maps rows of a source buffer to rows
of the joined buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..masks import MaskSpec
from ..masks.geometry import BIG, bounds, chunk_units
from ..plan import Layout, StepPlan, plan_steps, visible_rows
from ..plan.calls import _join, _pieces, merge_ranges
from . import staged_moves
from .all_gather import _document_order
from .p2p_plan import P2PPlan, _recv_layout
from .placed import placement
from .staged_moves import KeyRuns, Moves, StepPieces, cut_rows, plan_keys

__all__ = ["StagedPlan", "build_staged", "staged_fits", "need_bound", "STAGE_SLICES", "MAX_BLOCKS"]

MAX_BLOCKS = 2.0
"""The staged schedule holds every received row at once (and a joined copy of them): it runs
only where no rank can receive more than this many of the largest rank's blocks
(:func:`staged_fits`); else the ring, which holds at most two steps' rows. A memory bound
chosen from the design (received plus joined rows then stay within five blocks of K and V),
not a measured knee."""

STAGE_SLICES = 4
"""Slice calls a stage's group of entries may break into before its rows are gathered instead
(:func:`..plan.plan_steps`'s ``max_slices``; the ring's steps allow 2). A stage's queries mix
several documents and both sides of a gap, so its entries break more often than a ring step's;
two stages of up to 4 calls each are still fewer calls than the ring's two per step."""


@dataclass
class StagedPlan:
    """The two stages of one rank (built once per micro-batch, beside its ring plan)."""

    local: StepPlan
    """Query rows that see only own keys, against the own block."""
    joined: StepPlan
    """The other query rows, against the joined buffer."""
    rows: int
    """Rows of the joined buffer."""
    own: Moves
    """Own block rows -> joined rows."""
    recv: Moves
    """Received rows (every step's, back to back in step order) -> joined rows; ``src`` is
    every received row in order."""
    recv_at: dict[int, int]
    """Step slot -> first row of its rows among the received rows."""
    received: int
    """Rows received in all."""
    once: bool
    """Every query row is in at most one call of the two stages (:func:`.placed.placement`):
    outputs and dq are copied into place; else they are merged."""
    covered: bool
    """With ``once``: every query row is in a call."""
    keys: list[KeyRuns] = field(default_factory=list)
    """Per joined call, in call order: where its dK/dV rows go in backward."""
    home_zero: bool = False
    """Some call's key rows go by index: the home buffer is zeroed and every home row added."""
    pieces: dict[int, StepPieces] = field(default_factory=dict)
    """Step slot -> its KV messages (:class:`.staged_moves.StepPieces`)."""


def _remote_rows(q: Layout, remote: Layout, mask: MaskSpec) -> tuple[np.ndarray, np.ndarray]:
    """Row ranges ``[lo, hi)`` of ``q``'s buffer whose queries see some key of ``remote``.

    Key j is visible from query i of the same unit where ``i - lower <= j <= i + upper``, so a
    key range ``[ks, ke)`` is seen by the queries ``[ks - upper, ke + lower)``."""
    qp, kp = _pieces(q, mask.chunk, mask.muted), _pieces(remote, mask.chunk, mask.muted)
    qi, ki = _join(qp, kp)
    lo, up = bounds(mask)
    p0 = np.maximum(qp.start[qi], kp.start[ki] - up)
    p1 = np.minimum(qp.end[qi], kp.end[ki] + lo)
    r0 = qp.row[qi] + (p0 - qp.start[qi])
    _, a, b = merge_ranges(np.zeros(len(r0), np.int64), r0, r0 + (p1 - p0))
    return a, b


def _two_runs(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row ranges ``[lo, hi)`` (sorted, disjoint) covered by at most two: the joined stage's
    queries then sit in at most two slices (no gathered ``q``, ``out``, ``dout``, ``lse`` or
    ``dq`` rows), at the price of some local rows joining it (their keys are then copied into
    the joined buffer too). The two leave out the largest gap."""
    if len(lo) <= 2:
        return lo, hi
    i = int(np.argmax(lo[1:] - hi[:-1]))
    return np.array([lo[0], lo[i + 1]]), np.array([hi[i], hi[-1]])


def _split(q: Layout, lo: np.ndarray, hi: np.ndarray) -> tuple[Layout, Layout]:
    """``q`` (one buffer, rows ascending) cut into the parts outside and inside the row ranges
    ``[lo, hi)`` (sorted, disjoint)."""
    ends = q.row + (q.end - q.start)
    cuts = np.unique(np.concatenate([q.row, ends, lo, hi]))
    a, b = cuts[:-1], cuts[1:]
    seg = np.searchsorted(q.row, a, "right") - 1
    ok = (seg >= 0) & (a < ends[np.maximum(seg, 0)])
    a, b, seg = a[ok], b[ok], seg[ok]
    inside = np.searchsorted(hi, a, "right") < np.searchsorted(lo, a, "right")
    start = q.start[seg] + (a - q.row[seg])

    def part(m: np.ndarray) -> Layout:
        return Layout(q.seq[seg[m]], start[m], start[m] + (b[m] - a[m]), a[m], np.zeros(int(m.sum()), np.int64))

    return part(~inside), part(inside)


def _local_document_order(
    space: Layout, q: Layout, lo: np.ndarray, hi: np.ndarray, chunk: int | None
) -> tuple[Layout, np.ndarray]:
    """:func:`.all_gather._document_order` with the mask's units (documents, or their chunks)
    in the order the queries ``q`` (rows ascending) first hold them, not by id: each call's
    entries then find their keys in ascending rows, so they run on slices, not gathered keys."""
    _, unit_q, _, _ = chunk_units(q.seq, q.start, q.end, chunk)
    src, unit, s0, s1 = chunk_units(space.seq, space.start, space.end, chunk)
    units = np.unique(np.concatenate([unit_q, unit]))
    _, first = np.unique(unit_q, return_index=True)
    local = np.searchsorted(units, unit_q[np.sort(first)])
    key = np.empty(len(units), np.int64)  # key of units[i]: its place among the queries' units
    key[local] = np.arange(len(local))
    rest = np.setdiff1d(np.arange(len(units)), local)
    key[rest] = len(local) + np.arange(len(rest))
    row = space.row[src] + (s0 - space.start[src])
    keyed = Layout(key[np.searchsorted(units, unit)], s0, s1, row, space.buf[src])
    doc, rows = _document_order(keyed, lo, hi)
    seq_of = np.empty(len(units), np.int64)
    seq_of[key] = units >> 32 if chunk is not None else units
    return Layout(seq_of[doc.seq], doc.start, doc.end, doc.row, doc.buf), rows


def staged_fits(seg: np.ndarray, owner: np.ndarray, seq_len: np.ndarray, cp: int, mask: MaskSpec) -> bool:
    """Whether the staged schedule runs on this batch: every rank's received rows stay within
    :data:`MAX_BLOCKS` of the largest rank's tokens. ``seg``: every rank's ``(seq, start,
    end)`` ranges, ``owner`` their ranks, ``seq_len`` the documents' lengths. Decided from an
    upper bound computed the same way on every rank (each range counted as if every key of
    its band outside itself came from another rank; O(ranges), no pair join)."""
    need, tokens = need_bound(seg, owner, seq_len, cp, mask)
    return bool(need.max(initial=0) <= MAX_BLOCKS * max(tokens.max(initial=0), 1))


def need_bound(
    seg: np.ndarray, owner: np.ndarray, seq_len: np.ndarray, cp: int, mask: MaskSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, an upper bound on the rows it receives (:func:`staged_fits`), and its tokens."""
    seg = np.asarray(seg, np.int64).reshape(-1, 3)
    a, b, n = seg[:, 1], seg[:, 2], seq_len[seg[:, 0]]
    lo, up = bounds(mask)
    k0, k1 = np.zeros_like(a), n
    if mask.chunk is not None:  # keys stay in the chunks the range touches
        k0, k1 = (a // mask.chunk) * mask.chunk, np.minimum(n, -(-b // mask.chunk) * mask.chunk)
    keys = np.minimum(k1, b + np.minimum(up, BIG)) - np.maximum(k0, a - np.minimum(lo, BIG))
    extra = np.where(b > a, np.maximum(keys - (b - a), 0), 0)
    tokens = np.bincount(owner, weights=b - a, minlength=cp)
    return np.bincount(owner, weights=extra, minlength=cp), tokens


def build_staged(ring: P2PPlan, segments: list[np.ndarray], mask: MaskSpec) -> StagedPlan:
    """The :class:`StagedPlan` of ``ring``'s rank; ``segments`` as :func:`.p2p_plan.build_plan`'s."""
    rank = ring.rank
    lay = [Layout.packed(s[:, 0], s[:, 1], s[:, 2]) for s in segments]
    mine, t = lay[rank], ring.counts[rank]
    others = [Layout.packed(s[:, 0], s[:, 1], s[:, 2], buf=j + 1) for j, s in enumerate(segments) if j != rank]
    others = Layout.concat(others)
    q_local, q_joined = _split(mine, *_two_runs(*_remote_rows(mine, others, mask)))
    local = plan_steps(q_local, mine, mask, STAGE_SLICES).get(0, StepPlan([]))
    # the joined buffer's sources as one row space: the own block, then the received rows
    parts, recv_at, at = [mine], {}, t
    for st in ring.steps:
        recv_at[st.slot] = at - t
        if st.recv.n:
            got = _recv_layout(lay[st.src], st.recv.ranges, 0)
            parts.append(Layout(got.seq, got.start, got.end, got.row + at, got.buf))
            at += st.recv.n
    received = at - t
    space = Layout.concat(parts)
    _, _, lo, hi = visible_rows(q_joined, space, mask)
    doc, rows = _local_document_order(space, q_joined, lo, hi, mask.chunk)
    joined = plan_steps(q_joined, doc, mask, STAGE_SLICES).get(0, StepPlan([])) if len(rows) else StepPlan([])
    dst = np.arange(len(rows), dtype=np.int64)
    mine_rows = rows < t
    own = Moves(rows[mine_rows], dst[mine_rows]).host()
    order = np.argsort(rows[~mine_rows], kind="stable")
    recv = Moves(rows[~mine_rows][order] - t, dst[~mine_rows][order]).host()
    if len(recv.src) != received or not recv.identity_src:
        raise AssertionError("staged p2p: the joined buffer must hold every received row once")
    once, covered = placement(local.calls + joined.calls, t)
    keys, zero = plan_keys(joined, len(rows), own, recv, received)
    pieces = {st.slot: _step_pieces(st, mine, lay[st.src], recv.dst, recv_at[st.slot], mask.chunk) for st in ring.steps}
    return StagedPlan(local, joined, len(rows), own, recv, recv_at, received, once, covered, keys, zero, pieces)


def _step_pieces(st, mine: Layout, src: Layout, recv_dst: np.ndarray, base: int, chunk: int | None) -> StepPieces:
    """A step's messages: its sent and received rows cut where they cross a range of their
    owner's layout or a chunk boundary (both ends cut the same rows the same way), each piece
    landing in one run of the joined buffer; packed beyond :data:`.staged_moves.MAX_PIECES`."""
    out = cut_rows(st.send.ranges, mine, chunk)
    got = cut_rows(st.recv.ranges, src, chunk)
    most = staged_moves.MAX_PIECES
    send = () if len(out) > most else tuple((int(a), int(b - a)) for a, b in out)
    if len(got) > most:
        rows = np.arange(st.recv.n, dtype=np.int64)
        moves = Moves(rows, recv_dst[base : base + st.recv.n]).host()
        return StepPieces(send, (), len(out) > most, True, moves)
    recv, off = [], base
    for a, b in got:
        n = int(b - a)
        d = recv_dst[off : off + n]
        if n and not (d[-1] - d[0] == n - 1 and (np.diff(d) == 1).all()):
            raise AssertionError("staged p2p: a received piece does not land in one run")
        recv.append((int(d[0]) if n else 0, n))
        off += n
    return StepPieces(send, tuple(recv), len(out) > most, False)
