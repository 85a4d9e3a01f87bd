"""Host plan of the ``p2p`` schedule: which KV rows go where, and the calls run on them.

Traffic is exactly the need. Participant ``o`` sends participant ``u`` the rows of its KV
block that some query of ``u`` sees — directly, once, nothing relayed — and ``u`` sends the
fp32 dK/dV partial of exactly those rows straight back in backward. Transfers are ordered
like a ring's steps: at step ``s`` (1 .. n-1) participant r sends to ``r + s`` and receives
from ``r - s``, so every step is a permutation (each participant sends one block and
receives one) and two participants always meet at the same step from both sides. A step
with nothing to send and nothing to receive is skipped by that participant, so a layout
whose documents span neighbouring ranks only exchanges halos, and one that keeps every
document whole on one rank never communicates.

Rows that travel are selected as a few slices of the owner's block (one per range: sent
as separate messages, received into consecutive slices, no copy) or, when fragmented,
packed by one gather. Every size is known here, on the host: nothing in forward or backward
reads a device value to decide what to send.

Names: ``ranges`` are ``[m, 2]`` int64 arrays of half-open row ranges of one buffer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import MaskSpec
from ..plan import Layout, StepPlan, VarlenCall, plan_steps, visible_rows

__all__ = ["Rows", "Step", "P2PPlan", "CommRows", "Narrow", "build_plan", "plan_narrow", "split_wide", "use_split"]
__all__ += ["MAX_MESSAGES"]

MAX_MESSAGES = 8
"""Row ranges sent as separate messages (views); more fragmented selections are packed."""


@dataclass
class Rows:
    """A planned selection of buffer rows: slices, or one gather index when fragmented."""

    ranges: np.ndarray
    """``[m, 2]`` half-open row ranges, in order."""
    _dev: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def n(self) -> int:
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())

    @functools.cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """``ranges`` as Python ints, converted once per plan (the ring slices with them)."""
        return tuple((int(a), int(b)) for a, b in self.ranges)

    @property
    def packed(self) -> bool:
        """Whether the rows are gathered into one buffer (else each range is a view)."""
        return len(self.ranges) > MAX_MESSAGES

    @functools.cached_property
    def cuts(self) -> tuple[tuple[int, int], ...]:
        """Row ranges of a buffer receiving these rows, one per message of a tensor (one when
        packed, else one per span)."""
        if self.packed:
            return ((0, self.n),) if self.n else ()
        cuts, off = [], 0
        for a, b in self.spans:
            cuts.append((off, off + b - a))
            off += b - a
        return tuple(cuts) if self.n else ()

    @functools.cached_property
    def index(self) -> np.ndarray:
        """The gather index (host)."""
        n = self.ranges[:, 1] - self.ranges[:, 0]
        return np.repeat(self.ranges[:, 0] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))

    def index_on(self, device: torch.device) -> torch.Tensor:
        """The gather index on ``device`` (uploaded once)."""
        key = str(device)
        if key not in self._dev:
            self._dev[key] = torch.from_numpy(self.index).to(device, non_blocking=True)
        return self._dev[key]

    def host(self) -> Rows:
        """Fill the host caches the ring reads (done when the plan is built; they travel with
        a pickled plan, so a plan built in a loader worker arrives with them)."""
        _ = self.n, self.spans, self.cuts
        if self.n and self.packed:
            _ = self.index
        return self

    def __getstate__(self) -> dict:  # host caches travel, device copies never do
        return {**self.__dict__, "_dev": {}}


@dataclass
class Step:
    """This participant's part in one step: what arrives, what it computes, what it sends."""

    slot: int
    """Step number s: receive from ``rank - s``, send to ``rank + s``."""
    src: int
    """Participant whose rows arrive (``rank - slot``)."""
    recv: Rows
    """Rows of ``src``'s block that arrive (its row numbers), packed in this order."""
    plan: StepPlan
    """Local queries against the received rows."""
    dst: int
    """Participant that gets rows of the own block (``rank + slot``)."""
    send: Rows
    """Own rows sent to ``dst``; their dK/dV partials come back from it in backward."""
    fwd: StepPlan | None = None
    """The forward's calls where they differ from ``plan`` (:func:`split_wide`), else None."""


@dataclass(frozen=True)
class CommRows:
    """Rows one participant moves per layer in forward (backward moves as many KV rows again,
    and returns as many fp32 dK/dV rows)."""

    sent: int
    received: int
    needed: int
    """Received rows its queries see: the least any schedule must deliver (= ``received``)."""


