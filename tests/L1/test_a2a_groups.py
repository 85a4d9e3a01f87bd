"""Backward by head groups against the dense fp64 reference: a2a's (``schedules/a2a_groups.py``:
split KV heads, KV heads shared by groups (summed), replicated KV heads, uneven shards, sinks,
bf16), a2a+p2p's and p2p's (a ring per group, ``p2p.head_groups``); and the rules that pick
the group count."""

import pytest
import torch

from megatron_cp_ext.schedules import a2a_groups, p2p
from megatron_cp_ext.schedules.heads import split_heads
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (40, 0, 1, 77, 9)


def _grouped(rank, world, case, groups):
    """``run_case`` with the backward forced to (at most) ``groups`` head groups."""
    a2a_groups.GROUPS = p2p.GROUPS = groups
    try:
        res = run_case(rank, world, case)
    finally:
        a2a_groups.GROUPS = p2p.GROUPS = None
    return res


SINK8 = (0.5, -1.0, 2.0, 0.0, 1.0, -0.5, 0.3, 0.9)
CASES = {  # comm type, world, a2a size (a2a+p2p), hq, hkv, groups, extra
    "split-kv": ("a2a", 2, 0, 8, 4, 2, {}),  # 2 KV heads per member, one per group
    "mixed": ("a2a", 2, 0, 8, 4, 4, {}),  # each KV head's 2 query heads in 2 groups
    "shared-kv": ("a2a", 4, 0, 8, 4, 4, {}),  # 1 KV head per member, its 2 query heads in 2 groups
    "replicated": ("a2a", 4, 0, 8, 2, 4, {"d": 8, "dv": 6}),  # hkv < cp, MLA dims
    "sink-noncausal": ("a2a", 4, 0, 8, 4, 2, {"sink": SINK8, "causal": False}),
    "bf16-shared": ("a2a", 4, 0, 8, 4, 2, {"dtype": "bfloat16"}),
    "bf16-replicated": ("a2a", 4, 0, 8, 2, 2, {"dtype": "bfloat16"}),
    # 4 + 2 query heads: one member's KV head is summed over its groups in fp32, the other's
    # are single kernel outputs; dK/dV must still travel home in one dtype on both
    "bf16-uneven-shared": ("a2a", 2, 0, 6, 3, 2, {"dtype": "bfloat16"}),
    # a2a+p2p: its ring run once per group
    "ring-split-kv": ("a2a+p2p", 4, 2, 8, 4, 2, {}),  # 2 KV heads per member, one per group
    "ring-mha": ("a2a+p2p", 4, 2, 8, 8, 4, {"window_size": (9, -1), "balance": "workload"}),  # 4 rings
    "ring-shared-kv": ("a2a+p2p", 4, 2, 8, 4, 4, {}),  # 4 groups would share a KV head: 2 taken
    "ring-replicated": ("a2a+p2p", 8, 4, 8, 2, 2, {"d": 8, "dv": 6}),  # hkv < a2a size: 1 group
    "ring-sink-bf16": ("a2a+p2p", 4, 2, 8, 4, 2, {"sink": SINK8, "dtype": "bfloat16"}),
    "ring-noncausal-uneven": ("a2a+p2p", 4, 2, 12, 6, 2, {"causal": False}),  # 6 q / 3 KV heads: 1 group
    # p2p: its ring run once per group of KV heads
    "p2p-gqa": ("p2p", 4, 0, 8, 4, 2, {}),
    "p2p-mha-4-window": ("p2p", 4, 0, 8, 8, 4, {"window_size": (9, -1), "balance": "workload"}),
    "p2p-mla-bf16": ("p2p", 2, 0, 4, 2, 2, {"d": 8, "dv": 6, "dtype": "bfloat16"}),
    "p2p-sink-noncausal": ("p2p", 3, 0, 4, 4, 4, {"sink": (0.5, -1.0, 2.0, 0.3), "causal": False}),
    "p2p-fp64-chunk": ("p2p", 2, 0, 4, 2, 2, {"dtype": "float64", "chunk_size": 16}),
    "p2p-odd-kv": ("p2p", 2, 0, 6, 3, 2, {}),  # 3 KV heads: no two groups of whole heads, one ring
}


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_backward_matches_dense(name):
    comm, world, a2a, hq, hkv, groups, extra = CASES[name]
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, a2a_size=a2a, hq=hq, hkv=hkv, **extra)
    check_case(run_on_ranks(world, _grouped, case, groups), case)


