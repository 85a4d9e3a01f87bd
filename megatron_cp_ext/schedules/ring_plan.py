"""Host plan of the ``p2p`` ring: which KV rows travel where, and the calls run on them.

Traffic follows the mask. Participant ``o``'s KV block travels along up to two *lanes*:
lane +1 visits ``o+1, o+2, ...``, lane -1 visits ``o-1, o-2, ...``; the two together reach
every other participant exactly once (``a_o`` hops forward, ``n-1-a_o`` backward). At hop t of
a lane the travelling buffer holds exactly the rows that the current or a later receiver on
that lane can see (``held_t``; nested, ``held_1 ⊇ held_2 ⊇ ...``), packed back to back in
the owner's row order, so each hop sends only those rows. A lane ends after its last
non-empty hop; a hop holding nothing is skipped (no send, no compute). The step plans of the
receiver describe the compact rows, so no transfer is ever padded back to the full block.

Why two lanes: with a window (or dual-chunk sharding) a block is needed by *both* ring
neighbours; a one-way ring would carry the part for ``o-1`` through ``n-2`` relays. The lane
split is chosen on the host from the row counts alone, identically on every rank: for local
masks, per owner the split that moves the fewest rows, kept only if it also shortens the
critical path (sum over steps of the largest per-rank receive). Dense masks keep the plain one-way ring with
full blocks and ``cp`` steps; dual-chunk causal stays one-way too (there only rank 0's late
chunk, which nobody else sees, stays home).

Backward: the fp32 dK/dV partial of a block starts at its first receiver, rides along with
the block while a later receiver adds to it, and each row goes home to the owner with one
direct send from the hop after which no one downstream sees it (``home``). The owner keeps
its own step-0 partial and adds what comes home. Every size is known here, on the host.

Names: ``RowSet`` is a sorted list of disjoint half-open row ranges of an owner's block.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import NamedTuple

import torch

from ..masks import MaskSpec, visible_blocks
from ..plan import Layout, Piece, StepPlan, layout_of, plan_step, rows_of
from ..sharding import Segment
from .rowsets import Rows, RowSet, clip, merge, minus, relative, size

__all__ = ["Rows", "Hop", "Lane", "RingPlan", "CommBytes", "build_plan", "ring_comm_bytes", "kv_row_bytes"]


# ---- visibility ----------------------------------------------------------------------------
def _need(q_segs: Sequence[Segment], mask: MaskSpec, seq_end: dict[int, int]) -> dict[int, RowSet]:
    """Per sequence, the key positions some query of ``q_segs`` sees."""
    per_seq: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s in q_segs:
        if s.length and s.seq in seq_end:
            per_seq[s.seq] += [(b.ks, b.ke) for b in visible_blocks(mask, s.start, s.end, 0, seq_end[s.seq])]
    return {seq: merge(r) for seq, r in per_seq.items()}


def _visible_rows(layout: Layout, need: dict[int, RowSet]) -> RowSet:
    """Rows of a block laid out as ``layout`` (rows ascending) whose keys ``need`` asks for.

    Runs for every (owner, receiver) pair, so it avoids sorting: pieces come in row order.
    """
    out: RowSet = []
    for p in layout:
        ivs = need.get(p.seq)
        if not ivs:
            continue
        for a, b in ivs if len(ivs) == 1 else clip(ivs, p.start, p.end):
            rows_of([p], a, b, out)
    return out


def _compact_layout(layout: Layout, held: RowSet) -> Layout:
    """Layout of a buffer packing the ``held`` rows of a block laid out as ``layout``."""
    out, row = [], 0
    for p in layout:
        for a, b in clip(held, p.row, p.row + p.end - p.start):
            out.append(Piece(p.seq, p.start + a - p.row, p.start + b - p.row, row))
            row += b - a
    return out


# ---- routes --------------------------------------------------------------------------------
class Route(NamedTuple):
    """Where one owner's block goes: rows held at hops 1, 2, ... of lane +1 and lane -1."""

    plus: list[RowSet]
    minus: list[RowSet]


def _lane_held(vis_in_order: list[RowSet]) -> list[RowSet]:
    """Rows held at each hop when the receivers see ``vis_in_order`` (suffix unions), trimmed."""
    held: list[RowSet] = []
    acc: RowSet = []
    for v in reversed(vis_in_order):
        acc = merge(acc + v)
        held.append(acc)
    held.reverse()
    while held and not held[-1]:
        held.pop()
    return held


def _route(vis: list[list[RowSet]], o: int, a: int) -> Route:
    """Owner ``o``'s route with ``a`` hops on lane +1 and the remaining ones on lane -1."""
    n = len(vis)
    plus = _lane_held([vis[o][(o + t) % n] for t in range(1, a + 1)])
    back = _lane_held([vis[o][(o - t) % n] for t in range(1, n - a)])
    return Route(plus, back)


