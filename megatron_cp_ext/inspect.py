"""``inspect_plan``: the exact, public account of what a plan makes every rank do.

The plan a rank would build inside :func:`~megatron_cp_ext.cp_attention` is built here on
the host and described without running anything: its varlen calls in execution order (with
their ``cu_seqlens``, mask alignment and gathered rows), the attention work of its queries,
the bytes it sends and receives forward and backward, and the tile area a flash kernel
visits. Benchmarks, the planner and outside tools read plans only through this.

Counting conventions (all per layer):

* ``work`` — visible (query, key) pairs this rank computes, summed over the heads it computes
  and divided by ``num_heads`` (a2a ranks compute ``1/A`` of the heads of ``A`` ranks'
  tokens), so ranks of every comm type sum to the batch's visible pairs per head (a2a ranks'
  shares rounded to ints);
* ``useful`` / ``tile_area`` — score entries the calls need and entries of the 128x128 tiles
  they touch (per head): their ratio is the tile efficiency;
* bytes — every message of the schedule: KV (and for a2a queries and outputs) in ``dtype``,
  dK/dV partials and reductions in fp32 (fp64 for fp64 inputs); ``bytes_needed`` is the KV of
  other ranks that this rank's queries see, the least any schedule must deliver.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .masks import MaskSpec
from .masks.geometry import BIG, band_count, tile_area
from .plan import Layout, StepPlan, visible_rows
from .runtime.validation import as_int
from .schedules import build_plan
from .schedules.a2a import A2APlan
from .schedules.all_gather import GatherPlan
from .schedules.heads import a2a_bytes, acc_bytes, split_heads
from .schedules.p2p_plan import P2PPlan, use_split
from .schedules.route import MIN_BYTES, worth
from .sharding import CPSharding

__all__ = ["inspect_plan", "PlanReport", "RankReport", "CallReport", "StepReport"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class CallReport:
    """One forward varlen call."""

    step: int
    """0: the own block (or the gathered keys); s >= 1: the block received at p2p step s."""
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    causal: bool
    window: tuple[int, int]
    """Flash ``(left, right)`` window; -1 = unbounded."""
    gathered_rows: int
    """Query and key rows copied for the call (0: both sides are slices)."""
    useful: int
    """Score entries the call needs, per head."""
    tile_area: int
    """Entries of the 128x128 tiles the call touches, per head."""


@dataclass(frozen=True)
class StepReport:
    """One communication of a rank's forward, in execution order (the cost model's input)."""

    step: int
    """0: a collective before the local calls (``all_gather``, ``a2a``); s >= 1: p2p step s."""
    kind: str
    """``"ring"`` (p2p step) | ``"staged"`` (every p2p message of the staged schedule, posted
    before its local stage; its joined stage, step 1, waits for them) | ``"all_gather"`` |
    ``"a2a"``."""
    peers: tuple[int, ...]
    """CP ranks it exchanges with: ``(src, dst)`` for a ring step, the other members for a collective."""
    bytes_sent: dict[str, int]
    """``{"forward": ..., "backward": ...}``; the steps of a rank sum to its totals."""
    bytes_received: dict[str, int]


@dataclass
class RankReport:
    """What one CP rank's plan does per layer."""

    rank: int
    tokens: int
    """Tokens this rank holds."""
    padding: int
    """Pad rows this rank adds to its KV for the comm type (all_gather: up to the largest count)."""
    work: int
    """Visible (query, key) pairs it computes, per head (see the module docstring)."""
    calls: list[CallReport]
    """Forward varlen calls in execution order."""
    bytes_sent: dict[str, int]
    """``{"forward": ..., "backward": ...}``."""
    bytes_received: dict[str, int]
    bytes_needed: dict[str, int]
    """KV of other ranks its queries see (forward), and those rows' dK/dV in the accumulator dtype (backward)."""
    send_gathered_rows: int = 0
    """Rows packed by a gather before sending (fragmented p2p selections; a2a permutations where
    its moves would not go by route on a GPU)."""
    plan_ms: float = 0.0
    """Host time to build this rank's plan."""
    steps: list[StepReport] = field(default_factory=list)
    """Its communications in order (collectives first, then p2p steps): they sum to the totals."""
    heads: int = 0
    """Query heads its calls compute (all heads except under a2a: its head shard)."""

    @property
    def useful(self) -> int:
        return sum(c.useful for c in self.calls)

    @property
    def tile_area(self) -> int:
        return sum(c.tile_area for c in self.calls)

    @property
    def gathered_rows(self) -> int:
        return sum(c.gathered_rows for c in self.calls) + self.send_gathered_rows


