"""``a2a`` (Ulysses) and ``a2a+p2p`` (hierarchical): all-to-all from sequence to head shards.

Inside an a2a group of ``A`` consecutive CP ranks, an all-to-all turns each member's tokens
of all heads into the group's tokens of ``hq/A`` heads. The received rows (member by member)
are put in global (sequence, position) order by one gather with a plan index, so every
sequence is contiguous and the local calls need no further gathers. Attention over those
tokens is then the ``p2p`` ring across the ``P`` a2a groups (``P == 1`` for plain ``a2a``: a
ring of one, no communication) — the very same ring, calls and merge as ``p2p``. The output
goes back through the inverse permutation and all-to-all; the backward mirrors every step.

K/V heads: if ``hkv % A == 0`` they split like query heads; if ``A % hkv == 0`` (MQA/GQA with
few KV heads) each KV head is replicated ``A / hkv`` times before the all-to-all, so every
member receives the KV head its query heads use. The replicas' gradients come back from the
ring in fp32 (fp64 for fp64 input), travel home and are summed in that precision and rounded
once, so bf16 dK/dV lose nothing to replication.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from ..masks import MaskSpec
from ..sharding import CPSharding
from . import p2p
from .common import Run

__all__ = ["A2APlan", "build_plan", "group_union", "attention", "kv_replication"]


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


def build_plan(sharding: CPSharding, a2a_size: int, cp_rank: int, mask: MaskSpec) -> A2APlan:
    """Plan for CP rank ``cp_rank`` = ``p2p_rank * a2a_size + a2a_rank``."""
    groups = sharding.cp_size // a2a_size
    unions = [group_union(sharding, range(g * a2a_size, (g + 1) * a2a_size)) for g in range(groups)]
    me = cp_rank // a2a_size
    _, perm, counts = unions[me]
    perm_t = torch.from_numpy(perm.astype(np.int64))
    inv = torch.empty_like(perm_t)
    inv[perm_t] = torch.arange(perm_t.numel())
    return A2APlan(counts, perm_t, inv, p2p.build_plan([u[0] for u in unions], me, mask))


def kv_replication(hq: int, hkv: int, a2a_size: int) -> int:
    """How often each KV head is replicated so ``a2a_size`` ranks each get whole head groups."""
    if hq % a2a_size:
        raise ValueError(f"num_heads ({hq}) must be divisible by the a2a CP size ({a2a_size})")
    if hkv % a2a_size == 0:
        return 1
    if a2a_size % hkv == 0:
        return a2a_size // hkv
    raise ValueError(
        f"num_query_groups / k,v heads ({hkv}) must divide or be divisible by the a2a CP size ({a2a_size})"
    )


def _all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, plan: A2APlan, group) -> torch.Tensor:
    """``[t, h, d]`` (own tokens, all heads) -> ``[T_group, h/A, d]`` (group tokens, global order)."""
    a = len(plan.counts)
    t, h = x.shape[:2]
    if group is not None:
        send = x.unflatten(1, (a, h // a)).transpose(0, 1).reshape(a * t, h // a, *x.shape[2:])
        x = _all_to_all(send, plan.counts, [t] * a, group)
    return x.index_select(0, plan.perms_on(x.device)[0])


def _heads_to_seq(y: torch.Tensor, plan: A2APlan, group, t: int) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    a = len(plan.counts)
    y = y.index_select(0, plan.perms_on(y.device)[1])
    if group is None:
        return y
    back = _all_to_all(y, [t] * a, plan.counts, group)
    return back.unflatten(0, (a, t)).transpose(0, 1).flatten(1, 2)


class _A2AAttention(torch.autograd.Function):
    """a2a -> ring over the a2a groups -> inverse a2a, as one autograd node.

    One node, not one per communication step, so the dK/dV of replicated KV heads stay in the
    ring's fp32 (fp64) accumulators through the reverse all-to-all and the replica sum, and are
    rounded to the input dtype once. Separate nodes would round every replica's partial to
    bf16 before the sum (autograd casts a gradient to its input's dtype at every edge).
    Saves what the ring saves (head-sharded q, kv, out and lse), nothing more.
    """

    @staticmethod
    def forward(ctx, q, k, v, run: Run, a2a_group, rep: int):
        plan: A2APlan = run.plan
        kv = torch.cat([k, v], dim=-1)
        if rep > 1:
            kv = kv.repeat_interleave(rep, dim=1)
        kv_h = _seq_to_heads(kv, plan, a2a_group)
        q_h = _seq_to_heads(q, plan, a2a_group)
        ctx.run, ctx.group, ctx.rep, ctx.dk, ctx.t = run, a2a_group, rep, k.shape[-1], q.shape[0]
        out_h, lse = p2p.forward(run.ring, q_h, kv_h[..., : ctx.dk], kv_h[..., ctx.dk :])
        ctx.save_for_backward(q_h, kv_h, out_h, lse)
        return _heads_to_seq(out_h, plan, a2a_group, q.shape[0])

    @staticmethod
    def backward(ctx, dout):
        q_h, kv_h, out_h, lse = ctx.saved_tensors
        plan, group, dk, dtype = ctx.run.plan, ctx.group, ctx.dk, q_h.dtype
        dout_h = _seq_to_heads(dout.contiguous(), plan, group)
        k_h, v_h = kv_h[..., :dk], kv_h[..., dk:]
        dq_h, dk_h, dv_h = p2p.backward(ctx.run.ring, dout_h, q_h, k_h, v_h, out_h, lse)  # fp32 / fp64
        dq = _heads_to_seq(dq_h.to(dtype), plan, group, ctx.t)
        dkv_h = torch.cat([dk_h, dv_h], dim=-1)
        if ctx.rep == 1:  # nothing to sum: move dK/dV in the input dtype
            dkv = _heads_to_seq(dkv_h.to(dtype), plan, group, ctx.t)
        else:  # replicas travel home in fp32 and are summed there, then rounded once
            dkv = _heads_to_seq(dkv_h, plan, group, ctx.t)
            dkv = dkv.unflatten(1, (dkv.shape[1] // ctx.rep, ctx.rep)).sum(2).to(dtype)
        return dq, dkv[..., :dk], dkv[..., dk:], None, None, None


@dataclass(frozen=True)
class _A2ARun:
    """The a2a plan plus the ring's own :class:`Run` (the plan over the a2a groups)."""

    plan: A2APlan
    ring: Run


def attention(q, k, v, run: Run, a2a_group, p2p_group, rep: int) -> torch.Tensor:
    """a2a -> ring attention over the a2a groups' token sets -> inverse a2a (differentiable)."""
    plan: A2APlan = run.plan
    ring = replace(run, plan=plan.ring, group=p2p_group)
    return _A2AAttention.apply(q, k, v, _A2ARun(plan, ring), a2a_group, rep)
