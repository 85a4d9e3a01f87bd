"""``a2a`` (Ulysses) and ``a2a+p2p`` (hierarchical): all-to-all from sequence to head shards.

Inside an a2a group of ``A`` consecutive CP ranks, an all-to-all turns each member's tokens
of all heads into the group's tokens of ``hq/A`` heads. The received rows (member by member)
are put in global (sequence, position) order by one gather with a plan index, so every
sequence is contiguous and the local calls need no further gathers. Attention over those
tokens is then the ``p2p`` ring across the ``P`` a2a groups (``P == 1`` for plain ``a2a``: a
ring of one, no communication) — the very same ring, calls and merge as ``p2p``. The output
goes back through the inverse permutation and all-to-all. The communication steps are their
own autograd functions, so the backward mirrors them without a second copy of the ring.

K/V heads: if ``hkv % A == 0`` they split like query heads; if ``A % hkv == 0`` (MQA/GQA with
few KV heads) each KV head is replicated ``A / hkv`` times before the all-to-all, so every
member receives the KV head its query heads use; autograd sums the replicas' gradients.
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


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group, ctx.t = plan, group, x.shape[0]
        return _seq_to_heads(x, plan, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.plan, ctx.group, ctx.t), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, plan, group, t):
        ctx.plan, ctx.group = plan, group
        return _heads_to_seq(y, plan, group, t)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.plan, ctx.group), None, None, None


def attention(q, k, v, run: Run, a2a_group, p2p_group, rep: int, core) -> torch.Tensor:
    """a2a -> ring attention over the a2a groups' token sets -> inverse a2a.

    ``core(q, k, v, run)`` applies the ring attention autograd function (shared with ``p2p``).
    """
    plan: A2APlan = run.plan
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dk = k.shape[-1]
    kv_h = _SeqToHeads.apply(torch.cat([k, v], dim=-1), plan, a2a_group)
    q_h = _SeqToHeads.apply(q, plan, a2a_group)
    ring_run = replace(run, plan=plan.ring, group=p2p_group)
    out_h = core(q_h, kv_h[..., :dk], kv_h[..., dk:], ring_run)
    return _HeadsToSeq.apply(out_h, plan, a2a_group, q.shape[0])
