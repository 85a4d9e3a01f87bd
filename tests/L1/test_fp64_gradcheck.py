"""fp64 is computed in fp64 end to end across CP ranks: ``gradcheck`` of the whole batch's
output w.r.t. the whole batch's q, k, v passes at CP size 2 for every comm type (the fp32
merge and gradient accumulators of before failed it even at CP size 1)."""

import pytest

from megatron_cp_ext.testing.cases import AttnCase
from megatron_cp_ext.testing.gradcheck import gradcheck_on_ranks
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (3, 0, 1, 5)  # an empty and a one-token sequence; 9 tokens keep gradcheck quick


def test_gradcheck_cp2_full_jacobian():
    """Every Jacobian entry (two forwards per input element), p2p with a bidirectional window."""
    case = AttnCase(seqlens=SEQLENS, comm_type="p2p", hq=2, hkv=1, d=3, dv=2, causal=False, window_size=(1, 2))
    assert all(run_on_ranks(2, gradcheck_on_ranks, case, timeout=120))


@pytest.mark.parametrize(
    "comm_type, a2a_size, mask",
    [
        ("p2p", 0, dict(causal=True)),
        ("all_gather", 0, dict(causal=True, chunk_size=2)),
        ("a2a", 0, dict(causal=False)),
        ("a2a+p2p", 1, dict(causal=True, window_size=(2, -1))),
    ],
    ids=["p2p-causal", "all_gather-chunk", "a2a-nomask", "a2a+p2p-window"],
)
def test_gradcheck_cp2_fast(comm_type, a2a_size, mask):
    """gradcheck's fast mode (random Jacobian projections) for the other comm types."""
    case = AttnCase(seqlens=SEQLENS, comm_type=comm_type, a2a_size=a2a_size, hq=2, hkv=1, d=3, dv=2, **mask)
    assert all(run_on_ranks(2, gradcheck_on_ranks, case, True, timeout=60))
