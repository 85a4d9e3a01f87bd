"""A prepared call runs only on tensors of the shapes and dtype it was planned for, and runs a
backward only where the planned (agreed) call does.

Its plan fixes the softmax scale (from the head dim), the head split and, for bshd/sbhd, the
batch layout; a call on other tensors with the same token count used to run: a head dim of 16
on a plan for 8 attended with the scale 1/sqrt(8), a bshd batch of 4 x 4 on a plan for 2 x 8
attended as two sequences and came back shaped for the plan. Now it raises, naming the shapes.
A call that requires grad on a plan agreed without a backward (or the reverse) used to run: on
one rank alone, its backward waited forever in the ring (every rank agreed on no backward).
"""

from __future__ import annotations

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.reference import dense_attention


def _thd(d: int, heads=(4, 2, 2), tokens: int = 12, dtype=torch.float64):
    return [torch.randn(tokens, h, d, dtype=dtype) for h in heads]


def test_the_planned_call_runs_and_matches_dense():
    q, k, v = _thd(8)
    prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=mcx.shard_sequences([0, 5, 12], 1))
    want = dense_attention(q, k, v, [0, 5, 12], causal=True)
    torch.testing.assert_close(prepared(q, k, v), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: _thd(16),  # head dim: the plan's scale is 1/sqrt(8)
        lambda: _thd(8, heads=(2, 2, 2), tokens=24),  # same elements, other heads and tokens
        lambda: _thd(8, dtype=torch.float32),
    ],
    ids=["head_dim", "heads", "dtype"],
)
def test_thd_call_on_other_tensors_is_refused(call):
    q, k, v = _thd(8)
    prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=mcx.shard_sequences([0, 5, 12], 1))
    with pytest.raises(mcx.CPArgumentError, match="planned call"):
        prepared(*call())


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_seq_format_call_on_another_batch_layout_is_refused(fmt):
    shape = (lambda b, s: (b, s, 4, 8)) if fmt == "bshd" else (lambda b, s: (s, b, 4, 8))
    planned = [torch.zeros(shape(2, 16), dtype=torch.float64) for _ in range(3)]
    prepared = mcx.plan_cp_attention(*planned, cp_group=None, qkv_format=fmt)
    with pytest.raises(mcx.CPArgumentError, match="planned call"):
        prepared(*[torch.randn(shape(4, 8), dtype=torch.float64) for _ in range(3)])


@pytest.mark.parametrize("copy", ["pickle", "deepcopy"])
def test_a_prepared_call_does_not_copy_and_says_why(copy):
    import copy as copying
    import pickle

    q, k, v = _thd(8)
    prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=mcx.shard_sequences([0, 5, 12], 1))
    with pytest.raises(mcx.CPArgumentTypeError, match="Pickle the CPSharding"):
        pickle.dumps(prepared) if copy == "pickle" else copying.deepcopy(prepared)


@pytest.mark.parametrize("planned_grad", [False, True])
def test_a_call_whose_backward_differs_from_the_plan_is_refused(planned_grad):
    q, k, v = _thd(8)
    sharding = mcx.shard_sequences([0, 5, 12], 1)
    planned = [x.clone().requires_grad_(planned_grad) for x in (q, k, v)]
    prepared = mcx.plan_cp_attention(*planned, cp_group=None, sharding=sharding)
    assert prepared.grad is planned_grad
    with pytest.raises(mcx.CPArgumentError, match="backward"):
        prepared(*[x.clone().requires_grad_(not planned_grad) for x in (q, k, v)])
    if planned_grad:  # the same tensors under no_grad: no backward either
        with torch.no_grad(), pytest.raises(mcx.CPArgumentError, match="backward"):
            prepared(*planned)


def test_a_call_planned_with_grad_matches_dense_gradients():
    q, k, v = (x.requires_grad_() for x in _thd(8))
    prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=mcx.shard_sequences([0, 5, 12], 1))
    dout = torch.randn(12, 4, 8, dtype=torch.float64)
    got = torch.autograd.grad(prepared(q, k, v), (q, k, v), dout)
    want = torch.autograd.grad(dense_attention(q, k, v, [0, 5, 12], causal=True), (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "offset",
    [None, torch.zeros(1, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64), torch.zeros(4), [0.0] * 4],
    ids=["missing", "one_head", "4x1", "fp32", "list"],
)
def test_a_call_with_another_softmax_offset_is_refused(offset):
    """The offset is checked against the planned one: a [1] offset broadcast over every head at
    CP 1 and p2p, and under a2a it failed on the ranks whose heads it did not reach only (the
    others waited in the all-to-all). The planned offset itself runs, matching dense."""
    q, k, v = _thd(8)
    sink = torch.randn(4, dtype=torch.float64)
    prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=mcx.shard_sequences([0, 5, 12], 1),
                                     softmax_offset=sink)  # fmt: skip
    with pytest.raises(mcx.CPArgumentError, match="softmax_offset"):
        prepared(q, k, v, softmax_offset=offset)
    want = dense_attention(q, k, v, [0, 5, 12], causal=True, softmax_offset=sink)
    torch.testing.assert_close(prepared(q, k, v, softmax_offset=sink), want, atol=1e-12, rtol=0)
