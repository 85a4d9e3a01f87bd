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
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, accumulate, step_backward, step_forward
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
    """Walks steps 1 .. n-1 of a plan, posting each step's KV transfer one step ahead.

    ``own`` is the layer's K and V, sent as they are (two messages per range), or views of a
    packed KV buffer (a2a's), sent packed (one). A receive buffer has the sender's layout: one
    allocation either way, K rows then V rows when they travel apart."""

    def __init__(self, run: Run, own: KV) -> None:
        self.plan: P2PPlan = run.plan
        self.by_slot = {st.slot: st for st in self.plan.steps}
        self.n = len(self.plan.counts)
        self.own = own
        self.peers = Peers(run.group, _KV_TAG) if run.group is not None else None
        self.home = Peers(run.group, _HOME_TAG) if run.group is not None else None

    def _buffer(self, n: int) -> tuple[KV, list[torch.Tensor]]:
        """A receive buffer for ``n`` rows and its parts in message order."""
        k, v, packed = self.own
        if packed is not None:
            buf = packed.new_empty((n, *packed.shape[1:]))
            return KV.of(buf, k.shape[-1]), [buf]
        nk = n * int(torch.Size(k.shape[1:]).numel())
        flat = k.new_empty(nk + n * int(torch.Size(v.shape[1:]).numel()))
        kb, vb = flat[:nk].view(n, *k.shape[1:]), flat[nk:].view(n, *v.shape[1:])
        return KV(kb, vb), [kb, vb]

    def post_kv(self, slot: int) -> tuple[Step | None, KV | None, list]:
        st = self.by_slot.get(slot)
        if st is None:
            return None, None, []
        buf, parts = self._buffer(st.recv.n) if st.recv.n else (None, [])
        own = [self.own.packed] if self.own.packed is not None else [self.own.k, self.own.v]
        sends = [(st.dst, t) for x in own for t in _send_parts(x, st.send)]
        recvs = [(st.src, t) for x in parts for t in _recv_parts(x, st.recv)]
        batch = self.peers.post(sends, recvs) if self.peers is not None else []
        return st, buf, [batch, sends]  # the sends stay referenced until the batch is done


def forward(
    run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv``: k and v already packed (``k``/``v`` are then its views): sent packed."""
    acc = OutAcc(q, v.shape[-1])
    walk = _Steps(run, KV(k, v, kv))
    pending = walk.post_kv(1)
    step_forward(walk.plan.own.on(q.device), run, q, walk.own, acc)
    for s in range(1, walk.n):
        nxt = walk.post_kv(s + 1) if s + 1 < walk.n else (None, None, [])
        st, buf, keep = pending
        pending = nxt
        if keep:
            Peers.wait(keep[0])
        del keep
        bufs, buf = [buf], None  # handed over: step_forward frees it after its last kernel call
        if st is not None and bufs[0] is not None and not st.plan.empty:
            step_forward(st.plan.on(q.device), run, q, bufs, acc)
        del st, bufs
    return acc.result()  # accumulator dtype: the caller adds any sink and rounds once


def _land(home: tuple | None, dkv: KV) -> None:
    """Wait for a returned dK/dV partial and add it to the own block's rows it belongs to."""
    if home is None:
        return
    batch, buf, rows, _ = home
    Peers.wait(batch)
    if buf is None:
        return
    # a packed accumulator (a2a's) takes the packed partial in one op, else K and V apart
    pairs = [(dkv.packed, buf.packed)] if dkv.packed is not None else [(dkv.k, buf.k), (dkv.v, buf.v)]
    if rows.packed:
        idx = rows.index_on(buf.k.device)
        for acc, part in pairs:
            accumulate(acc, None, idx, part)
        return
    off = 0
    for a, b in rows.spans:
        for acc, part in pairs:
            accumulate(acc, (a, b), None, part[off : off + b - a])
        off += b - a


def _partial(kv: KV, n: int, dtype: torch.dtype, zero: bool) -> KV:
    """A packed ``[n, Hk, D + Dv]`` dK|dV buffer shaped like ``kv``'s rows: one message home."""
    shape = (n, kv.k.shape[1], kv.k.shape[-1] + kv.v.shape[-1])
    buf = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=kv.k.device)
    return KV.of(buf, kv.k.shape[-1])


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkv = _backward(run, dout, q, KV(k, v), out, lse)
    return dq, dkv.k, dkv.v  # accumulator dtype: the caller rounds once


def backward_packed(run: Run, dout, q, kv, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`backward` on packed ``kv``; returns ``dq`` and the packed ``dkv`` (accumulator dtype)."""
    dq, dkv = _backward(run, dout, q, KV.of(kv, run.dk), out, lse)
    return dq, dkv.packed


def _backward(run: Run, dout, q, kv: KV, out, lse) -> tuple[torch.Tensor, KV]:
    saved = (dout, q, out, lse)
    walk = _Steps(run, kv)
    dq = GradAcc(q)
    dtype = acc_dtype(q)
    if kv.packed is not None:  # packed like kv: a2a moves it home in one all-to-all
        dkv = _partial(kv, kv.k.shape[0], dtype, True)
    else:  # the layer's dk and dv themselves
        dkv = KV(torch.zeros_like(kv.k, dtype=dtype), torch.zeros_like(kv.v, dtype=dtype))
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
                part = _partial(kv, st.recv.n, dtype, True)
                step_backward(st.plan.on(q.device), run, saved, buf, dq, part)
            del buf, keep  # the consumed block: freed before the next one arrives
            back = _partial(kv, st.send.n, dtype, False) if st.send.n else None
            sends = [(st.src, part.packed)] if part is not None else []
            recvs = [(st.dst, back.packed)] if back is not None else []
            batch = walk.home.post(sends, recvs) if walk.home else []
            _land(home, dkv)
            home = (batch, back, st.send, part)
            del part, back
        pending = nxt
    _land(home, dkv)
    return dq.result(), dkv
