"""Multi-rank cp_attention (gloo, CPU) against the dense fp64 reference of the whole batch."""

import pytest

from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.pool import run_on_ranks

# lengths not divisible by 2*cp, with empty and one-token sequences
SEQLENS = (13, 0, 1, 30, 7, 2)
HEADS = {"mha": (4, 4, 8), "gqa": (4, 2, 8), "mqa": (4, 1, 8), "mla": (4, 2, 6)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
@pytest.mark.parametrize("comm_type", ["p2p", "p2p-ring", "all_gather"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_dense_reference(world, comm_type, causal, heads, dtype):
    """``p2p`` staged (forced: these small batches fail its memory bound) and as the ring."""
    hq, hkv, dv = HEADS[heads]
    comm, schedule = ("p2p", "ring") if comm_type == "p2p-ring" else (comm_type, "staged")
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, causal=causal, hq=hq, hkv=hkv, dv=dv, dtype=dtype,
                    p2p_schedule=schedule)  # fmt: skip
    check_case(run_on_ranks(world, run_case, case), case)


@pytest.mark.parametrize("seqlens", [(1,), (0, 0, 5), (97,), (3, 1, 4, 1, 5, 9, 2, 6)])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_odd_lengths_world4(comm_type, seqlens):
    case = AttnCase(seqlens=seqlens, comm_type=comm_type, hkv=2, seed=len(seqlens))
    check_case(run_on_ranks(4, run_case, case), case)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("world", [2, 4])
def test_whole_sequences_on_single_ranks(world, comm_type):
    """A sharding that is not dual-chunk: each sequence lives entirely on one rank."""
    seqlens = (9, 4, 12, 1, 6, 0, 3, 8)
    segs = [[] for _ in range(world)]
    for s, n in enumerate(seqlens):
        segs[s % world].append((s, 0, n))
    case = AttnCase(seqlens=seqlens, comm_type=comm_type, segments=tuple(tuple(x) for x in segs), hkv=2)
    check_case(run_on_ranks(world, run_case, case), case)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_softmax_scale_and_contiguous_balance(comm_type):
    case = AttnCase(seqlens=SEQLENS, comm_type=comm_type, balance="contiguous", causal=False)
    check_case(run_on_ranks(4, run_case, case), case)


@pytest.mark.parametrize(
    "mask", [dict(causal=True), dict(causal=False, window_size=(5, 3)), dict(chunk_size=8)], ids=str
)
@pytest.mark.parametrize("world", [2, 4])
def test_staged_moves_by_index(world, mask):
    """The staged schedule with every move and every joined call's dK/dV rows of more than one
    run going by index (``staged-index``), on a custom sharding with many pieces per rank."""
    seqlens = (40, 3, 57, 1, 22)
    segs = [[] for _ in range(world)]
    for s, n in enumerate(seqlens):
        cuts = list(range(0, n, 5)) + [n]
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            segs[(s + i * 3) % world].append((s, a, b))
    kw = dict(causal=True) | mask
    case = AttnCase(seqlens=seqlens, segments=tuple(tuple(x) for x in segs), hkv=2, p2p_schedule="staged-index",
                    seed=world, **kw)  # fmt: skip
    check_case(run_on_ranks(world, run_case, case), case)


@pytest.mark.parametrize("schedule", ["", "staged-index"], ids=["default", "by-index"])
def test_staged_own_rows_fewer_than_the_block(schedule):
    """a2a+p2p's staged ring across 5 groups of one (the package's default schedule, and every
    move by index): a rank whose joined buffer takes only some of its own rows, the first ones
    in order, copies them from the leading rows (it copied the whole block: an IndexError on
    that CP rank alone, the others waiting in their exchange)."""
    case = AttnCase(seqlens=(24, 134, 0, 1, 0, 8, 32, 177, 2), comm_type="a2a+p2p", a2a_size=1, hq=4, hkv=2,
                    causal=True, window_size=(20, -1), balance="dualchunk", p2p_schedule=schedule)  # fmt: skip
    check_case(run_on_ranks(5, run_case, case, timeout=180), case)