def test_p2p_head_groups_rule():
    """Two groups of whole KV heads, above the ring's size floor only; forced counts up to 4."""
    plan = p2p.P2PPlan([8192, 8192], 0, None, [], None)
    assert p2p.head_groups(plan, 16, 4, 64, torch.float32) == [((0, 8), (0, 2)), ((8, 16), (2, 4))]
    assert p2p.head_groups(plan, 16, 4, 64, torch.bfloat16) is None  # 8 MiB per group's dout
    assert p2p.head_groups(plan, 6, 3, 64, torch.float32) is None  # odd KV heads
    p2p.GROUPS = 4
    try:
        assert len(p2p.head_groups(plan, 16, 4, 64, torch.bfloat16)) == 4
        assert len(p2p.head_groups(plan, 16, 2, 64, torch.bfloat16)) == 2
    finally:
        p2p.GROUPS = None


def test_ring_groups_read_disjoint_kv_heads():
    """a2a+p2p takes only counts whose groups read disjoint KV heads (a shared one would travel
    the ring twice); plain a2a also takes a shared one."""
    heads = split_heads(16, 4, 2)  # 8 query / 2 KV heads per member
    assert a2a_groups.valid(heads, 16, 4, 2, ring=True)
    assert not a2a_groups.valid(heads, 16, 4, 4, ring=True) and a2a_groups.valid(heads, 16, 4, 4, ring=False)
    a2a_groups.GROUPS = 4
    try:
        assert a2a_groups.choose(heads, [4096, 4096], 16, 4, 64, 64, torch.float32, ring=True) == 2
        assert a2a_groups.choose(heads, [4096, 4096], 16, 4, 64, 64, torch.float32) == 4
    finally:
        a2a_groups.GROUPS = None
    assert a2a_groups.choose(heads, [16384, 16384], 16, 4, 64, 64, torch.float32, ring=True) == 2
    # 8 MiB per group's dout: enough for plain a2a, under the ring's floor (a ring per group)
    assert a2a_groups.choose(heads, [4096, 4096], 16, 4, 64, 64, torch.float32, ring=True) == 1
    assert a2a_groups.choose(heads, [4096, 4096], 16, 4, 64, 64, torch.float32) == 4


def test_uneven_shards_fall_back_or_split():
    """Head counts the members do not share evenly stay exact with two groups forced: 12/6 heads
    on 4 members (shards of 1 and 2 KV heads: the groups share some members' KV head and split
    others'), 6/3 (a member with one query head: one group) and 4/2 (replicated KV heads)."""
    for world, hq, hkv in ((4, 12, 6), (4, 6, 3), (4, 4, 2)):
        case = AttnCase(seqlens=SEQLENS, comm_type="a2a", hq=hq, hkv=hkv)
        check_case(run_on_ranks(world, _grouped, case, 2), case)


def test_group_parts():
    heads = split_heads(16, 4, 4)  # 1 KV head and 4 query heads per member
    parts = a2a_groups.group_parts(*heads, 16, 4, 4)
    assert parts[1] == (((1, 2), (5, 6), (9, 10), (13, 14)), ((0, 1), (1, 2), (2, 3), (3, 4)))
    assert a2a_groups.group_parts(*split_heads(16, 4, 2), 16, 4, 2)[1][1] == ((1, 2), (3, 4))
    assert a2a_groups.group_parts(*split_heads(6, 3, 1), 6, 3, 2) is None  # 3 query heads per group: 1.5 KV


@pytest.mark.parametrize(
    "cp,dtype,tokens,want",
    [
        (4, torch.float32, 8192, 4),  # 2 MiB per group's all-to-all: split, a KV head shared
        # 1 MiB, but the shared KV head's fp32 dK/dV sum beside 16-bit partials leaves a gain
        # under SHARED_MIN_GAIN at any size (measured: peak 2.78 -> 2.69 of the ideal for three
        # more dK/dV sums); fp32 above clears it
        (4, torch.bfloat16, 8192, 1),
        (4, torch.float32, 1024, 1),  # 256 KiB per group: too small
        (2, torch.float32, 8192, 4),
        (8, torch.float32, 8192, 1),  # replicated KV head: groups would raise the peak
    ],
)
def test_choose(cp, dtype, tokens, want):
    heads = split_heads(16, 4, cp)
    assert a2a_groups.choose(heads, [tokens // cp] * cp, 16, 4, 64, 64, dtype) == want