@dataclass
class P2PPlan:
    """Per-participant plan of the ``p2p`` schedule (built once per micro-batch on the host)."""

    counts: list[int]
    """Rows of each participant's KV block."""
    rank: int
    own: StepPlan
    """Local queries against the own block."""
    steps: list[Step]
    """Steps with anything to send or receive, in slot order."""
    rows: CommRows
    own_order: tuple[int, ...] = ()
    """Order in which the ring runs ``own``'s calls: a call over every local query first, so
    its kernel outputs become the forward and gradient accumulators."""
    narrow: Narrow | None = None
    """What a backward owning ``dout`` and ``out`` keeps of them (:func:`plan_narrow`); planned
    for a2a's ring only (None: not planned)."""
    staged: object = None
    """The staged schedule's stages (:class:`.staged_plan.StagedPlan`) where the layer runs it
    instead of the ring step by step; None: the ring."""
    walks: dict = field(default_factory=dict, repr=False, compare=False)
    """Per device: the ring's walk over the steps with its index tensors uploaded (see
    ``p2p.prepare``); everything host-side is planned by :func:`build_plan`."""

    @property
    def num_steps(self) -> int:
        return 1 + len(self.steps)

    def __getstate__(self) -> dict:  # device copies never travel (plans are built in loaders)
        return {**self.__dict__, "walks": {}}


@dataclass(frozen=True)
class Narrow:
    """The query rows that a ring's calls read after the own block's (host part): where they
    are fewer than the local rows, a backward that owns ``dout`` and ``out`` (a2a+p2p's
    head-sharded copies) keeps only these rows of them, gathered once, instead of the whole
    tensors plus a gather per call."""

    rows: np.ndarray | None
    """``[r]`` ascending local query rows read by any call of any step; None where the calls
    read every local row (or none): nothing is narrowed."""
    local: list[list[tuple] | None]
    """Index s: step s's calls' rows in the narrowed copies, each ``(slice, None)`` (a view)
    or ``(None, positions)`` (host int64); None where the slot has no calls."""


def _call_rows(entries: np.ndarray) -> np.ndarray:
    lo, hi = entries[:, 0], entries[:, 1]
    n = hi - lo
    return np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))


def plan_narrow(plan: P2PPlan) -> Narrow:
    """The :class:`Narrow` of ``plan`` (numpy on the host, once per plan)."""
    per: list[list[np.ndarray] | None] = [None] * len(plan.counts)
    for st in plan.steps:
        if st.plan.calls:
            per[st.slot] = [_call_rows(c.entries) for c in st.plan.calls]
    every = [r for calls in per if calls for r in calls]
    union = np.unique(np.concatenate(every)) if every else np.zeros(0, np.int64)
    if not 0 < union.size < plan.counts[plan.rank]:
        return Narrow(None, [])
    local: list[list[tuple] | None] = []
    for calls in per:
        ls = []
        for r in calls or ():
            pos = np.searchsorted(union, r)
            if np.array_equal(pos, np.arange(pos[0], pos[0] + pos.size)):
                ls.append(((int(pos[0]), int(pos[0]) + pos.size), None))
            else:
                ls.append((None, pos.astype(np.int64)))
        local.append(ls if calls else None)
    return Narrow(union.astype(np.int64), local)


def _own_order(own: StepPlan, t: int) -> tuple[int, ...]:
    order = list(range(len(own.calls)))
    whole = [i for i, c in enumerate(own.calls) if c.q_slice == (0, t)]
    if whole:
        order.insert(0, order.pop(whole[0]))
    return tuple(order)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return np.stack([lo, hi], axis=1).astype(np.int64).reshape(-1, 2)


