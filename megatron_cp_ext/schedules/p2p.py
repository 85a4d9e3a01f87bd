"""``p2p``: ring attention. KV blocks rotate around the CP group; dK/dV ride the ring back.

At step ``t`` rank ``r`` holds the KV block of rank ``r - t`` and computes only the calls its
plan lists for that block (causal dual-chunk: the diagonal step is causal, later steps are
fully visible half blocks; nothing fully masked is ever computed). The next block is posted
before the current one is computed (double buffering), so transfer overlaps compute.

Backward: KV rotates the same way; the fp32 dK/dV partial of the block a rank holds is
handed to the next rank after each step, so after ``cp`` steps every rank holds the complete
gradient of its own KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Ring
from ..masks import MaskSpec
from ..plan import StepPlan, layout_of, plan_step
from ..sharding import Segment
from .common import Run, new_accumulators, pack_kv, step_backward, step_forward

__all__ = ["RingPlan", "build_plan", "forward", "backward"]


@dataclass
class RingPlan:
    """Per-participant token counts and, per step, this participant's calls."""

    counts: list[int]
    """Rows of each participant's KV block (sizes every receive without asking)."""
    rank: int
    """This participant's position in the ring."""
    steps: list[StepPlan]
    """Step t: local queries against the KV block of participant ``rank - t``."""

    def source(self, t: int) -> int:
        return (self.rank - t) % len(self.counts)


def build_plan(
    q_segments: list[tuple[Segment, ...]], kv_segments: list[tuple[Segment, ...]], rank: int, mask: MaskSpec
) -> RingPlan:
    """Ring plan for participant ``rank``; participants hold ``*_segments[i]`` (any layout)."""
    n = len(kv_segments)
    counts = [sum(s.length for s in segs) for segs in kv_segments]
    q_layout = layout_of(q_segments[rank])
    steps = [plan_step(q_layout, layout_of(kv_segments[(rank - t) % n]), mask) for t in range(n)]
    return RingPlan(counts, rank, steps)


def _recv_buffer(like: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty((rows, *like.shape[1:]), dtype=dtype or like.dtype)


def forward(run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    plan: RingPlan = run.plan
    n = len(plan.counts)
    ring = Ring(run.group) if n > 1 else None
    out, lse = new_accumulators(q, v.shape[-1])
    cur = pack_kv(k, v)
    for t, step in enumerate(plan.steps):
        nxt = None
        if t + 1 < n:
            nxt = _recv_buffer(cur, plan.counts[plan.source(t + 1)])
            ring.exchange(cur, nxt)
        step_forward(step.on(q.device), run, q, cur, out, lse)
        if nxt is not None:
            ring.wait()
            cur = nxt
    return out.to(q.dtype), lse


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan: RingPlan = run.plan
    n = len(plan.counts)
    kv_ring, dkv_ring = (Ring(run.group), Ring(run.group)) if n > 1 else (None, None)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    saved = (dout, q, out, lse)
    cur = pack_kv(k, v)
    dkv_in = None
    for t, step in enumerate(plan.steps):
        nxt = None
        if t + 1 < n:
            nxt = _recv_buffer(cur, plan.counts[plan.source(t + 1)])
            kv_ring.exchange(cur, nxt)
        part = torch.zeros(cur.shape, dtype=torch.float32, device=cur.device)
        step_backward(step.on(q.device), run, saved, cur, dq, part)
        if dkv_in is not None:  # the partial of this block from the ranks before us
            dkv_ring.wait()
            part += dkv_in
        if n > 1:
            # after the last step the block we hold belongs to the next rank: hand it home
            dkv_in = _recv_buffer(cur, plan.counts[plan.source(t + 1)], torch.float32)
            dkv_ring.exchange(part, dkv_in)
        else:
            dkv_in = part
        if nxt is not None:
            kv_ring.wait()
            cur = nxt
    if n > 1:
        dkv_ring.wait()
    dk = dkv_in[..., : run.dk].to(k.dtype)
    dv = dkv_in[..., run.dk :].to(v.dtype)
    return dq.to(q.dtype), dk, dv
