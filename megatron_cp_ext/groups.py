"""Process groups for hierarchical CP (``a2a+p2p``) outside Megatron.

Same layout as Megatron's ``get_hierarchical_context_parallel_groups``: a2a groups are runs of
``a2a_size`` consecutive CP ranks, p2p groups join the ranks with the same position inside
their a2a group, so CP rank = p2p rank * a2a_size + a2a rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["hierarchical_cp_groups"]


def hierarchical_cp_groups(a2a_size: int, cp_ranks: Sequence[int] | None = None) -> list[dist.ProcessGroup]:
    """``[a2a_group, p2p_group]`` of the calling rank. Collective: every rank of the default
    group must call it with the same arguments (like ``new_group``).

    Args:
        a2a_size: ranks per all-to-all group; must divide the CP size.
        cp_ranks: global ranks of the CP group in CP-rank order (default: the whole world).
            Every rank must pass the same list, so this serves one CP group; with data
            parallelism (several CP groups) use Megatron's groups or
            ``megatron_cp_ext.megatron.core_attention.hierarchical_groups_from_sizes``.
    """
    ranks = list(range(dist.get_world_size())) if cp_ranks is None else [int(r) for r in cp_ranks]
    if a2a_size < 1 or len(ranks) % a2a_size:
        raise ValueError(f"a2a_size ({a2a_size}) must be >= 1 and divide the CP size ({len(ranks)})")
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    n_groups = len(ranks) // a2a_size
    for g in range(n_groups):
        members = ranks[g * a2a_size : (g + 1) * a2a_size]
        group = dist.new_group(members)
        if me in members:
            mine["a2a"] = group
    for i in range(a2a_size):
        members = ranks[i::a2a_size]
        group = dist.new_group(members)
        if me in members:
            mine["p2p"] = group
    if me not in ranks:
        raise ValueError(f"rank {me} is not in cp_ranks {ranks}")
    return [mine["a2a"], mine["p2p"]]
