"""Hierarchical CP groups (``a2a+p2p``) for Megatron layers: Megatron's own, or made from sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from ..runtime.groups import HierarchicalCPGroups

__all__ = ["hierarchical_groups", "hierarchical_groups_from_sizes"]

_HCP_CACHE: dict[tuple, list[dist.ProcessGroup]] = {}


def hierarchical_groups_from_sizes(cp_group: dist.ProcessGroup, sizes: Sequence[int]) -> list[dist.ProcessGroup]:
    """``[a2a_group, p2p_group]`` for ``cp_group`` split as ``sizes = [a2a, p2p]``.

    For launchers that set ``hierarchical_context_parallel_sizes`` on the model config but do
    not create Megatron's hierarchical groups (NeMo 2). Collective over the default group:
    every CP layer calls it at construction whatever its comm type (so pipeline stages whose
    layers differ all take part at their first layer); created once per CP group and cached
    (a rebuilt ``parallel_state`` gets new ones). a2a groups are consecutive CP ranks:
    CP rank = p2p_rank * a2a + a2a_rank, as in Megatron.
    """
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    sizes = tuple(int(x) for x in sizes)
    if len(sizes) != 2 or sizes[0] * sizes[1] != len(ranks):
        raise ValueError(f"hierarchical CP sizes must be [a2a, p2p] with product {len(ranks)}, got {list(sizes)}")
    key = (ranks, sizes)
    cached = _HCP_CACHE.get(key)
    if cached is None or cached.cp_group is not cp_group:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ranks)
        a2a = sizes[0]
        for group_ranks in sorted(set(everyone)):
            levels = (
                [list(group_ranks[i : i + a2a]) for i in range(0, len(group_ranks), a2a)],
                [list(group_ranks[j::a2a]) for j in range(a2a)],
            )
            mine: list = [None, None]
            for level, subgroups in enumerate(levels):
                for sub in subgroups:
                    g = dist.new_group(sub)
                    if dist.get_rank() in sub:
                        mine[level] = g
            if group_ranks == ranks:
                _HCP_CACHE[key] = HierarchicalCPGroups(mine[0], mine[1], cp_group)
    return _HCP_CACHE[key]


def hierarchical_groups(config: TransformerConfig, pg: ProcessGroupCollection, cp_group) -> list:
    """The ``a2a+p2p`` pair of this layer: Megatron's hierarchical groups (or ``pg.hcp``), else
    groups made from ``hierarchical_context_parallel_sizes``; refused when neither is set."""
    groups = getattr(pg, "hcp", None) or parallel_state.get_hierarchical_context_parallel_groups(
        check_initialized=False
    )
    if groups:
        if len(groups) != 2:
            raise ValueError(f"cp_comm_type 'a2a+p2p' supports two levels [a2a, p2p]; got {len(groups)} groups")
        # Carry the whole CP group: the engine's consistency exchange runs on it.
        return HierarchicalCPGroups(groups[0], groups[1], cp_group)
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    if sizes:
        return hierarchical_groups_from_sizes(cp_group, sizes)
    raise ValueError(
        "cp_comm_type 'a2a+p2p' needs hierarchical CP groups: set hierarchical_context_parallel_sizes "
        "(--hierarchical-context-parallel-sizes A2A P2P, product = context_parallel_size) so Megatron "
        "creates them, or pass pg_collection.hcp; refusing to fall back to another comm type"
    )
