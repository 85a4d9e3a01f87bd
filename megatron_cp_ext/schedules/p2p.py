"""``p2p``: ring attention where the traffic follows the mask.

Step 0 computes the local queries against the own KV block. At step t >= 1 each lane of the
plan (:mod:`.ring_plan`) delivers one block: on lane +1 the block of ``rank - t`` from
``rank - 1``, on lane -1 the block of ``rank + t`` from ``rank + 1``; each holds only the rows
that this or a later receiver of its lane sees, and a lane ends after its last useful hop.
The next step's blocks are posted before the current one is computed (double buffering),
so transfer overlaps compute. For dense masks this is the classic one-way ring with full
blocks; for windows it degenerates to halo exchanges with the neighbours.

Backward: KV travels exactly as in forward. The fp32 (fp64 for fp64 input) dK/dV partial of a block is created by
its first receiver and rides along (the same rows as the KV) while a later receiver adds to
it; a row whose last contribution is in goes home to the owner in one direct send. The owner
adds those to the partial of its own step 0. All sizes come from the host plan: nothing in
here reads a device value.
"""

from __future__ import annotations

import torch

from ..comm import Ring
from .common import Run, acc_dtype, accumulate, new_accumulators, pack_kv, step_backward, step_forward, take
from .ring_plan import CommBytes, Hop, Lane, RingPlan, Rows, build_plan, kv_row_bytes, ring_comm_bytes

__all__ = ["RingPlan", "CommBytes", "build_plan", "forward", "backward", "ring_comm_bytes", "kv_row_bytes"]

# One tag per stream and direction, so no stream ever matches another's message.
_KV_TAG, _GRAD_TAG, _HOME_TAG = 0, 2, 4


def _rings(run: Run, base_tag: int) -> list[Ring | None]:
    plan: RingPlan = run.plan
    if run.group is None:
        return [None for _ in plan.lanes]
    return [Ring(run.group, lane.direction, base_tag + (lane.direction < 0)) for lane in plan.lanes]


def _hop(lane: Lane, t: int) -> Hop | None:
    """The lane's hop at step t (None at step 0 and past the lane's end)."""
    return lane.hops[t - 1] if 1 <= t <= len(lane.hops) else None


def _pick(x: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """Planned rows of a buffer (a view when they are one slice), or None when there are none."""
    if x is None or not rows.n:
        return None
    return take(x, rows.sl, rows.index_on(x.device))


def _post_kv(plan: RingPlan, rings: list[Ring | None], cur: list, own: torch.Tensor, t: int) -> list:
    """Send each lane's block on (only the rows still needed downstream), receive the next.

    The next block has another owner than the current one, so its size comes from the next
    hop of the plan, never from what is held now.
    """
    nxt: list = [None] * len(plan.lanes)
    for i, lane in enumerate(plan.lanes):
        hop, nxt_hop = _hop(lane, t), _hop(lane, t + 1)
        send = _pick(cur[i], lane.first if t == 0 else hop.forward if hop is not None else Rows(0))
        if nxt_hop is not None and nxt_hop.n:
            nxt[i] = own.new_empty((nxt_hop.n, *own.shape[1:]))
        if rings[i] is not None:
            rings[i].exchange(send, nxt[i])
    return nxt


def _arrive(rings: list[Ring | None], nxt: list) -> list:
    for ring in rings:
        if ring is not None:
            ring.wait()
    return nxt


def forward(run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    plan: RingPlan = run.plan
    rings = _rings(run, _KV_TAG)
    out, lse = new_accumulators(q, v.shape[-1])
    own = pack_kv(k, v)
    cur: list = [own for _ in plan.lanes]
    for t in range(plan.num_steps):
        nxt = _post_kv(plan, rings, cur, own, t)
        if t == 0:
            step_forward(plan.own.on(q.device), run, q, own, out, lse)
        for i, lane in enumerate(plan.lanes):
            hop = _hop(lane, t)
            if hop is not None and not hop.step.empty:
                step_forward(hop.step.on(q.device), run, q, cur[i], out, lse)
        cur = _arrive(rings, nxt)
    return out.to(q.dtype), lse


def _post_grads(
    lane: Lane,
    t: int,
    part: torch.Tensor | None,
    fwd_ring: Ring | None,
    home_ring: Ring | None,
    homes: list[tuple[Rows, torch.Tensor]],
    like: torch.Tensor,
) -> torch.Tensor | None:
    """After step t: pass the partial on, send finished rows home, post what arrives for us.

    Returns the buffer that will hold the partial of the next hop's block (None when that
    hop has no predecessor partial: its first receiver starts from zero).
    """
    hop, nxt_hop = _hop(lane, t), _hop(lane, t + 1)
    fwd_in = None
    if t >= 1 and nxt_hop is not None and nxt_hop.n:
        fwd_in = like.new_empty((nxt_hop.n, *like.shape[1:]))
    home_in = lane.home_in[t - 1] if 1 <= t <= len(lane.home_in) else Rows(0)
    home_buf = like.new_empty((home_in.n, *like.shape[1:])) if home_in.n else None
    if home_buf is not None:
        homes.append((home_in, home_buf))
    if fwd_ring is not None:
        fwd_ring.exchange(_pick(part, hop.forward if hop is not None else Rows(0)), fwd_in)
        home_ring.exchange(_pick(part, hop.home if hop is not None else Rows(0)), home_buf, hops=-t)
    return fwd_in


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan: RingPlan = run.plan
    kv_rings, fwd_rings, home_rings = _rings(run, _KV_TAG), _rings(run, _GRAD_TAG), _rings(run, _HOME_TAG)
    saved = (dout, q, out, lse)
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    own = pack_kv(k, v)
    dkv = torch.zeros(own.shape, dtype=acc_dtype(q), device=own.device)
    cur: list = [own for _ in plan.lanes]
    fwd_in: list = [None] * len(plan.lanes)
    homes: list[tuple[Rows, torch.Tensor]] = []
    for t in range(plan.num_steps):
        nxt = _post_kv(plan, kv_rings, cur, own, t)
        if t == 0:
            step_backward(plan.own.on(q.device), run, saved, own, dq, dkv)
        for i, lane in enumerate(plan.lanes):
            hop, part = _hop(lane, t), None
            if hop is not None and hop.n:
                part = torch.zeros((hop.n, *dkv.shape[1:]), dtype=dkv.dtype, device=dkv.device)
                step_backward(hop.step.on(q.device), run, saved, cur[i], dq, part)
                if fwd_in[i] is not None:  # the partial of this block from the receivers before us
                    fwd_rings[i].wait()
                    part += fwd_in[i]
            fwd_in[i] = _post_grads(lane, t, part, fwd_rings[i], home_rings[i], homes, dkv)
        cur = _arrive(kv_rings, nxt)
    _arrive(fwd_rings + home_rings, None)
    for rows, buf in homes:
        accumulate(dkv, rows.sl, rows.index_on(dkv.device), buf)
    return dq, dkv[..., : run.dk], dkv[..., run.dk :]  # accumulator dtype: the caller rounds once
