"""Staged ``p2p``: every message posted at once, the local stage computed while they travel,
then one joined stage over the own and received keys in document order — no merges.

The plan (:mod:`.staged_plan`) sits beside the ring's (:mod:`.p2p_plan`) and moves the same
rows: the ring's ``send``/``recv`` of every step, posted in step order in one batch, so the
messages between two ranks keep one order on both sides. Each received piece lands straight
in its rows of the joined buffer (a packed step in a buffer of its own, copied into place);
the own rows are copied in while the messages travel.

Backward: KV moves again; the local stage runs while it travels; the joined stage's dK/dV
partials land as the calls produce them, received rows' in one fp32 buffer in step order
(each step's slice goes home as it is, in one batch with the receive of the partials of the
rows this rank sent), own rows' added to the own block's gradient.
Large shards run the backward by head groups, as the ring does (:func:`.p2p.head_groups`).
"""

from __future__ import annotations

import torch

from ..runtime.comm import Message, Peers
from ..runtime.ops import gather_rows, index_add_rows
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, add_rows, step_backward, step_forward
from .p2p import _buffer, _dense, _kv_rows, head_groups
from .p2p import _land as _land_home
from .placed import PlacedGrad, PlacedOut
from .staged_moves import Moves
from .staged_plan import StagedPlan

__all__ = ["forward", "backward", "backward_packed", "prepare"]

_KV_TAG, _HOME_TAG = 0, 2


def prepare(plan, device: torch.device) -> None:
    """Upload what the staged schedule reads on ``device``: the stages' calls, the moves' and
    the packed steps' indices."""
    st: StagedPlan = plan.staged
    st.local.on(device)
    st.joined.on(device)
    moves = [st.own] + [p.recv_moves for p in st.pieces.values() if p.recv_moves is not None]
    for m in moves:
        if m.runs is None:
            m.on(device)
    for s in plan.steps:
        if st.pieces[s.slot].send_packed:
            s.send.index_on(device)
    for k in st.keys:
        if k.runs is None:
            k.on(device)


def _tensors(kv: KV) -> list[torch.Tensor]:
    """The tensors a message of ``kv``'s rows carries: the packed K|V rows, or K and V."""
    return [kv.packed] if kv.packed is not None else [kv.k, kv.v]


def _post_kv(peers: Peers, plan, own: KV, joined: KV | None) -> tuple[list, list]:
    """Post every step's KV messages in one batch, in step order: each piece straight into its
    rows of ``joined`` (the receiver allocated it), a packed step into a buffer of its own.
    Packed K|V (``own.packed``: a2a+p2p's head-sharded KV) travels as one message per piece.
    Returns the batch and the packed receives ``(buffer, moves)`` to copy into place."""
    st: StagedPlan = plan.staged
    sends, recvs, packed = [], [], []
    xs = _tensors(own)
    for step in plan.steps:
        pc = st.pieces[step.slot]
        if step.send.n:
            if pc.send_packed:
                idx = step.send.index_on(own.k.device)
                sends += [Message(step.dst, gather_rows(x, idx), _KV_TAG) for x in xs]
            else:
                sends += [Message(step.dst, _dense(x[a : a + n]), _KV_TAG) for x in xs for a, n in pc.send]
        if step.recv.n:
            if pc.recv_packed:
                buf, parts = _buffer(own, step.recv.n)
                recvs += [Message(step.src, x, _KV_TAG) for x in parts]
                packed.append((buf, pc.recv_moves))
            else:
                recvs += [Message(step.src, x[a : a + n], _KV_TAG) for x in _tensors(joined) for a, n in pc.recv]
    batch = peers.post(sends, recvs) if sends or recvs else []
    return batch, packed


def _move_into(dst: torch.Tensor, src: torch.Tensor, moves: Moves) -> None:
    """``dst[moves.dst] = src[moves.src]``: slice copies, or one indexed copy."""
    runs = moves.runs
    if runs is not None:
        for s0, d0, n in runs:
            dst[d0 : d0 + n].copy_(src[s0 : s0 + n])
        return
    s_idx, d_idx = moves.on(dst.device)
    # identity: src's leading rows in order (a view; src may hold rows the move leaves out)
    dst.index_copy_(0, d_idx, src[: len(moves.src)] if moves.identity_src else gather_rows(src, s_idx))


def _exchange(run: Run, own: KV) -> tuple[KV | None, list, list]:
    """Allocate the joined buffer (packed where ``own`` is), post the KV messages into it and
    copy the own rows in: ``(joined, batch, packed)`` (:func:`_post_kv`); no joined buffer
    where nothing needs one."""
    st: StagedPlan = run.plan.staged
    joined = _buffer(own, st.rows)[0] if st.rows else None
    batch, packed = _post_kv(Peers(run.group, _KV_TAG, own.k.device), run.plan, own, joined)
    if joined is not None:
        for dst, src in zip(_tensors(joined), _tensors(own)):
            _move_into(dst, src, st.own)
    return joined, batch, packed


def _land(joined: KV, packed: list) -> None:
    """Copy the packed steps' rows into place (their batch done)."""
    for buf, moves in packed:
        for dst, src in zip(_tensors(joined), _tensors(buf)):
            _move_into(dst, src, moves)


