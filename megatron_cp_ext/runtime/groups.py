"""Process groups: hierarchical CP (``a2a+p2p``) outside Megatron, and the normalised
groups of one ``cp_attention`` call.

Same layout as Megatron's ``get_hierarchical_context_parallel_groups``: a2a groups are runs of
``a2a_size`` consecutive CP ranks, p2p groups join the ranks with the same position inside
their a2a group, so CP rank = p2p rank * a2a_size + a2a rank.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .validation import CPArgumentError, CPArgumentTypeError, as_int, as_ints

__all__ = ["HierarchicalCPGroups", "hierarchical_cp_groups", "CPGroups", "cp_groups", "checked_rank", "group_info"]
__all__ += ["ranks_crc"]


class HierarchicalCPGroups(list):
    """``[a2a_group, p2p_group]`` (pass it as ``cp_group`` for ``a2a+p2p``) that also carries
    ``cp_group``, the whole CP group the pair splits.

    ``cp_attention`` runs its cross-rank consistency exchange on the whole CP group, the one
    group every comm type can name: ranks that disagree on the comm type (one on ``a2a+p2p``,
    another on ``p2p`` over the CP group) then meet in the same collective and all raise,
    instead of waiting in collectives over different groups. A plain two-element list still
    works; its exchange then runs over the a2a and the p2p group in turn, which agrees on
    everything except a rank using another comm type (see ``docs/reliability.md``).
    """

    def __init__(self, a2a_group, p2p_group, cp_group) -> None:
        super().__init__([a2a_group, p2p_group])
        self.cp_group = cp_group
        """The whole CP group (``a2a size x p2p size`` ranks)."""


def hierarchical_cp_groups(a2a_size: int, cp_ranks: Sequence[int] | None = None) -> HierarchicalCPGroups:
    """``[a2a_group, p2p_group]`` of the calling rank, carrying the whole CP group (see
    :class:`HierarchicalCPGroups`). Collective: every rank of the default group must call it
    with the same arguments (like ``new_group``).

    Args:
        a2a_size: ranks per all-to-all group; must divide the CP size.
        cp_ranks: global ranks of the CP group, ascending (default: the whole world):
            ``new_group`` orders every group by global rank, so that is the CP-rank order.
            Every rank must pass the same list, so this serves one CP group; with data
            parallelism (several CP groups) use Megatron's groups or
            ``megatron_cp_ext.megatron.hierarchical.hierarchical_groups_from_sizes``.
    """
    ranks = list(range(dist.get_world_size())) if cp_ranks is None else as_ints(cp_ranks, "cp_ranks")
    a2a_size = as_int(a2a_size, "a2a_size", minimum=1)
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        raise CPArgumentError(f"cp_ranks must be ascending global ranks (new_group orders groups so), got {ranks}")
    if len(ranks) % a2a_size:
        raise CPArgumentError(f"a2a_size ({a2a_size}) must divide the CP size ({len(ranks)})")
    me = dist.get_rank()
    # Every rank creates the same groups in the same order (new_group is collective).
    whole = dist.group.WORLD if cp_ranks is None else dist.new_group(ranks)
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
        raise CPArgumentError(f"rank {me} is not in cp_ranks {ranks}")
    return HierarchicalCPGroups(mine["a2a"], mine["p2p"], whole)


# ---- the groups of one cp_attention call ---------------------------------------------------
@dataclass(frozen=True)
class GroupInfo:
    """What a rank knows about one of its process groups (cached: groups never change)."""

    size: int
    rank: int
    """This process's rank inside the group."""
    name_crc: int
    """CRC of the group's name: ranks holding the same group object agree on it."""
    members_crc: int
    """CRC of the global ranks of the group, in group-rank order."""


