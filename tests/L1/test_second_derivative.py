"""cp_attention has first derivatives only, and says so.

Under ``create_graph=True`` (a gradient penalty, Hessian-vector products) its backward used to
be recorded in part: the second derivative came out wrong by O(1) with no error, even at CP 1
(and ``all_gather`` failed on an unrelated in-place error). Now the first derivatives are exact
as before and differentiating them raises a clear error, on every rank, for every comm type.
"""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.schedules.first_order import SECOND_DERIVATIVE
from megatron_cp_ext.testing.inproc import run_threads
from megatron_cp_ext.testing.reference import dense_attention

CU = [0, 5, 12, 19]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(CU[-1], 2, 8, generator=g, dtype=torch.float64) for _ in range(4)]


def _rank(rank: int, world: int, comm_type: str, sink: bool):
    q_all, k_all, v_all, dout_all = _inputs()
    sharding = mcx.shard_sequences(CU, world)
    q, k, v = (sharding.shard(x, rank).clone().requires_grad_() for x in (q_all, k_all, v_all))
    offset = torch.zeros(2, dtype=torch.float64, requires_grad=True) if sink else None
    group = dist.group.WORLD if world > 1 else None
    out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm_type, sharding=sharding, softmax_offset=offset)
    grads = torch.autograd.grad(out, (q, k, v), sharding.shard(dout_all, rank), create_graph=True)
    try:
        sum((g**2).sum() for g in grads).backward()
        second = "ran"
    except RuntimeError as err:
        second = str(err)
    return [g.detach() for g in grads], second


@pytest.mark.parametrize("world, comm_type", [(1, "p2p"), (2, "p2p"), (2, "all_gather"), (2, "a2a")])
def test_first_derivatives_exact_second_refused(world, comm_type):
    results = run_threads(world, _rank, comm_type, False, timeout=120)
    q, k, v, dout = (x.requires_grad_() for x in _inputs())
    want = torch.autograd.grad(dense_attention(q, k, v, CU, causal=True), (q, k, v), dout.detach())
    sharding = mcx.shard_sequences(CU, world)
    for i, w in enumerate(want):
        got = sharding.unshard([r[0][i] for r in results])
        torch.testing.assert_close(got, w, atol=1e-12, rtol=0)
    assert all(r[1] == SECOND_DERIVATIVE for r in results), [r[1] for r in results]


def test_with_a_sink_too():
    assert run_threads(1, _rank, "p2p", True, timeout=60)[0][1] == SECOND_DERIVATIVE