def _recv_layout(owner: Layout, ranges: np.ndarray, buf: int) -> Layout:
    """Layout of a buffer packing ``ranges`` of a block laid out as ``owner`` (rows ascending)."""
    row_end = owner.row + (owner.end - owner.start)
    i0 = np.searchsorted(row_end, ranges[:, 0], "right")  # first segment of each range
    i1 = np.searchsorted(owner.row, ranges[:, 1], "left")  # one past its last segment
    cnt = np.maximum(i1 - i0, 0)
    r = np.repeat(np.arange(len(ranges)), cnt)
    i = np.repeat(i0, cnt) + np.arange(len(r)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    lo = np.maximum(ranges[r, 0], owner.row[i])
    hi = np.minimum(ranges[r, 1], row_end[i])
    a = owner.start[i] + (lo - owner.row[i])
    return Layout.packed(owner.seq[i], a, a + (hi - lo), buf=buf)


def build_plan(segments: list[np.ndarray], rank: int, mask: MaskSpec) -> P2PPlan:
    """Plan for participant ``rank``; participant i holds the queries and the KV block laid out
    by ``segments[i]`` (``[k, 3]`` ``(seq, start, end)`` in local order)."""
    n = len(segments)
    lay = [Layout.packed(s[:, 0], s[:, 1], s[:, 2]) for s in segments]
    mine = lay[rank]
    others = [o for o in range(n) if o != rank]
    with_buf = lambda ly, b: Layout(ly.seq, ly.start, ly.end, ly.row, np.full(len(ly), b, np.int64))  # noqa: E731
    # what arrives at step s from rank - s, and what leaves at step s for rank + s
    _, kb, lo, hi = visible_rows(mine, Layout.concat([with_buf(lay[o], (rank - o) % n) for o in others]), mask)
    qb, _, olo, ohi = visible_rows(Layout.concat([with_buf(lay[u], (u - rank) % n) for u in others]), mine, mask)
    recv_of = {int(s): _ranges(lo[kb == s], hi[kb == s]) for s in np.unique(kb)}
    send_of = {int(s): _ranges(olo[qb == s], ohi[qb == s]) for s in np.unique(qb)}
    bufs = [with_buf(mine, 0)] + [_recv_layout(lay[(rank - s) % n], r, s) for s, r in recv_of.items()]
    plans = plan_steps(mine, Layout.concat(bufs), mask)
    empty = np.zeros((0, 2), np.int64)
    steps = []
    for s in sorted(set(recv_of) | set(send_of)):
        recv, send = Rows(recv_of.get(s, empty)).host(), Rows(send_of.get(s, empty)).host()
        steps.append(Step(s, (rank - s) % n, recv, plans.get(s, StepPlan([])), (rank + s) % n, send))
    received = sum(st.recv.n for st in steps)
    rows = CommRows(sent=sum(st.send.n for st in steps), received=received, needed=received)
    counts = [int((s[:, 2] - s[:, 1]).sum()) for s in segments]
    own = plans.get(0, StepPlan([]))
    return P2PPlan(counts, rank, own, steps, rows, own_order=_own_order(own, counts[rank]))


SPLIT_TILE = 128
"""Row multiple of a cut inside one entry (:func:`split_wide`), so no call gains a query tile."""

SPLIT_MIN_BYTES = 4 << 20
"""The forward runs :func:`split_wide`'s halves only where the local output (rows x query heads
x v dim in the input dtype) is at least this large: below it the partial is small in absolute
terms and a kernel call is short enough for the extra launch and merge to show (the rings'
head groups use the same reasoning, ``a2a_groups.RING_MIN_GROUP_BYTES``). A judgement, not a
measured knee; tests lower it to check the halves on small batches."""


def use_split(rows: int, heads: int, dv: int, itemsize: int) -> bool:
    """Whether a forward over ``rows`` local queries of ``heads`` heads runs the split calls
    (:data:`SPLIT_MIN_BYTES`). A local choice: the ring's messages do not depend on it."""
    return rows * heads * dv * itemsize >= SPLIT_MIN_BYTES


def _halves(call: VarlenCall) -> tuple[np.ndarray, np.ndarray] | None:
    """``call``'s entries cut into two groups of about half its query rows each, or None.

    A cut between entries is exact for any mask. A cut inside an entry is exact where the
    bottom-right alignment survives it: every key visible (no window), or causal (right side
    0), the front half then ending its keys as many rows earlier as it lost queries. The cut
    falls at the entry boundary nearest the middle unless one inside an entry, at a tile
    multiple from the entry's start, comes nearer."""
    e = call.entries
    lq = e[:, 1] - e[:, 0]
    t = int(lq.sum())
    ends = np.cumsum(lq)
    mid = t // 2
    i = int(np.argmin(np.abs(ends[:-1] - mid))) if len(e) > 1 else -1
    best = abs(int(ends[i]) - mid) if i >= 0 else t
    j = int(np.searchsorted(ends, mid, "right"))  # the entry holding the middle row
    inner = None
    if j < len(e) and (tuple(call.window) == (-1, -1) or call.window[1] == 0):
        first = int(ends[j] - lq[j])
        cut = first + SPLIT_TILE * round((mid - first) / SPLIT_TILE)
        if first < cut < int(ends[j]) and abs(cut - mid) < best:
            inner = cut - first
    if inner is None:
        if i < 0 or best > t // 4:
            return None
        return e[: i + 1], e[i + 1 :]
    q0, q1, k0, k1 = (int(x) for x in e[j])
    lost = q1 - (q0 + inner)
    kf = k1 - lost if call.window[1] == 0 else k1
    front = [e[:j]] + ([np.array([[q0, q0 + inner, k0, kf]], e.dtype)] if kf > k0 else [])
    back = [np.array([[q0 + inner, q1, k0, k1]], e.dtype), e[j + 1 :]]
    return np.concatenate(front), np.concatenate(back)


def split_wide(plan: P2PPlan) -> None:
    """Give the ring steps' forward calls over more than half the local queries two calls
    instead (:attr:`Step.fwd`), where a cut of about half is exact (:func:`_halves`).

    A forward call's output partial lives beside the output accumulator until it is merged:
    over every local query it is as large as the accumulator. a2a+p2p's ring runs beside
    the head-sharded q and KV, so that partial sets its forward peak; halves cost one kernel
    call and one merge more per such step and lower that peak by half the accumulator's
    size (0.2 of the ideal at 16/4 heads). Cuts inside an entry fall at tile multiples. The
    backward keeps ``plan``'s calls (a split there would add dK/dV sums). Planned always; the
    forward runs the halves where :func:`use_split` says so."""
    t = plan.counts[plan.rank]
    for st in plan.steps:
        calls, changed = [], False
        for c in st.plan.calls:
            n = int((c.entries[:, 1] - c.entries[:, 0]).sum())
            parts = _halves(c) if 2 * n > t and n >= 2 * SPLIT_TILE else None
            if parts is None:
                calls.append(c)
                continue
            calls += [VarlenCall.build(c.window, p) for p in parts if len(p)]
            changed = True
        if changed:
            st.fwd = StepPlan(calls)
