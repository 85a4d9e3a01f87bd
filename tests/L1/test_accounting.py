"""Exact counts of what a layer allocates, saves and launches (flash-shaped stub kernels).

Speed is a benchmark's business (``benchmarks/memory_launches.py``); these counts are exact,
so they are asserted: the torch merge's aten ops per call, one op per accumulate, bytes
saved for backward equal to the ideal (q, k, v, output, fp32 lse) for every comm type, and
upper bounds on the forward and backward peaks (docs/performance.md, "Leaner buffers").
"""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext import ops
from megatron_cp_ext.schedules import a2a_groups, p2p, p2p_plan
from megatron_cp_ext.schedules.common import GradAcc, accumulate
from megatron_cp_ext.testing.accounting import Tracker, add_storage, flash_stub, saved_bytes
from megatron_cp_ext.testing.pool import run_on_ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_is_four_ops_per_sliced_call(dtype):
    out, lse = torch.zeros(10, 2, 3, dtype=dtype), torch.full((10, 2), ops.LSE_FLOOR, dtype=dtype)
    part, part_lse = torch.randn(6, 2, 3, dtype=dtype), torch.randn(6, 2, dtype=dtype)
    with Tracker() as tr:
        ops.merge_partial(out[2:8], lse[2:8], part, part_lse, None, acc_finite=True)
    assert tr.num_ops == 4, tr.ops
    torch.testing.assert_close(out[2:8], part)  # first merge into an empty accumulator
    torch.testing.assert_close(lse[2:8], part_lse)


def test_accumulate_is_one_op():
    acc, src = torch.zeros(10, 2, 3), torch.ones(4, 2, 3)
    with Tracker() as tr:
        accumulate(acc, (3, 7), None, src)
        accumulate(acc, None, torch.tensor([0, 0, 9, 1]), src)
    assert tr.num_ops == 2, tr.ops
    assert acc.sum() == 2 * src.sum() and acc[0].sum() == 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_acc_adopts_16bit_whole_partial_widened(dtype):
    """A 16-bit partial over every row becomes the fp32 accumulator in one op (the widening),
    holding what a zero fill plus an add would hold; later partials add in one op each."""
    like, first, part = torch.zeros(10, 2, 3, dtype=dtype), torch.randn(10, 2, 3), torch.randn(4, 2, 3)
    first, part = first.to(dtype), part.to(dtype)
    acc = GradAcc(like)
    with Tracker() as tr:
        acc.add((0, 10), None, first)
    assert tr.num_ops == 1, tr.ops
    with Tracker() as tr:
        acc.add((3, 7), None, part)
    assert tr.num_ops == 1, tr.ops
    want = torch.zeros(10, 2, 3).add_(first)
    want[3:7] += part
    got = acc.result()
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want)


def _saved_worker(rank, world, comm):
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    sharding = mcx.shard_sequences([0, 64, 96, 160], world, balance="dualchunk")
    t, hq, hkv, d = sharding.num_tokens(rank), 4, 2, 8
    q, k, v = (torch.randn(t, h, d, requires_grad=True) for h in (hq, hkv, hkv))
    with flash_stub(), saved_bytes() as saved:
        out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding)
    add_storage(saved, out)  # the next layer saves the output: it must be the same storage
    ideal = sum(x.numel() * x.element_size() for x in (q, k, v, out)) + t * hq * 4
    with flash_stub(), Tracker() as tr:
        out.backward(torch.ones_like(out))
    return sum(saved.values()), ideal, tr.ops.get("aten::cat", 0)


@pytest.mark.parametrize("world,comm", [(2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "a2a"), (4, "a2a+p2p")])
def test_saved_for_backward_is_the_ideal(world, comm):
    """(4, "a2a"): 2 KV heads over 4 members, so KV heads are replicated: k and v are saved,
    not the larger head-sharded KV (backward moves them to heads again, packing K|V once more)."""
    for saved, ideal, cats in run_on_ranks(world, _saved_worker, comm, timeout=120):
        assert saved == ideal
        assert cats <= (3 if (world, comm) == (4, "a2a") else 2)  # per layer, none per varlen call


_SPLIT_MIN_BYTES = p2p_plan.SPLIT_MIN_BYTES


