"""``a2a`` (Ulysses) and ``a2a+p2p`` (hierarchical): all-to-all from sequence to head shards.

Inside an a2a group of ``A`` consecutive CP ranks, an all-to-all turns each member's tokens
of all heads into the group's tokens of its share of the heads. The received rows (member by member)
are put in global (sequence, position) order by one gather with a plan index, so every
sequence is contiguous and the local calls need no further gathers. Attention over those
tokens is then the ``p2p`` ring across the ``P`` a2a groups (``P == 1`` for plain ``a2a``: a
ring of one, no communication) — the very same ring, calls and merge as ``p2p``. The output
goes back through the inverse permutation and all-to-all; the backward mirrors every step,
except that the output does not travel: each row's ``dout . out`` does, and a stand-in built
from ``dout`` takes the output's place in the kernel (:mod:`.delta`).

Heads: any counts (:mod:`.heads`). Members hold whole GQA groups, dealt out as evenly as the
counts allow; with fewer KV heads than members, a KV head is replicated to the members
sharing its query heads. The replicas' gradients come back from the ring in fp32 (fp64 for
fp64 input), travel home and are summed in that precision and rounded once, so bf16 dK/dV
lose nothing to replication. The attention-sink offset joins each member's final merge.
The backward runs by head groups where the batch is large enough for that to lower the
peak (:mod:`.a2a_groups`); ``a2a+p2p`` then runs its ring once per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..masks import MaskSpec
from ..runtime.autocast import autocast_off
from ..runtime.ops import floor_lse_
from ..sharding import CPSharding
from . import a2a_groups, p2p, staged
from .common import KV, GradAcc, OutAcc, Run, acc_dtype, apply_sink, new_accumulators, step_forward, take
from .delta import row_dot
from .first_order import first_order
from .heads import assemble, from_heads, head_room, split_heads, to_heads
from .p2p_plan import plan_narrow, split_wide
from .route import Route, from_group, routed
from .staged_plan import build_staged, staged_fits

__all__ = ["A2APlan", "build_plan", "group_union", "attention", "split_heads"]


@dataclass
class A2APlan:
    """Host plan of one rank for ``a2a`` / ``a2a+p2p``."""

    counts: list[int]
    """Tokens of each member of this rank's a2a group (all-to-all split sizes)."""
    perm: torch.Tensor
    """Row of the member-ordered receive buffer for each row in global order."""
    inv_perm: torch.Tensor
    """Inverse of ``perm``."""
    ring: p2p.P2PPlan
    """The p2p plan across a2a groups over the groups' token sets (one participant for ``a2a``)."""
    member: int = 0
    """This rank's index in its a2a group (which head shard it computes)."""
    route: Route | None = None
    """``perm`` as runs (:mod:`.route`): the eager path moves rows into place, no gathers."""
    _device: dict = field(default_factory=dict, repr=False)

    def perms_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._device:
            self._device[key] = (self.perm.to(device), self.inv_perm.to(device))
        return self._device[key]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_device"] = {}
        return state


