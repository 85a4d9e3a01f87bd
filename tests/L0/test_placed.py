"""Partials copied into place (``schedules/placed.py``) against the merging accumulators they
stand in for: where calls never share a query row, the same output, lse and dq (rounded to the
input dtype as the caller rounds), rows no call covers included."""

import numpy as np
import torch

from megatron_cp_ext.plan import VarlenCall
from megatron_cp_ext.runtime.ops import LSE_FLOOR
from megatron_cp_ext.schedules.common import GradAcc, OutAcc
from megatron_cp_ext.schedules.placed import PlacedGrad, PlacedOut, placement


def _call(*rows):
    return VarlenCall.build((-1, 0), np.array([[a, b, 0, b - a] for a, b in rows], dtype=np.int64))


def test_placement_by_hand():
    assert placement([_call((0, 5)), _call((5, 9))], 9) == (True, True)
    assert placement([_call((0, 5)), _call((6, 9))], 9) == (True, False)  # row 5 in no call
    assert placement([_call((0, 3), (5, 9))], 9) == (True, False)
    assert placement([_call((0, 5)), _call((4, 9))], 9) == (False, False)  # row 4 twice
    assert placement([_call((0, 5), (2, 3))], 9) == (False, False)  # within one call
    assert placement([], 0) == (True, True) and placement([], 3) == (True, False)


def _partials(dtype):
    g = torch.Generator().manual_seed(0)
    o1, o2 = (torch.randn(n, 2, 4, generator=g).to(dtype) for n in (3, 4))
    l1, l2 = torch.randn(3, 2, generator=g), torch.randn(4, 2, generator=g)
    l2[1, 0] = float("-inf")  # a row that sees no key in its call: the floor, output 0
    o2[1, 0] = 0
    return (o1, l1), (o2, l2)


def test_placed_out_equals_merged():
    """Rows 0-2 by a slice, rows 4, 6, 7, 8 by an index; rows 3 and 5 in no call."""
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(9, 2, 4, dtype=dtype)
        (o1, l1), (o2, l2) = _partials(dtype)
        idx = torch.tensor([4, 6, 7, 8])
        got, want = PlacedOut(q, 4, covered=False), OutAcc(q, 4)
        for acc in (got, want):
            acc.merge((0, 3), None, o1.clone(), l1.clone())
            acc.merge(None, idx, o2.clone(), l2.clone())
        (go, gl), (wo, wl) = got.result(), want.result()
        assert go.dtype == dtype and torch.equal(go, wo.to(dtype)) and torch.equal(gl, wl)
        assert gl[3].eq(LSE_FLOOR).all() and go[5].eq(0).all() and gl[6, 0] == LSE_FLOOR


def test_placed_out_adopts_a_whole_call_and_fills_nothing_when_covered():
    q = torch.zeros(7, 2, 4, dtype=torch.bfloat16)
    (o1, l1), (o2, l2) = _partials(torch.bfloat16)
    whole = torch.cat([o1, o2])
    acc = PlacedOut(q, 4, covered=True)
    acc.merge((0, 7), None, whole, torch.cat([l1, l2]))
    assert acc.result()[0] is whole
    acc = PlacedOut(q, 4, covered=True)
    acc.merge((3, 7), None, o2, l2.clone())
    acc.merge((0, 3), None, o1, l1.clone())
    assert torch.equal(acc.result()[0], whole)


def test_placed_grad_equals_summed():
    for dtype in (torch.bfloat16, torch.float64):
        like = torch.zeros(9, 2, 4, dtype=dtype)
        (g1, _), (g2, _) = _partials(dtype)
        idx = torch.tensor([4, 6, 7, 8])
        got, want = PlacedGrad(like, covered=False), GradAcc(like)
        for acc in (got, want):
            acc.add((0, 3), None, g1)
            acc.add(None, idx, g2)
        assert torch.equal(got.result(), want.result().to(dtype)) and got.result().dtype == dtype
        assert torch.equal(PlacedGrad(like, covered=True).result(), torch.zeros_like(like))


def test_grad_acc_slices_copy_then_add_against_a_dense_sum():
    """``GradAcc`` over row slices (overlapping, disjoint, touching), an indexed add and an
    ``into`` buffer against an fp64 sum into zeros: rows no partial wrote are 0, every other
    row the sum of its partials (16-bit partials widened exactly)."""
    g = torch.Generator().manual_seed(1)
    like = torch.zeros(20, 2, 3, dtype=torch.bfloat16)
    parts = [((2, 6), None), ((10, 14), None), ((4, 12), None), ((14, 16), None),
             (None, torch.tensor([0, 5, 19])), ((3, 5), None)]  # fmt: skip
    for into in (None, torch.full((20, 2, 3), float("nan"))):
        acc, want = GradAcc(like, into), torch.zeros(20, 2, 3, dtype=torch.float64)
        for k, (sl, idx) in enumerate(parts):
            n = sl[1] - sl[0] if sl else len(idx)
            src = torch.randn(n, 2, 3, generator=g).to(torch.bfloat16)
            acc.add(sl, idx, src)
            want[slice(*sl) if sl else idx] += src.double()
            if k == 2:  # mid-way: the rows written so far are three runs joined into one
                assert acc._written == [(2, 14)]
        got = acc.result()
        assert got.dtype == torch.float32 and (into is None or got.data_ptr() == into.data_ptr())
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        assert (got[[1, 16, 17, 18]] == 0).all()