def _lane_costs(vis_in_order: list[RowSet], rows: int) -> list[int]:
    """``costs[a]``: rows a lane moves when it serves the first ``a`` receivers in order.

    A row travels up to the last of those receivers that sees it, so the cost is the sum over
    rows of that hop number — one vectorised pass over a (receivers x rows) coverage table
    instead of set unions for every ``a``.
    """
    m = len(vis_in_order)
    if not m or not rows:
        return [0] * (m + 1)
    edges = [(t * (rows + 1) + a, t * (rows + 1) + b) for t, vis in enumerate(vis_in_order) for a, b in vis]
    delta = torch.zeros(m * (rows + 1), dtype=torch.int32)
    if edges:
        idx = torch.tensor(edges, dtype=torch.long)
        delta.index_add_(0, idx[:, 0], torch.ones(len(edges), dtype=torch.int32))
        delta.index_add_(0, idx[:, 1], torch.full((len(edges),), -1, dtype=torch.int32))
    seen = delta.view(m, rows + 1).cumsum(1)[:, :rows] > 0
    last = (torch.arange(1, m + 1)[:, None] * seen).cummax(0).values
    return [0] + last.sum(1).tolist()


def _critical_rows(routes: list[Route]) -> int:
    """Sum over steps of the largest number of rows one participant receives at that step."""
    n = len(routes)
    steps = max((max(len(r.plus), len(r.minus)) for r in routes), default=0)
    total = 0
    for t in range(1, steps + 1):
        per_rank = [0] * n
        for o, r in enumerate(routes):
            if t <= len(r.plus):
                per_rank[(o + t) % n] += size(r.plus[t - 1])
            if t <= len(r.minus):
                per_rank[(o - t) % n] += size(r.minus[t - 1])
        total += max(per_rank)
    return total


def _choose_routes(vis: list[list[RowSet]], counts: list[int], local: bool) -> list[Route]:
    """One-way ring, unless per-owner lane splits move fewer rows *and* shorten the critical path.

    Only local masks (windows, chunks) are searched: for causal and full masks a block's rows
    are seen by whole runs of ranks, and the one-way ring already moves each row no further
    than its last reader.
    """
    n = len(vis)
    one_way = [_route(vis, o, n - 1) for o in range(n)]
    if n <= 2 or not local:  # n <= 2: both lanes would talk to the same neighbour
        return one_way
    split = []
    for o in range(n):
        fwd = _lane_costs([vis[o][(o + t) % n] for t in range(1, n)], counts[o])
        bwd = _lane_costs([vis[o][(o - t) % n] for t in range(1, n)], counts[o])
        best = min(range(n - 1, -1, -1), key=lambda a: fwd[a] + bwd[n - 1 - a])  # ties: longer forward lane
        split.append(_route(vis, o, best))
    return split if _critical_rows(split) < _critical_rows(one_way) else one_way


def _visibility(q_segments, kv_segments, mask: MaskSpec) -> tuple[list[Layout], list[list[RowSet]]]:
    """Layouts of every block and ``vis[o][u]``: rows of ``o``'s block that ``u``'s queries see."""
    seq_end: dict[int, int] = {}
    for segs in kv_segments:
        for s in segs:
            seq_end[s.seq] = max(seq_end.get(s.seq, 0), s.end)
    layouts = [layout_of(segs) for segs in kv_segments]
    needs = [_need(segs, mask, seq_end) for segs in q_segments]
    n = len(layouts)
    vis = [[_visible_rows(layouts[o], needs[u]) if u != o else [] for u in range(n)] for o in range(n)]
    return layouts, vis


def _lane_of(route: Route, direction: int) -> list[RowSet]:
    return route.plus if direction == 1 else route.minus


# ---- the plan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommBytes:
    """Forward KV traffic of one participant per layer (the backward moves the same KV rows
    again, and as many fp32 dK/dV rows: forwarded partials plus one home send per row)."""

    sent: int
    """Bytes this participant sends (its own block's rows and relayed ones)."""
    received: int
    """Bytes it receives."""
    needed: int
    """Bytes of received rows its own queries see: the least any schedule must deliver."""


@dataclass
class Hop:
    """This participant's part in hop t of a lane: the block it holds and what it passes on."""

    source: int
    """Owner of the block."""
    held: RowSet
    """Owner rows packed in the received buffer, in buffer order."""
    n: int
    """Rows of the buffer (0: nothing arrives, nothing is computed or sent)."""
    visible: int
    """Rows of the buffer this participant's queries see."""
    step: StepPlan
    """Local queries against the buffer (its compact rows)."""
    forward: Rows
    """Buffer rows the next holder needs: the KV in forward, the dK/dV partial in backward."""
    home: Rows
    """Buffer rows whose dK/dV partial is complete after this hop: sent straight to the owner."""


@dataclass
class Lane:
    """One direction of travel; every participant has the same lanes, hop counts and tags."""

    direction: int
    """+1: at hop t the block of ``rank - t`` arrives from ``rank - 1``; -1: the mirror image."""
    first: Rows
    """Own-block rows sent at step 0."""
    hops: list[Hop]
    """Hop t at index t - 1."""
    home_in: list[Rows]
    """Index t - 1: own-block rows whose dK/dV arrive from ``rank + direction * t`` at step t."""


