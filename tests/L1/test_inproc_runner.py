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