@dataclass
class PlanReport:
    """Per rank reports (``ranks[i]`` for every planned rank i) and batch-level totals."""

    comm_type: str
    cp_size: int
    mask: MaskSpec
    kv_row_bytes: int
    """Bytes of one token's K and V in ``dtype``."""
    total_tokens: int
    ranks: dict[int, RankReport] = field(default_factory=dict)
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    element_size: int = 0
    """Bytes of one element of ``dtype``."""
    a2a_size: int = 1
    """Ranks per a2a group (``cp_size`` for a2a, 1 for p2p and all_gather)."""

    def _sum(self, f) -> float:
        return float(sum(f(r) for r in self.ranks.values()))

    @property
    def work_imbalance(self) -> float:
        """Largest per-rank work over the mean (planned ranks)."""
        w = [r.work for r in self.ranks.values()]
        return max(w) / max(np.mean(w), 1e-30)

    @property
    def tokens(self) -> list[int]:
        """Tokens per planned rank (a layer's linear work follows them)."""
        return [r.tokens for r in self.ranks.values()]

    @property
    def token_imbalance(self) -> float:
        """Largest per-rank token count over the mean (planned ranks)."""
        t = self.tokens
        return max(t) / max(np.mean(t), 1e-30) if t else 1.0

    @property
    def tile_efficiency(self) -> float:
        return self._sum(lambda r: r.useful) / max(self._sum(lambda r: r.tile_area), 1.0)

    @property
    def sent_over_needed(self) -> float:
        """Forward bytes sent over bytes needed (1.0: nothing moves that is not looked at)."""
        need = self._sum(lambda r: r.bytes_needed["forward"])
        sent = self._sum(lambda r: r.bytes_sent["forward"])
        return sent / need if need else (1.0 if not sent else float("inf"))


def _call_reports(step: int, plan: StepPlan) -> list[CallReport]:
    out = []
    for c in plan.calls:
        e = c.entries
        nq, nk = e[:, 1] - e[:, 0], e[:, 3] - e[:, 2]
        left, right = c.window
        useful = band_count(nq, nk, nk - nq, BIG if left < 0 else left, BIG if right < 0 else right)
        tiles = tile_area(nq, nk, np.full(len(nq), left), np.full(len(nq), right))
        out.append(CallReport(
            step, c.cu_seqlens_q.tolist(), c.cu_seqlens_k.tolist(), c.causal, c.window, c.gathered_rows,
            int(useful.sum()), int(tiles.sum()),
        ))  # fmt: skip
    return out


def _needed_rows(sharding: CPSharding, rank: int, mask: MaskSpec) -> int:
    """Rows of other ranks' KV that this rank's queries see."""
    segs = [sharding.rank_segments(r) for r in range(sharding.cp_size)]
    mine = Layout.packed(segs[rank][:, 0], segs[rank][:, 1], segs[rank][:, 2])
    others = [Layout.packed(s[:, 0], s[:, 1], s[:, 2], buf=j) for j, s in enumerate(segs) if j != rank]
    _, _, lo, hi = visible_rows(mine, Layout.concat(others), dataclasses.replace(mask, muted=sharding.muted))
    return int((hi - lo).sum())


def _ring_steps(plan: P2PPlan, kv_row: int, grad_row: int, to_cp=lambda j: j) -> list[StepReport]:
    """Per p2p step bytes: KV out and in forward; backward resends KV and returns dK/dV in the accumulator dtype."""
    out = []
    for st in plan.steps:
        s, r = st.send.n, st.recv.n
        out.append(StepReport(
            st.slot, "ring", (to_cp(st.src), to_cp(st.dst)),
            {"forward": s * kv_row, "backward": s * kv_row + r * grad_row},
            {"forward": r * kv_row, "backward": r * kv_row + s * grad_row},
        ))  # fmt: skip
    return out


def _p2p_bytes(plan: P2PPlan, kv_row: int, grad_row: int) -> tuple[dict, dict, int]:
    sent = sum(st.send.n for st in plan.steps)
    recv = sum(st.recv.n for st in plan.steps)
    packed = sum(st.send.n for st in plan.steps if st.send.packed)
    return (
        {"forward": sent * kv_row, "backward": sent * kv_row + recv * grad_row},
        {"forward": recv * kv_row, "backward": recv * kv_row + sent * grad_row},
        packed,
    )


