"""``p2p``: KV moves straight to the ranks whose queries see it, overlapped with compute.

The plan (:mod:`.p2p_plan`) lists, per step s, the rows that arrive from ``rank - s`` and
the rows of the own block that leave for ``rank + s``. Step s+1's transfers are posted
before step s is computed (double buffering), so transfer overlaps compute. Every rank
walks the same step numbers 1 .. n-1 — posting nothing where its plan has nothing — so the
messages between any two ranks are posted in the same order on both sides.

Backward: KV moves exactly as in forward. Right after a step's block is computed, its fp32
(fp64 for fp64 input) dK/dV partial goes straight home to the owner (the same rows that
arrived), in the same batch as the next step's KV, and the partial of the rows this rank
sent at that step comes back from their reader; the owner adds it to its own block's
gradient one step later, so at most two are in flight. All sizes come from the host plan:
nothing here reads a device value. Large shards run the backward's ring once per group of
whole KV heads (:func:`head_groups`), so its overlap buffers are that much smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import VarlenCall
from ..runtime.comm import Message, Peers
from ..runtime.ops import gather_rows
from .a2a_groups import RING_MIN_GROUP_BYTES
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, add_rows, step_backward, step_forward
from .p2p_plan import P2PPlan, Rows, Step, build_plan, plan_narrow, use_split

__all__ = ["P2PPlan", "build_plan", "prepare", "forward", "backward", "backward_packed"]

# One tag per stream, so no stream ever matches another's message on backends with tags.
_KV_TAG, _HOME_TAG = 0, 2


@dataclass(frozen=True, kw_only=True)
class _Slot:
    """One step as the walk needs it, precomputed once per plan and device (host work that
    would otherwise repeat every layer, forward and backward)."""

    step: Step
    """The plan's step."""
    calls: list[VarlenCall]
    """Its calls with index tensors on the device."""
    fwd_calls: list[VarlenCall]
    """The forward's calls where it splits wide ones (``calls`` unless the plan split some,
    :func:`.p2p_plan.split_wide`; run where :func:`.p2p_plan.use_split` says so)."""
    send_idx: torch.Tensor | None
    """Gather index of the sent rows when they travel packed, else None (one view per span)."""
    recv_cuts: tuple[tuple[int, int], ...]
    """Row ranges of the receive buffer, one per message of a tensor (one when packed)."""


@dataclass(frozen=True, kw_only=True)
class _Walk:
    own: list[VarlenCall]
    """The own block's calls, a call over every local query first: its kernel outputs then
    become the dq (and, covering every key, dK/dV) accumulators instead of being added to zeros."""
    slots: list[_Slot | None]
    """Index s: step s (1 .. n-1), None where this participant neither sends nor receives.
    Every participant walks the same slot numbers, so both ends of a pair post in one order."""


def _walk(plan: P2PPlan, device: torch.device) -> _Walk:
    """The plan's :class:`_Walk` on ``device``: its index tensors uploaded and put in walking
    order, once (normally by :func:`prepare`, when the plan is prepared for the device; the
    host side was planned by :func:`.p2p_plan.build_plan`)."""
    key = str(device)
    walk = plan.walks.get(key)
    if walk is not None:
        return walk
    own = plan.own.on(device)
    own = [own[i] for i in plan.own_order] if plan.own_order else list(own)
    slots: list[_Slot | None] = [None] * len(plan.counts)
    for st in plan.steps:
        send_idx = st.send.index_on(device) if st.send.n and st.send.packed else None
        calls = st.plan.on(device)
        fwd = st.fwd.on(device) if st.fwd is not None else calls
        slots[st.slot] = _Slot(step=st, calls=calls, fwd_calls=fwd, send_idx=send_idx, recv_cuts=st.recv.cuts)
    walk = plan.walks[key] = _Walk(own=own, slots=slots)
    return walk


@dataclass(frozen=True, kw_only=True)
class _Narrow:
    """A :class:`.p2p_plan.Narrow` on a device."""

    rows: torch.Tensor
    """``[r]`` ascending local query rows read by any call of any step."""
    local: list[list[tuple] | None]
    """Index s: step s's calls' rows in the narrowed copies, each ``(slice, None)`` (a view)
    or ``(None, index)``; None where the slot has no calls."""


