"""shard_sequences / CPSharding: layout, exact round trip, validation."""

import random

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext import CPSharding, Segment


def _random_cu(rng: random.Random, n: int, max_len: int) -> list[int]:
    cu = [0]
    for _ in range(n):
        cu.append(cu[-1] + rng.choice([0, 1, 2, rng.randint(0, max_len), 97]))
    return cu


@pytest.mark.parametrize("balance", mcx.BALANCES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_round_trip_random_lengths(cp, balance):
    rng = random.Random(cp)
    for _ in range(20):
        cu = _random_cu(rng, rng.randint(1, 6), 40)
        sh = mcx.shard_sequences(torch.tensor(cu, dtype=torch.int32), cp, balance)
        x = torch.randn(cu[-1], 3, 2)
        parts = [sh.shard(x, r) for r in range(cp)]
        assert [p.shape[0] for p in parts] == sh.counts()
        assert sum(sh.counts()) == cu[-1]
        assert torch.equal(sh.unshard(parts), x)
        # dim other than 0
        y = torch.randn(2, cu[-1])
        assert torch.equal(sh.unshard([sh.shard(y, r, dim=1) for r in range(cp)], dim=1), y)


def test_dualchunk_layout():
    # one sequence of 10 tokens, cp=2 -> 5 tokens per rank, each rank's two chunks 2 and 3
    # (cuts at 0,2,4,7,10); with several sequences a rank holds all its first chunks, then all
    # its second ones
    sh2 = mcx.shard_sequences([0, 4, 8], 2, "dualchunk")
    assert sh2.segments[0] == (Segment(0, 0, 1), Segment(1, 0, 1), Segment(0, 3, 4), Segment(1, 3, 4))
    sh = mcx.shard_sequences([0, 10], 2, "dualchunk")
    assert sh.segments[0] == (Segment(0, 0, 2), Segment(0, 7, 10))
    assert sh.segments[1] == (Segment(0, 2, 4), Segment(0, 4, 7))
    assert sh.positions(0).tolist() == [0, 1, 7, 8, 9]
    assert sh.global_index(1).tolist() == [2, 3, 4, 5, 6]


def test_dualchunk_chunk_sizes_differ_by_at_most_one():
    for n in range(0, 50):
        sh = mcx.shard_sequences([0, n], 3, "dualchunk")
        sizes = [s.length for segs in sh.segments for s in segs]
        if sizes:
            assert max(sizes) - min(sizes) <= 1 or min(sizes) == 0
        assert sum(sizes) == n


def test_sequences_in_order_and_short_sequences():
    sh = mcx.shard_sequences([0, 1, 1, 4, 13], 4)  # lengths 1, 0, 3, 9 (< 2*cp)
    for segs in sh.segments:
        seqs = [s.seq for s in segs]
        assert seqs == sorted(seqs)
    assert sum(sh.counts()) == 13


def test_contiguous_layout():
    # 11 tokens: rank 0 gets 6 (the odd token of the deal), so sequence 1 splits 2 + 1
    sh = mcx.shard_sequences([0, 8, 11], 2, balance="contiguous")
    assert sh.segments[0] == (Segment(0, 0, 4), Segment(1, 0, 2))
    assert sh.segments[1] == (Segment(0, 4, 8), Segment(1, 2, 3))


def test_custom_segments_whole_sequences():
    sh = CPSharding.from_segments([0, 5, 9, 12], [[(0, 0, 5)], [(1, 0, 4), (2, 0, 3)]])
    x = torch.arange(12.0)
    assert sh.shard(x, 1).tolist() == list(range(5, 12))
    assert torch.equal(sh.unshard([sh.shard(x, 0), sh.shard(x, 1)]), x)


@pytest.mark.parametrize(
    "cu, match",
    [
        ([0, 5, 3], "non-decreasing"),
        ([1, 5], "start at 0"),
        ([0, -2], "non-decreasing"),
        ([0, 2**31], "int32"),
        ([], "at least one"),
    ],
)
def test_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match="cu_seqlens") as e:
        mcx.shard_sequences(torch.tensor(cu, dtype=torch.int64), 2)
    assert match in str(e.value)


def test_numpy_cu_seqlens_as_a_list():
    """A 1-D integer NumPy array plans as its list does; float or 2-D arrays are refused."""
    import numpy as np

    for dtype in (np.int32, np.int64, np.uint32):
        a, b = mcx.shard_sequences(np.array([0, 5, 5, 19], dtype=dtype), 3), mcx.shard_sequences([0, 5, 5, 19], 3)
        assert a.cu_seqlens == b.cu_seqlens and all(torch.equal(a.global_index(r), b.global_index(r)) for r in range(3))
    for bad in (np.array([0.0, 5.0]), np.array([[0, 5]])):
        with pytest.raises(TypeError, match="cu_seqlens"):
            mcx.shard_sequences(bad, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cu_seqlens"):
        mcx.shard_sequences(torch.tensor([[0, 1]]), 2)
    with pytest.raises(ValueError, match="cp_size"):
        mcx.shard_sequences([0, 4], 0)
    with pytest.raises(ValueError, match="balance"):
        mcx.shard_sequences([0, 4], 2, balance="zigzag")
    with pytest.raises(ValueError, match="exactly once"):
        CPSharding.from_segments([0, 4], [[(0, 0, 3)], [(0, 2, 4)]])
    sh = mcx.shard_sequences([0, 4], 2)
    with pytest.raises(ValueError, match="tokens"):
        sh.shard(torch.zeros(5), 0)


def test_replace_gives_the_new_split_fresh_caches():
    """``dataclasses.replace`` with other segments: the copy's ``shard`` follows its own segments
    (the caches were init fields once, shared with the original and its cut rows)."""
    import dataclasses

    cu = [0, 7, 37, 48]
    work, dual = mcx.shard_sequences(cu, 2), mcx.shard_sequences(cu, 2, balance="dualchunk")
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    work.shard(positions, 0)  # fills work's caches
    copy = dataclasses.replace(work, seg=dual.seg.copy(), rank_ptr=dual.rank_ptr.copy(), balance="dualchunk")
    assert torch.equal(copy.shard(positions, 0), dual.shard(positions, 0))
    assert torch.equal(copy.shard(positions, 0), copy.positions(0))


@pytest.mark.parametrize("dim", [3, -4, 1.5])
def test_unshard_checks_dim_as_shard_does(dim):
    sharding = mcx.shard_sequences([0, 5, 12], 2)
    x = torch.randn(12, 2, 3)
    parts = [sharding.shard(x, r) for r in range(2)]
    with pytest.raises((mcx.CPArgumentError, mcx.CPArgumentTypeError), match="dim must be an int"):
        sharding.unshard(parts, dim=dim)
    with pytest.raises((mcx.CPArgumentError, mcx.CPArgumentTypeError), match="dim must be an int"):
        sharding.shard(x, 0, dim=dim)
