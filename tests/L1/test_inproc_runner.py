"""The in-process runner (one thread per rank) against the gloo multi-process run: bit-identical
results for every comm type, and the dense fp64 reference; failures and hangs surface."""

import pytest
import torch
import torch.distributed as dist

from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import ring_sum, run_threads
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (13, 0, 1, 30, 7, 2, 21)

# (world, comm_type, a2a_size): every comm type at CP 2/4/8, both hierarchical shapes at 8
GRID = [(w, c, 0) for w in (2, 4, 8) for c in ("p2p", "all_gather", "a2a")]
GRID += [(2, "a2a+p2p", 2), (4, "a2a+p2p", 2), (8, "a2a+p2p", 2), (8, "a2a+p2p", 4)]


def _same(a: list[dict], b: list[dict]) -> dict[str, bool]:
    return {k: all(torch.equal(x[k], y[k]) for x, y in zip(a, b)) for k in a[0]}


@pytest.mark.parametrize("world,comm_type,a2a_size", GRID)
def test_bit_identical_to_gloo(world, comm_type, a2a_size):
    case = AttnCase(seqlens=SEQLENS, comm_type=comm_type, hq=4, hkv=2, a2a_size=a2a_size, seed=world)
    threads = run_threads(world, run_case, case, timeout=120)
    check_case(threads, case)  # right, not only equal
    gloo = run_on_ranks(world, run_case, case)
    same = _same(threads, gloo)
    assert all(same.values()), f"differs from gloo: {same}"


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_bit_identical_bf16_mla_windowed(comm_type):
    case = AttnCase(
        seqlens=SEQLENS, comm_type=comm_type, causal=False, window_size=(5, 3), hq=4, hkv=1, dv=6,
        dtype="bfloat16", seed=3, balance="workload",
    )  # fmt: skip
    threads = run_threads(4, run_case, case, timeout=120)
    check_case(threads, case)
    assert all(_same(threads, run_on_ranks(4, run_case, case)).values())


def _sums(rank: int, world: int, sizes: list[int]) -> list[torch.Tensor]:
    """Per size: this rank's all-reduce and reduce-scatter results over values that round
    differently in every summation order."""
    out = []
    for n in sizes:
        xs = []
        for r in range(world):
            g = torch.Generator().manual_seed(1000 * r + n)
            xs.append(torch.randn(world * n, generator=g) * 10.0 ** torch.randint(-6, 7, (world * n,), generator=g))
        ar = xs[rank].clone()
        dist.all_reduce(ar)
        rs = torch.empty(n)
        dist.reduce_scatter(rs, list(xs[rank].chunk(world)))
        out += [ar, rs]
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_sums_in_gloo_order(world):
    sizes = [1, 37, 300_001]  # the last spans several 1 MiB segments per block
    threads = run_threads(world, _sums, sizes)
    gloo = run_on_ranks(world, _sums, sizes)
    for t, g in zip(threads, gloo):
        for a, b in zip(t, g):
            assert torch.equal(a, b)
    # and it is a sum: against fp64
    xs = [torch.randn(10) for _ in range(world)]
    assert torch.allclose(ring_sum(xs).double(), torch.stack(xs).double().sum(0), atol=1e-5)


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_gather([torch.empty(1) for _ in range(world)], torch.ones(1))


def _skip_collective(rank: int, world: int) -> None:
    if rank:
        dist.all_gather([torch.empty(1) for _ in range(world)], torch.ones(1))


def test_failure_and_hang_surface():
    with pytest.raises(RuntimeError, match="rank one is broken"):
        run_threads(3, _fail_on_one, timeout=30)
    with pytest.raises(TimeoutError, match="not finished"):
        run_threads(3, _skip_collective, timeout=2)
    # the runner is usable again afterwards
    assert run_threads(2, lambda r, w: r + w) == [2, 3]