def _peak_worker(rank, world, comm, groups=None, hkv=4):
    """Forward and backward peaks over the ideal, as ``benchmarks/memory_launches.py`` counts;
    ``groups``: the a2a backward's head groups (forced: this batch is below the size rule's
    threshold; for a2a+p2p a ring per group); ``hkv``: KV heads (fewer than a2a members:
    replicated)."""
    a2a_groups.GROUPS = p2p.GROUPS = groups
    p2p_plan.SPLIT_MIN_BYTES = 0  # a2a+p2p's forward halves its wide ring calls at this size too
    try:
        return _peaks(rank, world, comm, hkv)
    finally:
        a2a_groups.GROUPS = p2p.GROUPS = None
        p2p_plan.SPLIT_MIN_BYTES = _SPLIT_MIN_BYTES


def _peaks(rank, world, comm, hkv):
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    sharding = mcx.shard_sequences([0, 410, 615, 768, 870, 921, 972, 1024], world, balance="dualchunk")
    t, hq, d = sharding.num_tokens(rank), 16, 64
    q, k, v = (torch.randn(t, h, d, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(t, hq, d)
    call = dict(cp_group=group, comm_type=comm, sharding=sharding)
    fwd, bwd = [], []
    with flash_stub():
        mcx.cp_attention(q, k, v, **call)  # plan built and cached, agreement done
        # Least of three layers: a collective's buffer that the backend's own thread releases
        # an op late only ever adds to a peak, and only in some layers (gloo's all-to-all).
        for _ in range(3):
            tr, refs = Tracker(), {}
            tr.track(q, k, v)
            with tr, saved_bytes(refs=refs):
                out = mcx.cp_attention(q, k, v, **call)
            fwd.append(tr.peak)
            tr.restart(refs, dout, out)  # q, k, v count only where saved
            with tr:
                out.backward(dout)
            bwd.append(tr.peak)
            q.grad = k.grad = v.grad = None
    ideal = sum(x.numel() * x.element_size() for x in (q, k, v, out)) + t * hq * 4
    return min(fwd) / ideal, min(bwd) / ideal


# Measured (cp 2 and 4, 16/4 heads, d 64, fp32): forward 1.41 p2p (1.61 at cp 4), 1.99 a2a,
# 2.20 a2a+p2p; backward 2.69 p2p (3.19 at cp 4, 2.64 with its ring run by two head groups),
# 2.79 a2a (2.39 by four head groups), 3.38 a2a+p2p at cp 4 (2.84 by two head groups; the
# grouped bounds fail the ungrouped peaks). Each bound keeps about one [t, hq, d] buffer (0.2)
# of margin; the pre-change peaks (3.02 / 3.29 p2p, 3.42 / 4.58 a2a, a2a's backward of 2.99
# before it adopted the kernel's dK/dV, 2.79 without head groups, and a2a+p2p's 4.18 before its
# ring narrowed dout/out and adopted its dK/dV partials) fail them.
# The worker takes the least of three layers, so a buffer gloo frees late in one layer does not
# count. Under load gloo's own thread can be late in every layer of a run: the grouped a2a then
# peaks one group's buffer (0.1) higher, 2.49 (once in 15 runs with both cores busy), so its
# bound is the backward goal of 2.5 rather than 2.39 plus a margin.
# Replicated KV heads (a2a over 4 members, 2 KV heads): forward 1.88 since it frees the
# head-sharded KV before the output's move home (2.10 before: the bound fails it), backward 3.21.
# a2a+p2p's forward: 2.04 since its ring halves a call over most of its queries (2.20 before,
# the partial as large as the accumulator beside it; the bound fails that).
@pytest.mark.parametrize(
    "world,comm,groups,fwd,bwd,hkv",
    [
        (2, "p2p", None, 1.65, 2.95, 4),
        (2, "a2a", 1, 2.2, 2.95, 4),
        (2, "a2a", 4, 2.2, 2.5, 4),  # the goal
        (4, "a2a+p2p", None, 2.15, 3.6, 4),
        (4, "a2a+p2p", 2, 2.15, 3.05, 4),
        (4, "p2p", 2, 1.85, 2.85, 4),
        (4, "a2a", 1, 1.95, 3.4, 2),  # replicated KV heads
    ],
)
def test_peak_memory_bounds(world, comm, groups, fwd, bwd, hkv):
    for f, b in run_on_ranks(world, _peak_worker, comm, groups, hkv, timeout=120):
        assert f <= fwd and b <= bwd, (f, b)