@dataclass
class RingPlan:
    """Per-participant plan of the p2p ring (built once per micro-batch on the host)."""

    counts: list[int]
    """Rows of each participant's KV block."""
    rank: int
    """This participant's position in the ring."""
    own: StepPlan
    """Step 0: local queries against the own block."""
    lanes: list[Lane]
    traffic_rows: CommBytes
    """Forward KV traffic in rows (see :meth:`comm_bytes`)."""

    @property
    def num_steps(self) -> int:
        return 1 + max((len(lane.hops) for lane in self.lanes), default=0)

    def blocks(self) -> list[tuple[int, RowSet, StepPlan]]:
        """``(owner, owner rows of the buffer in buffer order, step plan)`` for step 0 and every
        non-empty hop: everything this participant computes (plan checks, docs)."""
        out = [(self.rank, [(0, self.counts[self.rank])], self.own)]
        return out + [(h.source, h.held, h.step) for lane in self.lanes for h in lane.hops if h.n]

    def comm_bytes(self, bytes_per_row: int) -> CommBytes:
        """This participant's forward KV bytes per layer; ``bytes_per_row`` from :func:`kv_row_bytes`."""
        r = self.traffic_rows
        return CommBytes(r.sent * bytes_per_row, r.received * bytes_per_row, r.needed * bytes_per_row)


def kv_row_bytes(hkv: int, dqk: int, dv: int, dtype: torch.dtype) -> int:
    """Bytes of one token's packed K and V."""
    return hkv * (dqk + dv) * torch.empty(0, dtype=dtype).element_size()


def _traffic(routes: list[Route], vis: list[list[RowSet]], rank: int) -> CommBytes:
    n = len(routes)
    sent = received = needed = 0
    for o, route in enumerate(routes):
        for d in (1, -1):
            for t, held in enumerate(_lane_of(route, d), 1):
                if (o + d * (t - 1)) % n == rank:
                    sent += size(held)
                if (o + d * t) % n == rank:
                    received += size(held)
                    needed += size(vis[o][rank])
    return CommBytes(sent, received, needed)


def _build_lane(d: int, length: int, routes: list[Route], layouts, vis, q_layout: Layout, rank: int, mask) -> Lane:
    n = len(routes)
    hops = []
    for t in range(1, length + 1):
        src = (rank - d * t) % n
        path = _lane_of(routes[src], d)
        held = path[t - 1] if t <= len(path) else []
        after = path[t] if t < len(path) else []
        step = plan_step(q_layout, _compact_layout(layouts[src], held), mask) if held else StepPlan([])
        fwd, home = Rows.of(relative(held, after)), Rows.of(relative(held, minus(held, after)))
        hops.append(Hop(src, held, size(held), size(vis[src][rank]) if held else 0, step, fwd, home))
    mine = _lane_of(routes[rank], d)
    home_in = [Rows.of(minus(mine[t - 1], mine[t] if t < len(mine) else [])) for t in range(1, len(mine) + 1)]
    return Lane(d, Rows.of(mine[0] if mine else []), hops, home_in)


def _routes(q_segments, kv_segments, mask: MaskSpec) -> tuple[list[Layout], list[list[RowSet]], list[Route]]:
    layouts, vis = _visibility(q_segments, kv_segments, mask)
    counts = [sum(p.end - p.start for p in lay) for lay in layouts]
    local = mask.lower is not None or mask.upper not in (None, 0) or mask.chunk is not None
    routes = _choose_routes(vis, counts, local) if len(layouts) > 1 else [Route([], [])]
    return layouts, vis, routes


def build_plan(
    q_segments: Sequence[Sequence[Segment]], kv_segments: Sequence[Sequence[Segment]], rank: int, mask: MaskSpec
) -> RingPlan:
    """Ring plan for participant ``rank``; participant i holds queries ``q_segments[i]`` and the
    KV block ``kv_segments[i]`` (any layout, e.g. an a2a group's union of segments)."""
    layouts, vis, routes = _routes(q_segments, kv_segments, mask)
    q_layout = layout_of(q_segments[rank])
    lanes = []
    for d in (1, -1):
        length = max(len(_lane_of(r, d)) for r in routes)
        if length:
            lanes.append(_build_lane(d, length, routes, layouts, vis, q_layout, rank, mask))
    counts = [sum(s.length for s in segs) for segs in kv_segments]
    own = plan_step(q_layout, layouts[rank], mask)
    return RingPlan(counts, rank, own, lanes, _traffic(routes, vis, rank))


def ring_comm_bytes(
    q_segments: Sequence[Sequence[Segment]],
    kv_segments: Sequence[Sequence[Segment]],
    mask: MaskSpec,
    bytes_per_row: int,
) -> list[CommBytes]:
    """Every participant's forward KV traffic per layer, from the routes alone (no step plans)."""
    _, vis, routes = _routes(q_segments, kv_segments, mask)
    return [CommBytes(*(x * bytes_per_row for x in astuple(_traffic(routes, vis, r)))) for r in range(len(routes))]