def forward(
    run: Run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and lse: the kernel's dtype where each query row is in one call (copied into
    place), else the accumulator dtype (the caller adds any sink and rounds once). ``kv``: k
    and v already packed (``k``/``v`` are then its views): sent and joined packed."""
    device = q.device
    st: StagedPlan = run.plan.staged
    own = KV(k, v, kv)
    joined, batch, packed = _exchange(run, own)
    acc = PlacedOut(q, v.shape[-1], st.covered) if st.once else OutAcc(q, v.shape[-1])
    views: dict = {}
    step_forward(st.local.on(device), run, q, own, acc, views)
    Peers.wait(batch)
    del batch
    calls = st.joined.on(device)
    if calls:
        _land(joined, packed)
        del packed
        joined = [joined]
        step_forward(calls, run, q, joined, acc, views)  # the joined KV is freed after its last call
    return acc.result()


def backward(run: Run, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (the kernel's dtype where placed), dk, dv (accumulator dtype); by head groups where
    :func:`.p2p.head_groups` gives some."""
    parts = head_groups(run.plan, q.shape[1], k.shape[1], v.shape[-1], q.dtype)
    if parts is None:
        return _backward(run, (dout, q, out, lse), KV(k, v))
    dtype = acc_dtype(q)
    # each query row's dq comes from one call where placed: kept in the kernel's dtype, as
    # without head groups (no widened buffer, nothing to round back)
    dq = q.new_empty(q.shape, dtype=q.dtype if run.plan.staged.once else dtype)
    dk, dv = (x.new_empty(x.shape, dtype=dtype) for x in (k, v))
    for (a, b), (ka, kb) in parts:
        saved = (dout[:, a:b], q[:, a:b], out[:, a:b], lse[:, a:b])
        _backward(run, saved, KV(k[:, ka:kb], v[:, ka:kb]), (dq[:, a:b], KV(dk[:, ka:kb], dv[:, ka:kb])))
    return dq, dk, dv


def backward_packed(run: Run, saved: list, kv: torch.Tensor, into: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """One staged pass on packed ``kv`` (a2a+p2p's ring across its groups, or one of its head
    groups, which that schedule runs itself): ``dq, dk, dv`` as :func:`_backward`'s.
    ``saved``: ``[dout, q, out, lse]``, handed over (emptied here)."""
    held = tuple(saved)
    saved.clear()
    return _backward(run, held, KV.of(kv, run.dk), into)


class _JoinedGrad:
    """dK or dV of the joined stage, split as the calls produce it (:class:`.staged_plan.KeyRuns`,
    one per call, in call order): received rows' partials land in ``home`` (fp32, received rows
    in step order: each step's slice goes home as it is), own rows' are added to the own
    block's gradient. No joined-sized accumulator, no copy between."""

    def __init__(self, home: torch.Tensor, own: GradAcc, st: StagedPlan) -> None:
        self.home, self.own, self.keys, self.i = home, own, st.keys, 0

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        k = self.keys[self.i]
        self.i += 1
        if k.runs is None:
            own_pos, own_dst, home_pos, home_dst = k.on(src.device)
            if own_pos.numel():
                add_rows(self.own, None, own_dst, gather_rows(src, own_pos))
            if home_pos.numel():
                index_add_rows(self.home, home_dst, gather_rows(src, home_pos))
            return
        for kind, off, dst, n in k.runs:
            part = src[off : off + n]
            if kind == 0:
                add_rows(self.own, (dst, dst + n), None, part)
            elif kind == 1:
                self.home[dst : dst + n].copy_(part)  # widened by the copy
            else:
                self.home[dst : dst + n].add_(part)


def _home(home: KV | None, steps: list, kv: KV, dtype: torch.dtype, st: StagedPlan) -> tuple[list, list, list]:
    """The received rows' dK/dV partials going home (each step's slice of ``home``), and the
    receives of the partials of the rows this rank sent (one K and one V buffer each)."""
    sends, recvs, backs = [], [], []
    for step in steps:
        if step.recv.n:
            base = st.recv_at[step.slot]
            sends += [Message(step.src, x[base : base + step.recv.n], _HOME_TAG) for x in (home.k, home.v)]
        if step.send.n:
            back = _kv_rows(kv, step.send.n, dtype)
            recvs += [Message(step.dst, x, _HOME_TAG) for x in (back.k, back.v)]
            backs.append((back, step.send))
    return sends, recvs, backs


def _backward(run: Run, saved: tuple, kv: KV, into: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """One pass of the two stages; ``into``: ``(dq, KV(dk, dv))`` buffers (accumulator dtype;
    a head group's slices) to write into instead of adopting kernel outputs."""
    plan, q = run.plan, saved[1]
    device = q.device
    st: StagedPlan = plan.staged
    peers = Peers(run.group, _KV_TAG, device)
    joined, batch, packed = _exchange(run, kv)
    if st.once:
        dq = PlacedGrad(q, st.covered, into[0] if into else None)
    else:
        dq = GradAcc(q, into[0] if into else None)
    dkv = KV(*(GradAcc(x, into[1][i] if into else None) for i, x in enumerate((kv.k, kv.v))))
    views: dict = {}
    step_backward(st.local.on(device), run, saved, kv, dq, dkv, views)
    Peers.wait(batch)
    del batch
    calls = st.joined.on(device)
    dtype = acc_dtype(q)
    home = None
    if calls:
        _land(joined, packed)
        del packed
        new = torch.zeros if st.home_zero else torch.empty
        home = KV(*(new((st.received, *x.shape[1:]), dtype=dtype, device=device) for x in (kv.k, kv.v)))
        into = KV(_JoinedGrad(home.k, dkv.k, st), _JoinedGrad(home.v, dkv.v, st))
        step_backward(calls, run, saved, joined, dq, into, views)
        del joined, into
    sends, recvs, backs = _home(home, plan.steps, kv, dtype, st)
    batch = peers.post(sends, recvs) if sends or recvs else []
    del sends, recvs, home
    Peers.wait(batch)
    for back, rows in backs:
        _land_home(back, rows, dkv)
    return dq.result(), dkv.k.result(), dkv.v.result()