def _a2a_bytes(plan: A2APlan, hq: int, hkv: int, d: int, dv: int, es: int, tokens: int, rank: int):
    """Bytes of the all-to-alls (queries and KV out, outputs back; gradients mirror them) plus the
    p2p exchange across the a2a groups, for this member's (possibly uneven) head shard."""
    a, me = len(plan.counts), plan.member
    q_parts, kv_parts = split_heads(hq, hkv, a)
    nq = [y - x for x, y in q_parts]
    nkv = [y - x for x, y in kv_parts]
    others = [plan.counts[j] for j in range(a) if j != me]
    out_q = sum(tokens * nq[j] for j in range(a) if j != me)  # rows x heads sent, per head width
    out_kv = sum(tokens * nkv[j] for j in range(a) if j != me)
    in_q, in_kv = sum(others) * nq[me], sum(others) * nkv[me]
    fwd_out, fwd_in, bwd_out, bwd_in = a2a_bytes(out_q, out_kv, in_q, in_kv, d, dv, es, hkv < a)
    ring = plan.ring
    hkv_ring = nkv[me] if nq[me] else 0  # a member without query heads skips the ring across groups
    rs, rr, packed = _p2p_bytes(ring, hkv_ring * (d + dv) * es, hkv_ring * (d + dv) * acc_bytes(es))
    sent = {"forward": fwd_out + rs["forward"], "backward": bwd_out + rs["backward"]}
    recv = {"forward": fwd_in + rr["forward"], "backward": bwd_in + rr["backward"]}
    # a2a's rows land in group order run by run (``schedules/route.py``), no gather, where the
    # queries' move would go so on a GPU; else the all-to-all's permutation gathers the group's rows
    if a > 1 and (plan.route is None or not worth(plan.route, hq * d * es, MIN_BYTES)):
        packed += len(plan.perm)
    base = rank - me  # CP rank = p2p index * a + a2a member
    steps = []
    if a > 1:
        peers = tuple(base + j for j in range(a) if j != me)
        steps.append(StepReport(
            0, "a2a", peers, {"forward": fwd_out, "backward": bwd_out}, {"forward": fwd_in, "backward": bwd_in}
        ))  # fmt: skip
    if ring.staged is not None:  # the ring across groups staged: two stages, one exchange
        calls = _call_reports(0, ring.staged.local) + _call_reports(1, ring.staged.joined)
        peers = tuple(sorted({x * a + me for st in ring.steps for x in (st.src, st.dst)}))
        steps += [StepReport(1, "staged", peers, rs, rr)] if ring.steps and nq[me] else []
        return sent, recv, packed, nq[me] / hq, calls if nq[me] else [], steps, nq[me]
    # the forward's calls: a2a+p2p halves its ring's wide ones on large shards (``p2p_plan.split_wide``)
    split = use_split(ring.counts[ring.rank], nq[me], dv, es)
    fwd = [(st.slot, st.fwd if split and st.fwd is not None else st.plan) for st in ring.steps]
    calls = _call_reports(0, ring.own) + [c for slot, p in fwd for c in _call_reports(slot, p)]
    row, grad = hkv_ring * (d + dv) * es, hkv_ring * (d + dv) * acc_bytes(es)
    steps += _ring_steps(ring, row, grad, lambda j: j * a + me) if nq[me] else []
    return sent, recv, packed, nq[me] / hq, calls if nq[me] else [], steps, nq[me]


