"""Hierarchical CP groups built from ``hierarchical_context_parallel_sizes`` involve the CP
group's ranks only.

Under pipeline parallelism each stage builds its own layers: with a per-layer comm type list,
a layer that runs ``a2a+p2p`` may exist on one stage only. The groups used to be created by a
collective over every rank (an all-gather of the CP groups, then every subgroup), so the ranks
of that stage waited forever while the others built plain layers. Here world 4 is two CP
groups of 2; only CP group {0, 1} builds the groups and runs ``a2a+p2p`` on them, against
dense fp64 attention; {2, 3} never calls in.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_cp_ext.testing.pool import run_on_ranks

pytest.importorskip("megatron.core")

CU = [0, 9, 10, 23, 30]


def _attend_on_one_cp_group(rank: int, world: int, sizes: tuple[int, int]) -> float | None:
    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron.core_attention import hierarchical_groups_from_sizes
    from megatron_cp_ext.testing.reference import dense_attention

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both (plain new_group)
    if rank >= 2:
        return None  # the other "stage": builds no a2a+p2p layer
    cp_group = halves[0]
    groups = hierarchical_groups_from_sizes(cp_group, sizes)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(CU[-1], 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    sharding = mcx.shard_sequences(CU, 2)
    local = [sharding.shard(x, rank) for x in (q, k, v)]
    out = mcx.cp_attention(*local, cp_group=groups, comm_type="a2a+p2p", sharding=sharding, causal=True)
    want = sharding.shard(dense_attention(q, k, v, CU, causal=True), rank)
    return (out - want).abs().max().item()


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
def test_groups_from_sizes_need_only_the_cp_group(sizes):
    errors = run_on_ranks(4, _attend_on_one_cp_group, sizes, timeout=60)
    assert errors[2:] == [None, None]
    assert max(errors[:2]) < 1e-12, errors


def _attend_after_rebuild(rank: int, world: int) -> list[bool] | None:
    """Worker: the CP group is destroyed and made again with the same ranks (Megatron's
    parallel_state re-initialised): the groups from sizes follow the new group."""
    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron.core_attention import hierarchical_groups_from_sizes

    seen = []
    for _ in range(2):
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = halves[rank // 2]
        groups = hierarchical_groups_from_sizes(mine, (2, 1))
        seen.append(groups.cp_group is mine)
        sharding = mcx.shard_sequences(CU, 2)
        q = sharding.shard(torch.randn(CU[-1], 2, 8, dtype=torch.float64), rank % 2)
        mcx.cp_attention(q, q, q, cp_group=groups, comm_type="a2a+p2p", sharding=sharding)
        dist.destroy_process_group(mine)  # the old CP group goes (cached groups from sizes stay behind)
    return seen


def test_groups_from_sizes_follow_a_rebuilt_cp_group():
    """The cache was keyed by ranks only: after a rebuild it returned the destroyed group's
    pair, and the next call failed on every rank ("not initialized in the world group map")."""
    assert run_on_ranks(4, _attend_after_rebuild, timeout=60) == [[True, True]] * 4