def _narrow(plan: P2PPlan, device: torch.device) -> _Narrow | None:
    """The plan's :class:`_Narrow` on ``device``, or None where the ring's calls read every
    local row (or none). Planned on the host by :func:`.p2p_plan.plan_narrow` (a2a's plan
    builds it; any other plan plans it here, once)."""
    key = f"{device}#narrow"
    if key in plan.walks:
        return plan.walks[key]
    if plan.narrow is None:
        plan.narrow = plan_narrow(plan)
    host, narrow = plan.narrow, None
    if host.rows is not None:
        up = lambda x: torch.from_numpy(x).to(device, non_blocking=True)  # noqa: E731
        local = [[(sl, None if i is None else up(i)) for sl, i in ls] if ls is not None else None for ls in host.local]
        narrow = _Narrow(rows=up(host.rows), local=local)
    plan.walks[key] = narrow
    return narrow


def prepare(plan: P2PPlan, device: torch.device) -> None:
    """Upload what the ring reads on ``device`` (its walk, and the narrowed rows where they are
    planned), so a layer's forward and backward only look them up."""
    _walk(plan, device)
    if plan.narrow is not None:
        _narrow(plan, device)


def _buffer(own: KV, n: int) -> tuple[KV, list[torch.Tensor]]:
    """A receive buffer for ``n`` rows and its tensors in message order: the packed rows, or
    K rows and V rows (:func:`_kv_rows`)."""
    k, v, packed = own
    if packed is not None:
        buf = packed.new_empty((n, *packed.shape[1:]))
        return KV.of(buf, k.shape[-1]), [buf]
    kv = _kv_rows(own, n)
    return kv, [kv.k, kv.v]


def _kv_rows(kv: KV, n: int, dtype: torch.dtype | None = None) -> KV:
    """``n`` rows of K and of V (``dtype``: theirs if None), each contiguous: they travel as
    two messages. Two allocations, freed together: two views of one flat allocation cost the
    host more per step than a second allocation."""
    k, v = kv.k, kv.v
    return KV(k.new_empty((n, *k.shape[1:]), dtype=dtype), v.new_empty((n, *v.shape[1:]), dtype=dtype))


def _kv_messages(own: KV, sl: _Slot | None) -> tuple[KV | None, list[Message], list[Message]]:
    """Receive buffer, sends and receives of a step's KV transfer (nothing for an empty slot)."""
    if sl is None:
        return None, [], []
    st = sl.step
    xs = [own.packed] if own.packed is not None else [own.k, own.v]
    if not st.send.n:
        sends = []
    elif sl.send_idx is not None:
        sends = [Message(st.dst, gather_rows(x, sl.send_idx), _KV_TAG) for x in xs]
    else:  # a head group's slice of k and v (backward by head groups) is not contiguous: rows copied
        sends = [Message(st.dst, _dense(x[a:b]), _KV_TAG) for x in xs for a, b in st.send.spans]
    if not sl.recv_cuts:
        return None, sends, []
    buf, parts = _buffer(own, st.recv.n)
    cuts = sl.recv_cuts
    if len(cuts) == 1:  # one message per tensor: the buffer itself, no slice views
        return buf, sends, [Message(st.src, x, _KV_TAG) for x in parts]
    recvs = [Message(st.src, x[a:b], _KV_TAG) for x in parts for a, b in cuts]
    return buf, sends, recvs


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a message can carry it: itself when contiguous, else a contiguous copy."""
    return x if x.is_contiguous() else x.contiguous()


def forward(
    run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv``: k and v already packed (``k``/``v`` are then its views): sent packed."""
    acc = OutAcc(q, v.shape[-1])
    walk = _walk(run.plan, q.device)
    own, slots = KV(k, v, kv), walk.slots
    peers = Peers(run.group, _KV_TAG, q.device) if run.group is not None else None
    n = len(slots)
    split = use_split(q.shape[0], q.shape[1], v.shape[-1], q.element_size())
    pending = _post(peers, own, slots[1]) if n > 1 else None
    views: dict = {}
    step_forward(walk.own, run, q, own, acc, views)
    for s in range(1, n):
        nxt = _post(peers, own, slots[s + 1]) if s + 1 < n else None
        batch, buf = pending
        pending = nxt
        Peers.wait(batch)
        del batch
        calls = (slots[s].fwd_calls if split else slots[s].calls) if slots[s] is not None else None
        if buf is not None and calls:
            bufs, buf = [buf], None  # handed over: step_forward frees it after its last kernel call
            step_forward(calls, run, q, bufs, acc, views)
            del bufs
        del buf
    return acc.result()  # accumulator dtype: the caller adds any sink and rounds once