def _rank_report(sharding, comm_type, rank, a2a_size, mask, shapes) -> RankReport:
    hq, hkv, d, dv, es = shapes
    cp = sharding.cp_size
    t0 = time.perf_counter()
    plan = build_plan(sharding, comm_type, rank, a2a_size or 1, mask)
    plan_ms = (time.perf_counter() - t0) * 1e3
    tokens = sharding.num_tokens(rank)
    kv_row, grad_row = hkv * (d + dv) * es, hkv * (d + dv) * acc_bytes(es)
    sent = {"forward": 0, "backward": 0}
    recv = {"forward": 0, "backward": 0}
    padding, packed, heads_share, steps, heads = 0, 0, 1.0, [], hq
    if isinstance(plan, GatherPlan):
        calls = _call_reports(0, plan.step)
        if cp > 1:
            padding = plan.pad - tokens
            block = (cp - 1) * plan.pad
            sent = {"forward": block * kv_row, "backward": block * (kv_row + grad_row)}
            recv = dict(sent)
            steps = [StepReport(0, "all_gather", tuple(j for j in range(cp) if j != rank), sent, recv)]
    elif isinstance(plan, P2PPlan) and plan.staged is not None:
        calls = _call_reports(0, plan.staged.local) + _call_reports(1, plan.staged.joined)
        sent, recv, packed = _p2p_bytes(plan, kv_row, grad_row)
        peers = tuple(sorted({x for st in plan.steps for x in (st.src, st.dst)}))
        steps = [StepReport(1, "staged", peers, sent, recv)] if plan.steps else []
    elif isinstance(plan, P2PPlan):
        calls = _call_reports(0, plan.own) + [c for st in plan.steps for c in _call_reports(st.slot, st.plan)]
        sent, recv, packed = _p2p_bytes(plan, kv_row, grad_row)
        steps = _ring_steps(plan, kv_row, grad_row)
    else:
        assert isinstance(plan, A2APlan)
        sent, recv, packed, heads_share, calls, steps, heads = _a2a_bytes(plan, hq, hkv, d, dv, es, tokens, rank)
    need = _needed_rows(sharding, rank, mask) if cp > 1 else 0
    useful = sum(c.useful for c in calls)
    return RankReport(
        rank=rank, tokens=tokens, padding=padding, work=int(round(useful * heads_share)), calls=calls,
        bytes_sent=sent, bytes_received=recv,
        bytes_needed={"forward": need * kv_row, "backward": need * grad_row},
        send_gathered_rows=packed, plan_ms=plan_ms, steps=steps, heads=heads,
    )  # fmt: skip


def inspect_plan(
    sharding: CPSharding,
    comm_type: str = "p2p",
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    chunk_size: int | None = None,
    a2a_size: int | None = None,
    num_heads: int = 64,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    v_head_dim: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    ranks: Sequence[int] | None = None,
) -> PlanReport:
    """Build the plans ``cp_attention`` would build for ``sharding`` and report them.

    ``a2a_size``: ranks per a2a group for ``a2a+p2p`` (required there; ``a2a`` uses the whole
    CP group). ``ranks``: plan only these ranks (default: all). The head counts, head dims and
    dtype only scale bytes; plans do not depend on them.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    if not isinstance(sharding, CPSharding):
        raise ValueError(f"sharding must be a CPSharding (from shard_sequences), got {type(sharding).__name__}")
    cp = sharding.cp_size
    if comm_type == "a2a":
        a2a_size = cp
    elif comm_type == "a2a+p2p":
        a2a_size = None if a2a_size is None else as_int(a2a_size, "a2a_size", minimum=1)
        if a2a_size is None or cp % a2a_size:
            raise ValueError(f"a2a_size must be a positive divisor of the CP size ({cp}) for a2a+p2p, got {a2a_size}")
    dv = head_dim if v_head_dim is None else v_head_dim
    sizes = (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("v_head_dim", dv))
    num_heads, num_kv_heads, head_dim, dv = (as_int(val, name, minimum=1) for name, val in sizes)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}), as in cp_attention"
        )
    mask = MaskSpec.make(causal=causal, window_size=window_size, chunk_size=chunk_size)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (the inputs'), got {dtype!r}")
    es = torch.empty(0, dtype=dtype).element_size()
    chosen = range(cp) if ranks is None else list(ranks)
    if not chosen:
        raise ValueError("ranks must name at least one rank (None: every rank)")
    for r in chosen:
        if not isinstance(r, int) or not 0 <= r < cp:
            raise ValueError(f"ranks must hold ranks in [0, {cp}), got {r!r}")
    report = PlanReport(
        comm_type, cp, mask, num_kv_heads * (head_dim + dv) * es, sharding.total_tokens, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=dv, element_size=es,
        a2a_size=(a2a_size or 1) if comm_type in ("a2a", "a2a+p2p") else 1,
    )  # fmt: skip
    shapes = (num_heads, num_kv_heads, head_dim, dv, es)
    for r in chosen:
        report.ranks[r] = _rank_report(sharding, comm_type, r, a2a_size, mask, shapes)
    return report