def group_union(sharding: CPSharding, members: range) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The members' segments in global (sequence, position) order with adjacent ones joined,
    the receive-buffer row of each token in that order, and the members' token counts."""
    segs = np.concatenate([sharding.rank_segments(m) for m in members])
    n = segs[:, 2] - segs[:, 1]
    rows = np.cumsum(n) - n  # where each segment lands in the member-ordered receive buffer
    keep = n > 0
    segs, n, rows = segs[keep], n[keep], rows[keep]
    order = np.lexsort((segs[:, 1], segs[:, 0]))
    segs, n, rows = segs[order], n[order], rows[order]
    perm = np.repeat(rows - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    joined = np.ones(len(segs), dtype=bool)
    joined[1:] = (segs[1:, 0] != segs[:-1, 0]) | (segs[1:, 1] != segs[:-1, 2])
    first = np.nonzero(joined)[0]
    last = np.append(first[1:], len(segs)) - 1
    union = np.stack([segs[first, 0], segs[first, 1], segs[last, 2]], axis=1) if len(segs) else segs
    return union, perm, [sharding.num_tokens(m) for m in members]


def build_plan(sharding: CPSharding, a2a_size: int, cp_rank: int, mask: MaskSpec, schedule: str = "ring") -> A2APlan:
    """Plan for CP rank ``cp_rank`` = ``p2p_rank * a2a_size + a2a_rank``. ``schedule``: how the
    ring across the a2a groups runs, as ``p2p``'s (``"staged"`` where its memory bound holds
    over the groups' token sets, :mod:`.staged`; else ``"ring"``).

    The members of one a2a group share everything but their member index (the same tokens in
    the same order, the same ring across groups), so the group's part is built once per
    sharding and reused: planning every rank (``inspect_plan``, ``comm_type="auto"``) stays
    O(cp) instead of repeating each group's O(cp) union for every member.
    """
    me = cp_rank // a2a_size
    key = ("a2a-group", a2a_size, me, mask, schedule)
    group = sharding._plans.get(key)
    if group is None:
        ukey = ("a2a-unions", a2a_size)
        unions = sharding._plans.get(ukey)
        if unions is None:
            groups = sharding.cp_size // a2a_size
            unions = [group_union(sharding, range(g * a2a_size, (g + 1) * a2a_size)) for g in range(groups)]
            sharding._plans[ukey] = unions
        _, perm, counts = unions[me]
        perm_t = torch.from_numpy(perm.astype(np.int64))
        inv = torch.empty_like(perm_t)
        inv[perm_t] = torch.arange(perm_t.numel())
        segs = [u[0] for u in unions]
        ring = p2p.build_plan(segs, me, mask)
        if len(ring.counts) > 1 and schedule == "staged" and _staged_fits(sharding, segs, mask):
            ring.staged = build_staged(ring, segs, mask)
        elif len(ring.counts) > 1:  # the ring's backward owns dout and out: plan what it keeps of them
            ring.narrow = plan_narrow(ring)
            split_wide(ring)  # its forward runs beside the head-sharded q and KV: halve wide partials
        group = sharding._plans[key] = (counts, perm_t, inv, ring, Route.of(perm, counts))
    counts, perm_t, inv, ring, route = group
    return A2APlan(counts, perm_t, inv, ring, cp_rank % a2a_size, route)


def _staged_fits(sharding: CPSharding, segs: list[np.ndarray], mask: MaskSpec) -> bool:
    """:func:`.staged_plan.staged_fits` over the a2a groups' token sets (each group one ring
    participant), decided alike by every rank."""
    owner = np.repeat(np.arange(len(segs)), [len(s) for s in segs])
    lens = np.diff(np.asarray(sharding.cu_seqlens, np.int64))
    return staged_fits(np.concatenate(segs).reshape(-1, 3), owner, lens, len(segs), mask)


def _ring_backward(ring: Run):
    """The backward of a2a+p2p's ring across groups on packed KV: staged or step by step."""
    return staged.backward_packed if ring.plan.staged is not None else p2p.backward_packed


class _A2AAttention(torch.autograd.Function):
    """a2a -> p2p across the a2a groups -> inverse a2a, as one autograd node.

    One node, not one per communication step, so the dK/dV of replicated KV heads stay in the
    ring's fp32 (fp64) accumulators through the reverse all-to-all and the replica sum, and are
    rounded to the input dtype once (autograd would round at every edge). The softmax offset
    (attention sink) of this member's heads joins at the final merge. Saves what the ring saves
    (head-sharded q, kv, out and lse), nothing more.
    """

    @staticmethod
    def forward(ctx, q, k, v, offset, run: _A2ARun, a2a_group, heads):
        plan: A2APlan = run.plan
        q_parts, kv_parts = heads
        me, perm, dk = plan.member, plan.perms_on(q.device)[0], k.shape[-1]
        kv_h = to_heads((k, v), kv_parts, plan.counts, me, a2a_group, perm, route=plan.route)
        q_h = to_heads(q, q_parts, plan.counts, me, a2a_group, perm, route=plan.route)
        h0, h1 = q_parts[me]
        if h1 > h0 and len(run.ring.plan.counts) == 1:  # plain a2a: a ring of one
            calls = run.ring.plan.own.on(q.device)
            acc = _OnlyOut(q_h, v.shape[-1], len(calls) == 1)
            step_forward(calls, run.ring, q_h, KV.of(kv_h, dk), acc)
            out_h, lse = acc.result()
            del acc
        elif h1 > h0:
            fwd = staged.forward if run.ring.plan.staged is not None else p2p.forward
            out_h, lse = fwd(run.ring, q_h, kv_h[..., :dk], kv_h[..., dk:], kv=kv_h)
        if h1 > h0 and offset is not None:
            out_h, lse = apply_sink(out_h, lse, offset[h0:h1])
        if h1 <= h0:  # a member without heads computes nothing (its peers in the other groups neither)
            out_h, lse = new_accumulators(q_h, v.shape[-1])
        replicated = _overlap(kv_parts)
        if replicated:  # not saved (k and v are): freed before the output's move home
            del kv_h
        out_h = out_h.to(q.dtype)  # a 16-bit output: the fp32 accumulator freed before the move
        send, room = _home_order(out_h, plan, a2a_group, q.shape[0], q.shape[1])
        del out_h  # the accumulator: freed once sent (or permuted)
        y = from_heads(send, q_parts, plan.counts, me, a2a_group, q.shape[0], q.shape[1], room, plan.route)
        # the output itself is saved (the next layer keeps it anyway), not a head-sharded copy;
        # backward moves only each row's dout . out to heads (:mod:`.delta`). Replicated KV heads
        # (fewer KV heads than members) would make the head-sharded KV larger than k and v:
        # then k and v are saved and moved to heads again in backward (one more all-to-all)
        if replicated:
            ctx.save_for_backward(q_h, k, v, lse, offset, y)
        else:
            ctx.save_for_backward(q_h, kv_h, lse, offset, y)
        ctx.run, ctx.group, ctx.heads, ctx.dk, ctx.t = run, a2a_group, heads, dk, q.shape[0]
        ctx.hq, ctx.hkv = q.shape[1], k.shape[1]
        return y

    @staticmethod
    @first_order
    @autocast_off
    def backward(ctx, dout):
        plan, group, dk = ctx.run.plan, ctx.group, ctx.dk
        (q_parts, kv_parts), me = ctx.heads, plan.member
        perm, inv = plan.perms_on(dout.device)
        replicated = _overlap(kv_parts)  # as forward decided what to save
        if replicated:
            q_h, k, v, lse, offset, y = ctx.saved_tensors
            kv_h = to_heads((k, v), kv_parts, plan.counts, me, group, perm, route=plan.route)
            del k, v
        else:
            q_h, kv_h, lse, offset, y = ctx.saved_tensors
        dtype = q_h.dtype
        plain = len(ctx.run.ring.plan.counts) == 1  # a ring of one
        shape = (ctx.t, ctx.hq, ctx.hkv)
        n = a2a_groups.choose(ctx.heads, plan.counts, *shape[1:], dk, y.shape[-1], dtype, ring=not plain)
        block = _own_backward if plain else _ring_backward(ctx.run.ring)
        if n > 1:  # by head groups (:mod:`.a2a_groups`): dK/dV come back in head layout
            saved = (q_h, kv_h, lse, dout.contiguous(), y)
            want_off = offset is not None and ctx.needs_input_grad[3]
            dq, dk_h, dv_h, d_off = a2a_groups.backward(
                ctx.run.ring, block, plan, group, ctx.heads, saved, offset,
                want_off, shape, n, wide=not plain,
            )  # fmt: skip
            del saved
            kv = [dk_h, dv_h]  # handed over: freed once packed
            del dk_h, dv_h
            return dq, *_kv_home(kv, kv_parts, plan, group, inv, replicated, shape, dtype), d_off, None, None, None
        # the kernel reads the output only for each row's dout . out: that moves to heads, not
        # the output (:mod:`.delta`)
        dout = dout.contiguous()
        delta = row_dot(dout, y).unsqueeze(-1)
        del y
        h0, h1 = q_parts[me]
        d_off = torch.zeros_like(offset) if offset is not None and ctx.needs_input_grad[3] else None
        dout_h, out_h = a2a_groups.rows_to_heads(
            dout, delta, q_parts, plan.counts, me, group, perm, lse, offset, d_off, plan.route
        )
        del delta
        if h1 > h0:  # the ring's: fp32 / fp64, dK and dV apart (adopted kernel outputs, no packed zeros)
            saved = [dout_h, q_h, out_h, lse]  # handed over: the ring keeps only the rows it reads
            del dout_h, out_h
            dq_h, dk_h, dv_h = block(ctx.run.ring, saved, kv_h)
            del saved
        else:
            dq_h = torch.zeros_like(q_h, dtype=acc_dtype(q_h))
            dk_h = torch.zeros_like(kv_h[..., :dk], dtype=acc_dtype(q_h))
            dv_h = torch.zeros_like(kv_h[..., dk:], dtype=acc_dtype(q_h))
        dout_h = out_h = None  # consumed: freed before the gradients are moved back to tokens
        dq_h = dq_h.to(dtype)
        send, room = _home_order(dq_h, plan, group, ctx.t, ctx.hq)
        del dq_h
        dq = from_heads(send, q_parts, plan.counts, me, group, ctx.t, ctx.hq, room, plan.route)
        kv = [dk_h, dv_h]  # handed over: freed once packed
        del dk_h, dv_h
        return dq, *_kv_home(kv, kv_parts, plan, group, inv, replicated, shape, dtype), d_off, None, None, None


def _kv_home(kv: list, kv_parts, plan: A2APlan, group, inv, replicated: bool, shape, dtype) -> tuple:
    """dK and dV of this member's KV heads (``kv``, handed over) moved home in one all-to-all,
    packed side by side; replicated heads travel in fp32 (fp64) and are summed there, rounded
    to ``dtype`` once. Others travel in ``dtype``, rounded before they leave (the same values:
    nothing is added to them at home). The travel dtype depends only on what every member
    knows alike: members' gradients can come in different dtypes (one member's KV head summed
    over head groups in fp32, another's a single kernel output), and an all-to-all whose
    members send different element sizes does not match."""
    t, _, hkv = shape
    dv_h, dk_h = kv.pop(), kv.pop()
    travel = acc_dtype(dk_h) if replicated else dtype
    row = hkv * (dk_h.shape[-1] + dv_h.shape[-1]) * travel.itemsize
    if routed(plan.route, group, row, dk_h.device):  # dK and dV travel as they are, no packing
        ys = [x.to(travel) for x in (dk_h, dv_h)]
        del dk_h, dv_h
        bufs, views = from_group(ys, kv_parts, plan.member, group, plan.route, t)
        return tuple(assemble(p, kv_parts, t, hkv, b.dtype).to(dtype) for b, p in zip(bufs, views))
    room = [_pack_home(dk_h, dv_h, inv, acc_dtype(dk_h) if replicated else dtype, t, hkv)]
    width = dk_h.shape[-1] + dv_h.shape[-1]
    send = [room[0][: dk_h.shape[0] * dk_h.shape[1] * width].view(*dk_h.shape[:2], width)]
    dk = dk_h.shape[-1]
    del dk_h, dv_h
    dkv = from_heads(send, kv_parts, plan.counts, plan.member, group, t, hkv, room).to(dtype)
    return dkv[..., :dk], dkv[..., dk:]


def _overlap(parts: tuple[tuple[int, int], ...]) -> bool:
    """Whether members' head ranges overlap (replicated KV heads, summed on the way home)."""
    return len({r for a, b in parts for r in range(a, b)}) < sum(b - a for a, b in parts)


def _home_order(x: torch.Tensor, plan: A2APlan, group, t: int, heads: int) -> tuple[list, list | None]:
    """What :func:`.heads.from_heads` sends of ``x`` (head layout, group order) and its room:
    ``x`` itself where it moves by route, else ``x`` permuted to member order into a
    :func:`.heads.head_room` that the result then reuses."""
    if routed(plan.route, group, heads * int(torch.Size(x.shape[2:]).numel()) * x.element_size(), x.device):
        return [x], None
    room = [head_room(*x.shape[:2], x.shape[2:], t, heads, x)]
    return [_permuted(x, plan.perms_on(x.device)[1], room[0])], room


def _permuted(x: torch.Tensor, inv: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """``x[inv]`` written into the first elements of ``room`` (a :func:`.heads.head_room`);
    under dynamo, which rejects ``out=`` views, a new tensor (the compiler places buffers)."""
    if torch.compiler.is_compiling():
        return x.index_select(0, inv)
    return torch.index_select(x, 0, inv, out=room[: x.numel()].view(x.shape))


def _pack_home(dk_h, dv_h, inv: torch.Tensor, dtype: torch.dtype | None, t: int, hkv: int) -> torch.Tensor:
    """dK and dV rows in token-member order, packed side by side into one ``[T, Hk, D + Dv]``
    send buffer (one all-to-all home) by two row gathers straight into its halves; returned as
    the :func:`.heads.head_room` holding it. ``dtype``: the buffer's (replicated KV heads travel
    home in fp32 and are summed there)."""
    dk, shape = dk_h.shape[-1], (*dk_h.shape[:2], dk_h.shape[-1] + dv_h.shape[-1])
    room = head_room(*shape[:2], shape[2:], t, hkv, dk_h, dtype)
    packed = room[: torch.Size(shape).numel()].view(shape)
    for x, cols in ((dk_h, packed[..., :dk]), (dv_h, packed[..., dk:])):
        # the gather's temporary in the narrower dtype: widened by the copy, or rounded first
        if torch.compiler.is_compiling() or x.dtype.itemsize < packed.dtype.itemsize:  # dynamo: no out= views
            cols.copy_(x.index_select(0, inv))
        else:
            torch.index_select(x.to(packed.dtype), 0, inv, out=cols)
    return room


class _OnlyOut(OutAcc):
    """The forward's :class:`OutAcc` that, for the only kernel call covering every query, adopts
    the kernel's output in its own dtype (a 16-bit one included): merging a single partial
    into an empty accumulator returns that partial, so the fp32 accumulator and the partial's
    fp32 copy (three 16-bit outputs' worth) would only cost memory and ops."""

    def __init__(self, q: torch.Tensor, dv: int, only: bool) -> None:
        super().__init__(q, dv)
        self.only = only

    def merge(self, sl, idx, o: torch.Tensor, lse_c: torch.Tensor) -> None:
        whole = self.only and self.out is None and sl == (0, self.q.shape[0]) and o.is_contiguous()
        if whole and lse_c.dtype == acc_dtype(self.q):
            self.out = o  # empty rows: the kernel's infinite lse becomes the floor, as in OutAcc
            self.lse = floor_lse_(lse_c)
            return
        super().merge(sl, idx, o, lse_c)


class _OnlyCall(GradAcc):
    """A gradient accumulator that, for the step's only kernel call covering every row, adopts
    the kernel's gradient in whatever dtype it comes (a 16-bit one included): one partial
    rounded once is that partial, so an fp32 copy would only cost memory."""

    def __init__(self, like: torch.Tensor, only: bool) -> None:
        super().__init__(like)
        self.only = only

    def add(self, sl: tuple[int, int] | None, idx: torch.Tensor | None, src: torch.Tensor) -> None:
        whole = self.only and sl == (0, self.shape[0]) and src.shape == self.shape and src.is_contiguous()
        if self.t is None and whole:
            self.t = src
            return
        super().add(sl, idx, src)


def _own_backward(ring: Run, saved: list[torch.Tensor], kv: torch.Tensor):
    """Backward of a ring of one (plain a2a): the own block's calls, with dq, dK and dV each
    adopted from the first kernel partial that covers every row (a2a's single call), so no
    zero-filled packed dK|dV accumulator is alive at the kernel call (-0.2 of the ideal at
    cp 4). Returns ``dq, dk, dv`` in the accumulator dtype, or the kernel's own dtype where a
    single call computed them. Replicated KV heads need no fp32 accumulator here either: one
    16-bit partial widens exactly when it is packed to travel home in fp32 for the sum.
    ``saved``: ``[dout, q, out, lse]`` in head layout (handed over, as to the ring)."""
    dout, q, out, lse = saved
    saved.clear()
    calls = ring.plan.own.on(q.device)
    own = KV.of(kv, ring.dk)
    only = len(calls) == 1
    dq, dk, dv = _OnlyCall(q, only), _OnlyCall(own.k, only), _OnlyCall(own.v, only)
    for c in calls:
        qs, ks = (c.q_slice, c.q_index), (c.k_slice, c.k_index)
        k_c, v_c = own.take(*ks)
        g_q, g_k, g_v = ring.backend.attn_bwd(
            take(dout, *qs), take(q, *qs), k_c, v_c, take(out, *qs), take(lse, *qs),
            c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, c.causal, c.window, ring.scale,
        )  # fmt: skip
        del k_c, v_c
        dq.add(*qs, g_q)
        dk.add(*ks, g_k)
        dv.add(*ks, g_v)
        del g_q, g_k, g_v
    return dq.result(), dk.result(), dv.result()


@dataclass(frozen=True)
class _A2ARun:
    """The a2a plan plus the ring's own :class:`Run` (the plan over the a2a groups)."""

    plan: A2APlan
    ring: Run


def attention(q, k, v, run: Run, a2a_group, p2p_group, heads, offset=None) -> torch.Tensor:
    """a2a -> p2p attention over the a2a groups' token sets -> inverse a2a (differentiable).

    ``heads``: :func:`.heads.split_heads` for this a2a size; ``offset``: the softmax offset
    (attention sink) per query head, or None."""
    plan: A2APlan = run.plan
    ring = replace(run, plan=plan.ring, group=p2p_group)
    return _A2AAttention.apply(q, k, v, offset, _A2ARun(plan, ring), a2a_group, heads)
