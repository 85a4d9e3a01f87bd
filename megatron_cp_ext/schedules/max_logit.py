"""Max logits: per query head, the largest scaled logit ``scale * q.k`` over every visible
(query, key) pair of the whole batch, as QK-clip (MuonClip) and max-logit logging need.

Every schedule already runs each visible pair in exactly one local call, so the max is taken
there (:func:`.common.step_forward` with ``Run.max_logit`` set: the backend's exact
``max_logit`` per call, a running max in place). Each rank then holds the max over its own
queries (under ``a2a``, over its group's tokens for its share of the heads); one all-reduce(MAX)
of a ``[heads]`` fp32 vector (and a NaN flag per head) over the CP group makes it global and the
same on every rank. All of this stays on the device: no host sync.

The attention sink (``softmax_offset``) is not a logit of any key and does not count: QK-clip
rescales the query and key projections, which cannot change the sink.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.groups import CPGroups

__all__ = ["new_max_logit", "reduce_max_logit"]


def new_max_logit(num_heads: int, device: torch.device) -> torch.Tensor:
    """The running-max accumulator ``[num_heads]`` fp32, all ``-inf`` (no pair seen yet)."""
    return torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device)


def reduce_max_logit(
    local: torch.Tensor, groups: CPGroups, num_heads: int, heads: tuple[int, int] | None = None
) -> torch.Tensor:
    """This rank's max (``heads=(h0, h1)``: the query heads it computed, under ``a2a``) ->
    the global ``[num_heads]`` max, identical on every CP rank.

    One all-reduce over the whole CP group; only when the whole group is unknown (an
    ``a2a+p2p`` pair without ``cp_group``) one over the a2a group and one over the p2p group.
    """
    if heads is not None:
        full = new_max_logit(num_heads, local.device)
        full[heads[0] : heads[1]] = local
        local = full
    if groups.size <= 1:
        return local
    # A NaN logit stays NaN on every rank: a backend's MAX may keep or drop a NaN by operand
    # order (gloo keeps one only from its first operand), so NaN travels as a flag beside it.
    nan = torch.isnan(local)
    both = torch.cat([torch.where(nan, float("-inf"), local), nan.to(local.dtype)])
    if groups.whole is not None:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=groups.whole)
    elif dist.get_world_size() == groups.size:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    else:
        for g in (groups.a2a, groups.p2p):
            if g is not None:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=g)
    n = local.numel()
    return torch.where(both[n:] > 0, float("nan"), both[:n])
