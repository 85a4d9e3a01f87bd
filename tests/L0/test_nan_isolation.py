"""A NaN (or inf) in one document stays in that document, forward and backward; fp64 is
computed in fp64 end to end (gradcheck), single process.

The reference backend computes several entries of a varlen call together; a product between
two entries' rows would turn ``0 x NaN`` into NaN in the other entry. These tests poison one
entry and require every other entry to be bit-for-bit what it is without the poison.
"""

import math

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import reference

# Many small entries (grouped into one padded batch) and one long one (its own group).
LQ = [5, 1, 7, 3, 2, 9, 4, 60]
LK = [8, 1, 7, 6, 2, 12, 4, 60]  # sk >= sq per entry
CALLS = [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0)), (False, (3, 1))]


def _call(poison_entry: int | None, tensor: str, value: float):
    g = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, *LQ]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *LK]).cumsum(0).to(torch.int32)
    x = {
        "q": torch.randn(int(cu_q[-1]), 4, 8, generator=g),
        "k": torch.randn(int(cu_k[-1]), 2, 8, generator=g),
        "v": torch.randn(int(cu_k[-1]), 2, 6, generator=g),
        "dout": torch.randn(int(cu_q[-1]), 4, 6, generator=g),
    }
    if poison_entry is not None:
        cu = cu_q if tensor in ("q", "dout") else cu_k
        a, b = int(cu[poison_entry]), int(cu[poison_entry + 1])
        x[tensor][a + (b - a) // 2] = value  # one row in the middle of the entry
    return x, cu_q, cu_k


def _rows_outside(cu: torch.Tensor, entry: int) -> torch.Tensor:
    keep = torch.ones(int(cu[-1]), dtype=torch.bool)
    keep[int(cu[entry]) : int(cu[entry + 1])] = False
    return keep


@pytest.mark.parametrize("causal, window", CALLS)
@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("entry", [2, 7])
def test_poison_stays_in_its_entry(entry, value, tensor, causal, window):
    results = []
    for poison in (None, entry):
        x, cu_q, cu_k = _call(poison, tensor, value)
        args = (cu_q, cu_k, max(LQ), max(LK), causal, window, 0.3)
        out, lse = reference.attn_fwd(x["q"], x["k"], x["v"], *args)
        grads = reference.attn_bwd(x["dout"], x["q"], x["k"], x["v"], out, lse, *args)
        results.append((out, lse, *grads))
    clean, poisoned = results
    q_rows, k_rows = _rows_outside(cu_q, entry), _rows_outside(cu_k, entry)
    for name, a, b, rows in zip(
        ("out", "lse", "dq", "dk", "dv"), clean, poisoned, (q_rows, q_rows, q_rows, k_rows, k_rows)
    ):
        assert torch.isfinite(b[rows]).all(), f"{name}: poison in entry {entry} leaked into other entries"
        assert torch.equal(a[rows], b[rows]), f"{name} of other entries changed"
    # ... and it does reach its own entry (else the test would pass vacuously)
    reached = poisoned[2][~q_rows] if tensor == "dout" else poisoned[0][~q_rows]
    assert not torch.isfinite(reached).all()


def test_cp1_nan_document_isolated_through_cp_attention():
    """The whole engine at CP size 1 (every comm type): NaN q in document 1 only."""
    cu = [0, 7, 20, 24]
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(24, 2, 4, generator=g) for _ in range(4))
    q_bad = q.clone()
    q_bad[10] = float("nan")
    sh = mcx.shard_sequences(cu, 1)
    other = torch.ones(24, dtype=torch.bool)
    other[7:20] = False
    for comm in mcx.COMM_TYPES:
        res = []
        for qq in (q, q_bad):
            qq = qq.clone().requires_grad_()
            kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
            out = mcx.cp_attention(qq, kk, vv, cp_group=None, comm_type=comm, sharding=sh, causal=False)
            out.backward(dout)
            res.append([out.detach(), qq.grad, kk.grad, vv.grad])
        for a, b in zip(*res):
            assert torch.isfinite(b[other]).all() and torch.equal(a[other], b[other]), comm


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a", "a2a+p2p"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window_size=(2, 1), chunk_size=3)])
def test_fp64_gradcheck_cp1(comm_type, mask):
    """fp64 is computed in fp64 end to end: the analytic gradient passes gradcheck."""
    torch.manual_seed(0)
    sh = mcx.shard_sequences([0, 3, 4, 9, 9, 11], 1)
    q = torch.randn(11, 2, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(11, 1, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(11, 1, 2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        return mcx.cp_attention(q, k, v, cp_group=None, comm_type=comm_type, sharding=sh, **mask)

    out = fn(q, k, v)
    assert out.dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fp64_matches_dense_reference_tightly():
    """fp64 through the merge: agreement to ~1e-12, far below fp32 rounding (~1e-7)."""
    from megatron_cp_ext.testing.reference import dense_attention

    cu = [0, 40, 41, 97]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(97, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sh = mcx.shard_sequences(cu, 1)
    out = mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, softmax_scale=1 / math.sqrt(8))
    want = dense_attention(q, k, v, cu, causal=True)
    assert (out - want).abs().max().item() < 1e-12
