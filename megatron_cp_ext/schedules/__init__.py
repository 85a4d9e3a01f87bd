"""KV-movement schedules. Each is ``build_plan`` + ``forward`` + ``backward`` over the shared
step machinery in :mod:`.common`; none carries its own kernels or merge."""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

import numpy as np
import torch

from ..masks import MaskSpec
from ..sharding import CPSharding
from . import a2a, all_gather, p2p, staged
from .staged_plan import build_staged, staged_fits

SCHEDULES = {"p2p": p2p, "all_gather": all_gather}

__all__ = ["SCHEDULES", "P2P_SCHEDULE", "build_plan", "prepare_plan", "schedule_of"]

P2P_SCHEDULE = os.environ.get("MEGATRON_CP_EXT_P2P_SCHEDULE", "staged")
"""How ``p2p`` runs: ``"staged"`` (every message at once, a local and a joined stage, no
merges: :mod:`.staged`) where its memory bound holds on the batch
(:func:`.staged_plan.staged_fits`), else the ring; or ``"ring"`` always (step by step, a merge
per step: :mod:`.p2p`). Read when a plan is built; ``a2a+p2p``'s ring across its groups runs the
same way (the bound over the groups' token sets)."""


def schedule_of(plan) -> ModuleType:
    """The module whose ``forward``/``backward`` run ``plan`` (a ``p2p`` or ``all_gather`` plan)."""
    if isinstance(plan, p2p.P2PPlan):
        return staged if plan.staged is not None else p2p
    return all_gather


def build_plan(sharding: CPSharding, comm_type: str, cp_rank: int, a2a_size: int, mask: MaskSpec):
    """The host plan of CP rank ``cp_rank`` for ``comm_type`` (what ``cp_attention`` caches and
    :func:`megatron_cp_ext.inspect_plan` reports). ``a2a_size``: members of an a2a group."""
    if sharding.muted:  # sequences that attend nothing (padding) take no part in any call or message
        mask = dataclasses.replace(mask, muted=sharding.muted)
    if sharding.cp_size == 1:
        comm_type = "all_gather"  # a single rank: local attention, no communication
    if comm_type in ("a2a", "a2a+p2p"):
        if P2P_SCHEDULE not in ("staged", "ring"):
            raise ValueError(f"P2P_SCHEDULE must be 'staged' or 'ring', got {P2P_SCHEDULE!r}")
        return a2a.build_plan(sharding, a2a_size, cp_rank, mask, P2P_SCHEDULE)
    segs = [sharding.rank_segments(r) for r in range(sharding.cp_size)]
    plan = SCHEDULES[comm_type].build_plan(segs, cp_rank, mask)
    if comm_type == "p2p":
        if P2P_SCHEDULE not in ("staged", "ring"):
            raise ValueError(f"P2P_SCHEDULE must be 'staged' or 'ring', got {P2P_SCHEDULE!r}")
        owner = np.repeat(np.arange(sharding.cp_size), np.diff(sharding.rank_ptr))
        lens = np.diff(np.asarray(sharding.cu_seqlens, np.int64))
        if P2P_SCHEDULE == "staged" and staged_fits(sharding.seg, owner, lens, sharding.cp_size, mask):
            plan.staged = build_staged(plan, segs, mask)
    return plan


def prepare_plan(plan, device: torch.device) -> None:
    """Upload every index tensor the schedule's hot path reads to ``device`` now (cached on the
    plan; a second call only looks them up), so a layer's forward and backward do no host work
    beyond what every later layer does. Done once per plan, where the plan is first used."""
    if isinstance(plan, a2a.A2APlan):
        plan.perms_on(device)
        plan = plan.ring
    if isinstance(plan, p2p.P2PPlan):
        (staged if plan.staged is not None else p2p).prepare(plan, device)
    else:
        plan.step.on(device)
        if isinstance(plan, all_gather.GatherPlan) and plan.keep is not None:
            plan.keep_on(device)  # else first made while a compiled prepared call traces