@pytest.mark.parametrize("world,comm_type,a2a_size", [(4, "p2p", 0), (4, "a2a+p2p", 2), (4, "all_gather", 0)])
def test_stream_mode_same_results(world, comm_type, a2a_size):
    """Stream mode matches messages the same way but copies at the match, without cloning the
    send: the ring then reads its send buffers until each batch's wait, as on NCCL, and the
    results equal the plain runner's bit for bit (collectives untouched on CPU)."""
    case = AttnCase(seqlens=SEQLENS, comm_type=comm_type, hq=4, hkv=2, a2a_size=a2a_size, seed=5)
    streamed = run_threads(world, run_case, case, timeout=120, streams=True)
    check_case(streamed, case)
    assert all(_same(streamed, run_threads(world, run_case, case, timeout=120)).values())


def test_stream_roles_from_marker_counts():
    from megatron_cp_ext.testing.inproc import stream_roles

    # 4 ranks: compute streams carry 1..4 marker spins, transfer streams 5..8; others ignored
    spins = {7: 1, 9: 5, 13: 2, 15: 6, 21: 4, 23: 8, 17: 3, 19: 7, 3: 0, 5: 11}
    roles = stream_roles(spins, 4)
    assert roles == {
        7: (0, "compute"), 9: (0, "transfer"), 13: (1, "compute"), 15: (1, "transfer"),
        17: (2, "compute"), 19: (2, "transfer"), 21: (3, "compute"), 23: (3, "transfer"),
    }  # fmt: skip


def test_overlap_by_rank_on_a_made_up_trace():
    """Rank 0's copy [10, 20] overlaps its own kernel [15, 30] by 5; rank 1's copy [0, 10]
    overlaps only rank 0's kernel, which does not count: 5 of 20 µs."""
    from types import SimpleNamespace as NS

    from megatron_cp_ext.testing.inproc_streams import overlap_by_rank

    cuda = torch.autograd.DeviceType.CUDA
    ev = lambda name, sid, a, b: NS(name=name, device_type=cuda, device_resource_id=sid, time_range=NS(start=a, end=b))  # noqa: E731
    marks = [ev("spin_kernel", 7, 0, 0)] + [ev("spin_kernel", 8, 0, 0)] * 3  # rank 0: 7 computes, 8 receives
    marks += [ev("spin_kernel", 9, 0, 0)] * 2 + [ev("spin_kernel", 10, 0, 0)] * 4  # rank 1: 9 and 10
    work = [ev("Memcpy DtoD (Device -> Device)", 8, 10, 20), ev("flash_fwd_kernel", 7, 15, 30),
            ev("Memcpy DtoD (Device -> Device)", 10, 0, 10), ev("flash_fwd_kernel", 9, 40, 50)]  # fmt: skip
    s = overlap_by_rank(marks + work, 2)
    assert s["streams_named"] == 4 and s["ratio"] == pytest.approx(5 / 20)
    assert s["ranks"][0] == {"transfers": 1, "transfer_us": 10, "compute_kernels": 1, "compute_us": 15, "overlap_us": 5}
    assert s["ranks"][1]["overlap_us"] == 0


def _one_rank_bad_window(rank: int, world: int) -> str:
    import megatron_cp_ext as mcx

    sharding = mcx.shard_sequences([0, 13, 13, 14, 40], world)
    q = sharding.shard(torch.randn(40, 2, 8), rank)
    try:
        mcx.cp_attention(
            q, q, q, cp_group=dist.group.WORLD, sharding=sharding, window_size=(2.7, 0) if rank else (-1, -1)
        )
    except mcx.CPArgumentTypeError as err:
        return str(err)
    return "ran"


def test_one_rank_argument_error_is_raised_on_every_thread():
    """The threaded group's work takes no finite timeout: the bad rank's timed wait used to read
    as "nobody joined", so it raised alone and its peers waited in the message exchange."""
    msgs = run_threads(3, _one_rank_bad_window, timeout=60)
    assert len(set(msgs)) == 1 and "window_size" in msgs[0] and "raised on every CP rank" in msgs[0], msgs
