"""``p2p``: KV moves straight to the ranks whose queries see it, overlapped with compute.

The plan (:mod:`.p2p_plan`) lists, per step s, the rows that arrive from ``rank - s`` and
the rows of the own block that leave for ``rank + s``. Step s+1's transfers are posted
before step s is computed (double buffering), so transfer overlaps compute. Every rank
walks the same step numbers 1 .. n-1 — posting nothing where its plan has nothing — so the
messages between any two ranks are posted in the same order on both sides.

Backward: KV moves exactly as in forward. Right after a step's block is computed, its fp32
(fp64 for fp64 input) dK/dV partial goes straight home to the owner (the same rows that arrived), and the partial
of the rows this rank sent at that step comes back from their reader; the owner adds it
to the partial of its own block one step later, so at most two are in flight. All sizes
come from the host plan: nothing here reads a device value.
"""

from __future__ import annotations

import torch

from ..comm import Peers
from ..ops import gather_rows
from .common import GradAcc, Run, acc_dtype, accumulate, new_accumulators, pack_kv, step_backward, step_forward
from .p2p_plan import P2PPlan, Rows, Step, build_plan

__all__ = ["P2PPlan", "build_plan", "forward", "backward", "backward_packed"]

# One tag per stream, so no stream ever matches another's message on backends with tags.
_KV_TAG, _HOME_TAG = 0, 2


def _send_parts(x: torch.Tensor, rows: Rows) -> list[torch.Tensor]:
    """The planned rows of ``x`` as messages: one view per range, or one packed gather."""
    if not rows.n:
        return []
    if rows.packed:
        return [gather_rows(x, rows.index_on(x.device))]
    return [x[a:b] for a, b in rows.spans]


def _recv_parts(buf: torch.Tensor | None, rows: Rows) -> list[torch.Tensor]:
    """Slices of ``buf`` matching :func:`_send_parts` on the sender (same ranges, same order)."""
    if buf is None or rows.packed:
        return [] if buf is None else [buf]
    parts, off = [], 0
    for a, b in rows.spans:
        parts.append(buf[off : off + b - a])
        off += b - a
    return parts


class _Steps:
    """Walks steps 1 .. n-1 of a plan, posting each step's KV transfer one step ahead."""

    def __init__(self, run: Run, own: torch.Tensor) -> None:
        self.plan: P2PPlan = run.plan
        self.by_slot = {st.slot: st for st in self.plan.steps}
        self.n = len(self.plan.counts)
        self.own = own
        self.peers = Peers(run.group, _KV_TAG) if run.group is not None else None
        self.home = Peers(run.group, _HOME_TAG) if run.group is not None else None

    def post_kv(self, slot: int) -> tuple[Step | None, torch.Tensor | None, list]:
        st = self.by_slot.get(slot)
        if st is None:
            return None, None, []
        buf = self.own.new_empty((st.recv.n, *self.own.shape[1:])) if st.recv.n else None
        sends = [(st.dst, t) for t in _send_parts(self.own, st.send)]
        recvs = [(st.src, t) for t in _recv_parts(buf, st.recv)]
        batch = self.peers.post(sends, recvs) if self.peers is not None else []
        return st, buf, [batch, sends]  # the sends stay referenced until the batch is done


def forward(
    run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv``: k and v already packed (``k``/``v`` are then its views), so nothing is copied."""
    out, lse = new_accumulators(q, v.shape[-1])
    walk = _Steps(run, pack_kv(k, v) if kv is None else kv)
    pending = walk.post_kv(1)
    step_forward(walk.plan.own.on(q.device), run, q, walk.own, out, lse)
    for s in range(1, walk.n):
        nxt = walk.post_kv(s + 1) if s + 1 < walk.n else (None, None, [])
        st, buf, keep = pending
        if keep:
            Peers.wait(keep[0])
        if st is not None and buf is not None and not st.plan.empty:
            step_forward(st.plan.on(q.device), run, q, buf, out, lse)
        pending = nxt
    return out, lse  # accumulator dtype: the caller adds any sink and rounds once


def _land(home: tuple | None, dkv: torch.Tensor) -> None:
    """Wait for a returned dK/dV partial and add it to the own block's rows it belongs to."""
    if home is None:
        return
    batch, buf, rows, _ = home
    Peers.wait(batch)
    if buf is None:
        return
    if rows.packed:
        accumulate(dkv, None, rows.index_on(dkv.device), buf)
        return
    off = 0
    for a, b in rows.spans:
        accumulate(dkv, (a, b), None, buf[off : off + b - a])
        off += b - a


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkv = backward_packed(run, dout, q, pack_kv(k, v), out, lse)
    return dq, dkv[..., : run.dk], dkv[..., run.dk :]  # accumulator dtype: the caller rounds once


def backward_packed(run: Run, dout, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`backward` on packed ``kv``; returns ``dq`` and the packed ``dkv`` (accumulator dtype)."""
    saved = (dout, q, out, lse)
    walk = _Steps(run, kv)
    dq = GradAcc(q)
    dkv = torch.zeros(walk.own.shape, dtype=acc_dtype(q), device=q.device)
    pending = walk.post_kv(1)
    step_backward(walk.plan.own.on(q.device), run, saved, walk.own, dq, dkv)
    home = None
    for s in range(1, walk.n):
        nxt = walk.post_kv(s + 1) if s + 1 < walk.n else (None, None, [])
        st, buf, keep = pending
        if keep:
            Peers.wait(keep[0])
        if st is not None:
            part = None
            if buf is not None:
                part = torch.zeros((st.recv.n, *dkv.shape[1:]), dtype=dkv.dtype, device=q.device)
                step_backward(st.plan.on(q.device), run, saved, buf, dq, part)
            back = dkv.new_empty((st.send.n, *dkv.shape[1:])) if st.send.n else None
            sends = [(st.src, part)] if part is not None else []
            batch = walk.home.post(sends, [(st.dst, back)] if back is not None else []) if walk.home else []
            _land(home, dkv)
            home = (batch, back, st.send, part)
        pending = nxt
    _land(home, dkv)
    return dq.result(), dkv