_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per process group (weakly held: a destroyed group must not outlive its process group)."""


def ranks_crc(ranks: Sequence[int]) -> int:
    """The members CRC of a group holding global ``ranks`` in this order."""
    return zlib.crc32(",".join(map(str, ranks)).encode())


def group_info(group: dist.ProcessGroup) -> GroupInfo:
    info = _INFO.get(group)
    if info is None:
        ranks = dist.get_process_group_ranks(group)
        ranks = sorted(ranks, key=lambda g: dist.get_group_rank(group, g))
        name = getattr(group, "group_name", "") or ""
        info = GroupInfo(len(ranks), dist.get_rank(group), zlib.crc32(name.encode()), ranks_crc(ranks))
        _INFO[group] = info
    return info


@dataclass(frozen=True)
class CPGroups:
    """The CP process groups of one call, normalised over comm types.

    CP rank = p2p rank * a2a size + a2a rank (Megatron's hierarchical layout); ``p2p`` and
    ``all_gather`` have an a2a size of 1, ``a2a`` a p2p size of 1.
    """

    a2a: object
    """All-to-all group (None: no all-to-all, or a group of one)."""
    p2p: object
    """Ring / all-gather group (None: single participant)."""
    a2a_size: int
    size: int
    """Total CP size (a2a size x p2p size)."""
    rank: int
    """This process's CP rank."""
    whole: object
    """The whole CP group when known (the group itself, or ``HierarchicalCPGroups.cp_group``)."""
    a2a_info: GroupInfo | None
    p2p_info: GroupInfo | None


def _one_group(g: object, name: str) -> tuple[object, GroupInfo | None]:
    if g is None:
        return None, None
    if not isinstance(g, dist.ProcessGroup):
        raise CPArgumentTypeError(f"{name} must be a torch.distributed ProcessGroup or None, got {type(g).__name__}")
    info = group_info(g)
    return (g if info.size > 1 else None), info


def cp_groups(cp_group: object, comm_type: str) -> CPGroups:
    """Validate ``cp_attention``'s ``cp_group`` for ``comm_type`` (no communication)."""
    if cp_group is None:  # CP size 1 for every comm type: local attention
        return CPGroups(None, None, 1, 1, 0, None, None, None)
    if comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise CPArgumentTypeError(
                "cp_group must be [a2a_group, p2p_group] for comm_type='a2a+p2p' (see "
                f"megatron_cp_ext.hierarchical_cp_groups), got {type(cp_group).__name__} {cp_group!r}"
            )
        a2a, ia = _one_group(cp_group[0], "cp_group[0] (the a2a group)")
        ring, ip = _one_group(cp_group[1], "cp_group[1] (the p2p group)")
        na, ra = (ia.size, ia.rank) if ia else (1, 0)
        np_, rp = (ip.size, ip.rank) if ip else (1, 0)
        whole = getattr(cp_group, "cp_group", None)
        return CPGroups(a2a, ring, na, na * np_, rp * na + ra, whole, ia, ip)
    if isinstance(cp_group, (list, tuple)):
        raise CPArgumentTypeError(
            f"cp_group must be one ProcessGroup for comm_type={comm_type!r} (a pair only for 'a2a+p2p'), "
            f"got a {type(cp_group).__name__} of {len(cp_group)}"
        )
    g, info = _one_group(cp_group, "cp_group")
    if comm_type == "a2a":
        return CPGroups(g, None, info.size, info.size, info.rank, cp_group, info, None)
    return CPGroups(None, g, 1, info.size, info.rank, cp_group, None, info)


def checked_rank(groups: CPGroups) -> int:
    """This process's CP rank, which the data was split by: where a hierarchical pair carries
    its whole CP group, the rank the pair implies (p2p rank x a2a size + a2a rank) must be the
    rank in that group. A pair passed p2p first, or groups built over another order of the
    ranks, is otherwise a valid layout that attends this rank's tokens as another rank's."""
    whole = groups.whole
    if groups.a2a_info is None or groups.p2p_info is None or not isinstance(whole, dist.ProcessGroup):
        return groups.rank
    info = group_info(whole)
    if info.size == groups.size and info.rank != groups.rank:
        raise CPArgumentError(
            f"cp_group: the [a2a_group, p2p_group] pair makes this process CP rank {groups.rank} (p2p rank "
            f"{groups.p2p_info.rank} x a2a size {groups.a2a_size} + a2a rank {groups.a2a_info.rank}), but it is rank "
            f"{info.rank} of the pair's whole CP group: pass the a2a group first, with a2a groups of consecutive CP "
            "ranks (megatron_cp_ext.hierarchical_cp_groups builds both)"
        )
    return groups.rank


def peek_groups(cp_group: object) -> CPGroups | None:
    """The groups ``cp_group`` names whatever the comm type (a pair: ``a2a+p2p``'s), or None.

    Where a rank whose other arguments failed validation reports its error: the group its
    peers, given the same ``cp_group``, exchange their signatures on."""
    try:
        return cp_groups(cp_group, "a2a+p2p" if isinstance(cp_group, (list, tuple)) else "p2p")
    except (TypeError, ValueError):
        return None
