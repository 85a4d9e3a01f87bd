"""``torch.autograd.gradcheck`` of ``cp_attention`` across CP ranks (worker side).

gradcheck perturbs inputs one element at a time, so every rank must run the same number of
forward and backward calls in the same order. Each rank therefore checks the same function
of the *global* inputs: shard (differentiable index), CP attention, gather every rank's
output (its backward hands each rank its own rows), so all ranks see identical Jacobians.
The global inputs are replicated: their gradient is the sum of every rank's contribution
(an all-reduce in backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx

from ..runtime.comm import all_gather_padded
from .cases import AttnCase, cp_group_for, p2p_schedule

__all__ = ["gradcheck_on_ranks"]


class _Replicated(torch.autograd.Function):
    """Identity on an input every rank holds; backward sums every rank's gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _GatherTokens(torch.autograd.Function):
    """This rank's output rows -> the whole batch (every rank's rows, global order)."""

    @staticmethod
    def forward(ctx, out, sharding, rank):
        ctx.sharding, ctx.rank = sharding, rank
        pad = max(sharding.counts())
        full = all_gather_padded(out.contiguous(), pad, dist.group.WORLD)
        parts = [full[r * pad : r * pad + sharding.num_tokens(r)] for r in range(sharding.cp_size)]
        return sharding.unshard(parts)

    @staticmethod
    def backward(ctx, g):
        return g.index_select(0, ctx.sharding.global_index(ctx.rank)), None, None


def gradcheck_on_ranks(rank: int, world: int, case: AttnCase, fast: bool = False) -> bool:
    """gradcheck of global q, k, v -> global output in float64 (``case.dtype`` is ignored).

    ``fast``: gradcheck's fast mode (random projections of the Jacobian: a few calls instead
    of two per input element)."""
    torch.manual_seed(case.seed)  # identical global inputs and gradcheck probes on every rank
    q, k, v, _ = (x.requires_grad_() for x in case.inputs())
    sharding = case.sharding(world)
    group = cp_group_for(case, world)
    mask = dict(causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size)

    def fn(qg, kg, vg):
        local = [sharding.shard(_Replicated.apply(x), rank) for x in (qg, kg, vg)]
        out = mcx.cp_attention(*local, cp_group=group, comm_type=case.comm_type, sharding=sharding, **mask)
        return _GatherTokens.apply(out, sharding, rank)

    with p2p_schedule(case.p2p_schedule):  # plans are built inside, on the first call
        return torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=fast)
