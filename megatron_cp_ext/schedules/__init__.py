"""KV-movement schedules. Each is ``build_plan`` + ``forward`` + ``backward`` over the shared
step machinery in :mod:`.common`; none carries its own kernels or merge."""

from __future__ import annotations

from ..masks import MaskSpec
from ..sharding import CPSharding
from . import a2a, all_gather, p2p

SCHEDULES = {"p2p": p2p, "all_gather": all_gather}

__all__ = ["SCHEDULES", "build_plan"]


def build_plan(sharding: CPSharding, comm_type: str, cp_rank: int, a2a_size: int, mask: MaskSpec):
    """The host plan of CP rank ``cp_rank`` for ``comm_type`` (what ``cp_attention`` caches and
    :func:`megatron_cp_ext.inspect_plan` reports). ``a2a_size``: members of an a2a group."""
    if sharding.cp_size == 1:
        comm_type = "all_gather"  # a single rank: local attention, no communication
    if comm_type in ("a2a", "a2a+p2p"):
        return a2a.build_plan(sharding, a2a_size, cp_rank, mask)
    segs = [sharding.rank_segments(r) for r in range(sharding.cp_size)]
    return SCHEDULES[comm_type].build_plan(segs, cp_rank, mask)
