"""TransformerEngine's padded THD layout (``cu_seqlens`` beside ``cu_seqlens_padded``) on every
comm type, against dense fp64 attention over the real tokens alone: real rows exact, padding rows
0 with zero gradients, and max logits over real tokens only, however large the padding's logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.sharding.te_layout import separate_padding
from megatron_cp_ext.testing.cases import AttnCase, cp_group_for
from megatron_cp_ext.testing.pool import run_on_ranks
from megatron_cp_ext.testing.reference import dense_attention

REAL = [5, 13, 0, 1, 8]  # real lengths; each padded to a multiple of 2 * cp
HQ, HKV, D = 4, 2, 8
PAD_VALUE = 10.0  # padding rows of q and k: logits of 10 * 10 * D * scale among themselves


def _batch(cp: int):
    padded = [-(-n // (2 * cp)) * 2 * cp + (2 * cp if n % 3 == 0 else 0) for n in REAL]  # some all-padding slots
    cu_real = [0, *torch.tensor(REAL).cumsum(0).tolist()]
    cu_pad = [0, *torch.tensor(padded).cumsum(0).tolist()]
    real_rows = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_pad[:-1], REAL)])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(cu_pad[-1], h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    pad = torch.ones(cu_pad[-1], dtype=torch.bool)
    pad[real_rows] = False
    q[pad], k[pad] = PAD_VALUE, PAD_VALUE
    return cu_real, cu_pad, real_rows, q, k, v


def _weight(n: int) -> torch.Tensor:
    """The loss weights of the global output (one loss over every rank's rows)."""
    return torch.arange(1, n * HQ * D + 1, dtype=torch.float64).view(n, HQ, D).sin()


def _worker(rank: int, world: int, comm: str) -> dict:
    cu_real, cu_pad, _, q, k, v = _batch(world)
    sharding = separate_padding(mcx.te_thd_sharding(cu_pad, world), cu_real)
    group = cp_group_for(AttnCase(seqlens=tuple(REAL), comm_type=comm, a2a_size=2), world)
    local = [sharding.shard(x, rank).requires_grad_() for x in (q, k, v)]
    out, top = mcx.cp_attention(*local, cp_group=group, comm_type=comm, sharding=sharding, causal=True,
                                return_max_logit=True)  # fmt: skip
    (out * sharding.shard(_weight(cu_pad[-1]), rank)).sum().backward()
    return {"out": out.detach(), "max": top, "grads": [x.grad for x in local], "index": sharding.global_index(rank)}


@pytest.mark.parametrize(("world", "comm"), [(2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "p2p"), (4, "a2a+p2p")])
def test_padding_attends_nothing_and_never_reaches_max_logits(world: int, comm: str) -> None:
    cu_real, cu_pad, real_rows, q, k, v = _batch(world)
    results = run_on_ranks(world, _worker, comm)
    n = cu_pad[-1]
    out = torch.zeros(n, HQ, D, dtype=torch.float64)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for r in results:
        out[r["index"]] = r["out"]
        for g, part in zip(grads, r["grads"], strict=True):
            g[r["index"]] = part
    ref = [x[real_rows].clone().requires_grad_() for x in (q, k, v)]
    want = dense_attention(*ref, cu_real, causal=True)
    weight = _weight(n)[real_rows]
    (want * weight).sum().backward()
    pad = torch.ones(n, dtype=torch.bool)
    pad[real_rows] = False
    assert pad.any() and torch.equal(out[pad], torch.zeros_like(out[pad]))
    torch.testing.assert_close(out[real_rows], want.detach(), rtol=0, atol=1e-10)
    for g, r in zip(grads, ref, strict=True):
        assert torch.equal(g[pad], torch.zeros_like(g[pad]))
        torch.testing.assert_close(g[real_rows], r.grad, rtol=0, atol=1e-10)
    kk = ref[1].detach().repeat_interleave(HQ // HKV, dim=1)
    s = torch.einsum("qhd,khd->hqk", ref[0].detach(), kk) / math.sqrt(D)
    seq = torch.repeat_interleave(torch.arange(len(REAL)), torch.tensor(REAL))
    pos = torch.cat([torch.arange(x) for x in REAL])
    vis = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    top = s.masked_fill(~vis[None], float("-inf")).flatten(1).amax(1)
    assert top.max() < PAD_VALUE**2  # the padding's own logits would be far larger
    for r in results:
        torch.testing.assert_close(r["max"].double(), top, rtol=0, atol=1e-6)


def _divergent(rank: int, world: int, check: bool) -> str:
    """Rank 1 forgot the padding's muting (a sharding rebuilt without it): refused everywhere."""
    cu_real, cu_pad, _, q, k, v = _batch(world)
    sharding = separate_padding(mcx.te_thd_sharding(cu_pad, world), cu_real)
    if rank == 1:
        sharding = dataclasses.replace(sharding, muted=frozenset())
    local = [sharding.shard(x, rank) for x in (q, k, v)]
    try:
        mcx.cp_attention(*local, cp_group=dist.group.WORLD, sharding=sharding, causal=True, check=check)
    except mcx.CPRankMismatchError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("check", [False, True])
def test_ranks_that_disagree_on_muted_sequences_are_refused(check: bool) -> None:
    messages = run_on_ranks(2, _divergent, check, timeout=60)
    assert all(messages) and len(set(messages)) == 1, messages


def test_inspect_counts_what_the_plans_move() -> None:
    """p2p moves exactly the rows other ranks' queries see: with the padding muted, the report's
    needed rows leave the padding out as the plans do (received == needed on every rank)."""
    cu_real, cu_pad, *_ = _batch(4)
    sharding = separate_padding(mcx.te_thd_sharding(cu_pad, 4), cu_real)
    assert sharding.muted == {2 * i + 1 for i, n in enumerate(REAL) if _batch(4)[1][i + 1] - _batch(4)[1][i] > n}
    report = mcx.inspect_plan(sharding, "p2p", causal=True)
    for r in report.ranks.values():
        assert r.bytes_received["forward"] == r.bytes_needed["forward"] > 0


def _sink_worker(rank: int, world: int, comm: str) -> dict:
    """Learnable sinks on the padded layout, the upstream gradient NaN on every padding row."""
    cu_real, cu_pad, real_rows, q, k, v = _batch(world)
    sharding = separate_padding(mcx.te_thd_sharding(cu_pad, world), cu_real)
    group = cp_group_for(AttnCase(seqlens=tuple(REAL), comm_type=comm, a2a_size=2), world)
    local = [sharding.shard(x, rank).requires_grad_() for x in (q, k, v)]
    offset = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out = mcx.cp_attention(*local, cp_group=group, comm_type=comm, sharding=sharding, causal=True,
                           softmax_offset=offset)  # fmt: skip
    dout = _weight(cu_pad[-1])
    pad = torch.ones(cu_pad[-1], dtype=torch.bool)
    pad[real_rows] = False
    dout[pad] = float("nan")
    out.backward(sharding.shard(dout, rank))
    return {"d_offset": offset.grad, "grads": [x.grad for x in local], "index": sharding.global_index(rank)}


@pytest.mark.parametrize(("world", "comm"), [(2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "p2p"), (4, "a2a+p2p")])
def test_sink_gradient_takes_nothing_from_padding(world: int, comm: str) -> None:
    """A NaN in the upstream gradient of padding rows alone (their output is 0) made the sink's
    gradient NaN on every head (0 * NaN): the sink's and q/k/v's gradients equal dense fp64
    attention over the real tokens."""
    cu_real, cu_pad, real_rows, q, k, v = _batch(world)
    results = run_on_ranks(world, _sink_worker, comm)
    ref = [x[real_rows].clone().requires_grad_() for x in (q, k, v)]
    offset = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    want = dense_attention(*ref, cu_real, causal=True, softmax_offset=offset)
    (want * _weight(cu_pad[-1])[real_rows]).sum().backward()
    torch.testing.assert_close(sum(r["d_offset"] for r in results), offset.grad, rtol=0, atol=1e-10)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for r in results:
        for g, part in zip(grads, r["grads"], strict=True):
            g[r["index"]] = part
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g[real_rows], r.grad, rtol=0, atol=1e-10)
