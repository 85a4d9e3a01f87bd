"""Attention sinks (``softmax_offset``) on every comm type, layout and mask, against the dense
fp64 reference extended with the sink: outputs, dQ/dK/dV and the offset's gradient (the sum
of the ranks' partials)."""

import pytest
import torch

from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.pool import run_on_ranks

THD = (45, 0, 1, 300, 7)  # 300 is cut by the workload balance
SEQ = (16, 16)  # bshd/sbhd: b equal sequences, s divisible by 2*cp
COMMS = [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)]
LAYOUTS = [("thd", "workload"), ("thd", "dualchunk"), ("bshd", "dualchunk"), ("sbhd", "dualchunk")]
MASKS = {
    "causal": dict(causal=True),
    "nomask": dict(causal=False),
    "left4": dict(causal=True, window_size=(4, 0)),
    "chunk5": dict(causal=False, chunk_size=5, window_size=(3, 2)),
}
HEADS = {"gqa": dict(hq=4, hkv=2), "mla": dict(hq=4, hkv=4, d=12, dv=8)}
SINK = (0.7, -1.5, 2.0, 0.0)


def _grid():
    for comm, a2a in COMMS:
        for fmt, balance in LAYOUTS:
            for mask in MASKS:
                for heads in ("gqa", "mla") if mask == "causal" else ("gqa",):
                    name = f"{comm}-{fmt}-{balance}-{mask}-{heads}"
                    yield pytest.param(comm, a2a, fmt, balance, mask, heads, id=name)


@pytest.mark.parametrize("comm, a2a, fmt, balance, mask, heads", list(_grid()))
def test_sink_matches_dense(comm, a2a, fmt, balance, mask, heads):
    case = AttnCase(
        seqlens=THD if fmt == "thd" else SEQ, comm_type=comm, a2a_size=a2a, qkv_format=fmt, balance=balance,
        sink=SINK, **HEADS[heads], **MASKS[mask],
    )  # fmt: skip
    check_case(run_on_ranks(4, run_case, case), case)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("comm, a2a", COMMS)
def test_sink_dtypes(comm, a2a, dtype):
    case = AttnCase(seqlens=THD, comm_type=comm, a2a_size=a2a, hq=4, hkv=2, dtype=dtype, sink=SINK)
    check_case(run_on_ranks(4, run_case, case), case)


def test_sink_with_uneven_a2a_heads():
    """6 heads over an a2a group of 4: each member adds the sink of its own (uneven) heads."""
    case = AttnCase(seqlens=THD, comm_type="a2a", hq=6, hkv=3, sink=(0.1, 0.2, -0.3, 1.0, -2.0, 0.5))
    check_case(run_on_ranks(4, run_case, case), case)


@pytest.mark.parametrize("comm, a2a", COMMS)
def test_infinite_sinks(comm, a2a):
    """A sink of +inf takes every probability: its head's output and its gradients (q, k, v and
    the sink's own) are exactly 0. One of -inf adds nothing. The other heads are unchanged:
    equal to a run with a finite sink on that head, itself checked against dense fp64."""
    seq = dict(seqlens=THD, comm_type=comm, a2a_size=a2a, hq=4, hkv=4, dtype="float64")
    finite = AttnCase(**seq, sink=(0.0, 0.7, float("-inf"), 2.0))
    check_case(run_on_ranks(4, run_case, finite), finite)
    want = run_on_ranks(4, run_case, finite)
    got = run_on_ranks(4, run_case, AttnCase(**seq, sink=(float("inf"), 0.7, float("-inf"), 2.0)))
    for g, w in zip(got, want, strict=True):
        for name in ("out", "dq", "dk", "dv"):
            assert torch.equal(g[name][:, 0], torch.zeros_like(g[name][:, 0])), name
            torch.testing.assert_close(g[name][:, 1:], w[name][:, 1:], rtol=1e-12, atol=1e-12)
        assert g["doffset"][0] == 0 and torch.isfinite(g["doffset"]).all()