def _post(peers: Peers | None, own: KV, sl: _Slot | None, home: tuple = ([], [])) -> tuple[list, KV | None]:
    """Post a step's KV transfer, and ``home``'s (sends, receives) of dK/dV partials in the
    same batch (after the KV messages, on both ends)."""
    buf, sends, recvs = _kv_messages(own, sl)
    sends, recvs = sends + home[0], recvs + home[1]
    batch = peers.post(sends, recvs) if peers is not None and (sends or recvs) else []
    return batch, buf


def _land(back: KV | None, rows: Rows | None, dkv: KV) -> None:
    """Add a returned dK/dV partial (its batch done) to the own block's rows it belongs to."""
    if back is None:
        return
    pairs = [(dkv.k, back.k), (dkv.v, back.v)]
    if rows.packed:
        idx = rows.index_on(back.k.device)
        for acc, part in pairs:
            add_rows(acc, None, idx, part)
        return
    off = 0
    for a, b in rows.spans:
        for acc, part in pairs:
            add_rows(acc, (a, b), None, part[off : off + b - a])
        off += b - a


GROUPS: int | None = None
"""Forces the largest count in {1, 2, 4} up to this one that :func:`head_groups` allows,
regardless of size (tests: small batches); None chooses by size."""


def head_groups(plan: P2PPlan, hq: int, hkv: int, dv: int, dtype: torch.dtype) -> list | None:
    """The backward's head groups: ``[((q0, q1), (k0, k1)), ...]``, or None for one.

    Run by ``G`` groups of whole KV heads (and their query heads), the ring moves and computes
    1/G of the heads at a time: its received blocks, returned partials and a ring step's kernel
    outputs are 1/G as large, for G times the messages and kernel calls (the same bytes), the
    sent rows copied out of the head slice, and the own block's gradients copied into the
    layer's instead of adopted. Two groups of disjoint whole KV heads (a KV head shared by two
    groups would travel twice), and only where a group's dout on the largest rank is at least
    :data:`.a2a_groups.RING_MIN_GROUP_BYTES`. Every input is the same on every rank."""
    rows = max(plan.counts) if plan.counts else 0
    for g in (4, 2) if GROUPS is not None else (2,):
        if hkv % g or hq % hkv or (GROUPS is not None and g > GROUPS):
            continue
        if GROUPS is None and rows * (hq // g) * dv * dtype.itemsize < RING_MIN_GROUP_BYTES:
            continue
        qs, ks = hq // g, hkv // g
        return [((i * qs, (i + 1) * qs), (i * ks, (i + 1) * ks)) for i in range(g)]
    return None


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the accumulator dtype (the caller rounds once): by head groups where
    :func:`head_groups` gives some, each group's ring accumulating into its heads of the
    layer's gradients."""
    parts = head_groups(run.plan, q.shape[1], k.shape[1], v.shape[-1], q.dtype)
    if parts is None:
        return _backward(run, (dout, q, out, lse), KV(k, v))
    dtype = acc_dtype(q)
    dq, dk, dv = (x.new_empty(x.shape, dtype=dtype) for x in (q, k, v))
    for (a, b), (ka, kb) in parts:
        into = (dq[:, a:b], KV(dk[:, ka:kb], dv[:, ka:kb]))
        saved = (dout[:, a:b], q[:, a:b], out[:, a:b], lse[:, a:b])
        _backward(run, saved, KV(k[:, ka:kb], v[:, ka:kb]), into)
    return dq, dk, dv


def backward_packed(
    run: Run, saved: list[torch.Tensor], kv: torch.Tensor, into: tuple | None = None
) -> tuple[torch.Tensor, ...]:
    """One ring's backward on packed ``kv`` (its K and V halves as views; a head slice of it
    under a2a+p2p's head groups, which that schedule runs itself): ``dq, dk, dv`` as
    :func:`backward`'s. ``saved``: ``[dout, q, out, lse]``, handed over (emptied here): the
    caller holds no other reference to ``dout`` and ``out``, so after the own block only the
    rows the ring's calls read are kept of them (:class:`_Narrow`). ``into``: as
    :func:`_backward`'s."""
    return _backward(run, saved, KV.of(kv, run.dk), into)


def _backward(
    run: Run, saved: tuple | list, kv: KV, into: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps as in forward. The batch posted before step s computes carries step s+1's KV and
    step s-1's dK/dV partial home (with the receive of the partial of the rows sent at s-1):
    one batch per step, and each partial still travels behind the next step's compute.

    Every gradient is a :class:`GradAcc`: dq, dK and dV adopt the own whole-block call's kernel
    outputs, and a block's dK/dV partial adopts its call's when one call covers the block, so
    no zero-filled buffer is alive at a kernel call (a partial goes home as two messages, K
    then V, for that reason; a packed one would be a copy). ``saved``: ``(dout, q, out, lse)``;
    a list is handed over (emptied here): nothing else holds ``dout`` and ``out``, so they may
    be narrowed (:class:`_Narrow`). ``into``: ``(dq, KV(dk, dv))`` buffers (accumulator dtype;
    ``dq`` may be None) to accumulate into instead of adopting kernel outputs (a head group's
    slices)."""
    owned = isinstance(saved, list)
    if owned:
        handed, saved = saved, tuple(saved)
        handed.clear()
        del handed
    q = saved[1]
    walk = _walk(run.plan, q.device)
    slots, n = walk.slots, len(walk.slots)
    peers = Peers(run.group, _KV_TAG, q.device) if run.group is not None else None
    dq = GradAcc(q, into[0] if into else None)
    dtype = acc_dtype(q)
    # made on first use (adopting a whole kernel output), or ``into``'s
    dkv = KV(*(GradAcc(x, into[1][i] if into else None) for i, x in enumerate((kv.k, kv.v))))
    pending = _post(peers, kv, slots[1]) if n > 1 else ([], None)
    views: dict = {}
    step_backward(walk.own, run, saved, kv, dq, dkv, views)
    narrow = _narrow(run.plan, q.device) if owned else None
    if narrow is not None:  # keep only the rows the ring reads: each whole tensor freed once gathered
        views, rows = {}, list(saved)
        del saved
        for i in range(len(rows)):
            rows[i] = gather_rows(rows[i], narrow.rows)
        saved = tuple(rows)
        del rows
    del q
    landing: tuple = (None, None)  # the returned partial the pending batch receives, and its rows
    done: tuple | None = None  # (slot, partial) computed, not yet sent home
    for s in range(1, n + 1):
        home, back = ([], []), None
        if done is not None:
            st, part = slots[done[0]].step, done[1]
            back = _kv_rows(kv, st.send.n, dtype) if st.send.n else None
            home = (
                [Message(st.src, x.result(), _HOME_TAG) for x in (part.k, part.v)] if part is not None else [],
                [Message(st.dst, x, _HOME_TAG) for x in (back.k, back.v)] if back is not None else [],
            )
            del part
        nxt = _post(peers, kv, slots[s + 1] if s + 1 < n else None, home)
        del home
        batch, buf = pending
        pending = nxt
        Peers.wait(batch)
        del batch
        _land(*landing, dkv)
        landing = (back, slots[done[0]].step.send) if done is not None else (None, None)
        del back
        done = None
        if s == n:
            break
        sl = slots[s]
        if sl is not None:
            part = None
            if buf is not None:
                part = KV(GradAcc(buf.k), GradAcc(buf.v))
                local = narrow.local[s] if narrow is not None else None
                step_backward(sl.calls, run, saved, buf, dq, part, views, local)
            del buf  # the consumed block: freed before the next one arrives
            done = (s, part)
            del part
    Peers.wait(pending[0])
    _land(*landing, dkv)
    return dq.result(), dkv.k.result(), dkv.v.result()
