"""KV-movement schedules. Each is ``build_plan`` + ``forward`` + ``backward`` over the shared
step machinery in :mod:`.common`; none carries its own kernels or merge."""

from __future__ import annotations

import torch

from ..masks import MaskSpec
from ..sharding import CPSharding
from . import a2a, all_gather, p2p

SCHEDULES = {"p2p": p2p, "all_gather": all_gather}

__all__ = ["SCHEDULES", "build_plan", "prepare_plan"]


def build_plan(sharding: CPSharding, comm_type: str, cp_rank: int, a2a_size: int, mask: MaskSpec):
    """The host plan of CP rank ``cp_rank`` for ``comm_type`` (what ``cp_attention`` caches and
    :func:`megatron_cp_ext.inspect_plan` reports). ``a2a_size``: members of an a2a group."""
    if sharding.cp_size == 1:
        comm_type = "all_gather"  # a single rank: local attention, no communication
    if comm_type in ("a2a", "a2a+p2p"):
        return a2a.build_plan(sharding, a2a_size, cp_rank, mask)
    segs = [sharding.rank_segments(r) for r in range(sharding.cp_size)]
    return SCHEDULES[comm_type].build_plan(segs, cp_rank, mask)


def prepare_plan(plan, device: torch.device) -> None:
    """Upload every index tensor the schedule's hot path reads to ``device`` now (cached on the
    plan; a second call only looks them up), so a layer's forward and backward do no host work
    beyond what every later layer does. Done once per plan, where the plan is first used."""
    if isinstance(plan, a2a.A2APlan):
        plan.perms_on(device)
        plan = plan.ring
    if isinstance(plan, p2p.P2PPlan):
        p2p.prepare(plan, device)
    else:
        plan.step.on(device)
