"""The CPU proxy of what CP adds to a layer's memory traffic (``testing/traffic.py``): its
counting rules on single ops (bytes worked out by hand), and the table for every comm type at
CP 2, 4 and 8 pinned (gloo ranks, flash-shaped stub kernels: exact and deterministic). A change
that moves more bytes or launches more ops around the kernels fails here; one that moves fewer
updates the table (and ``docs/performance.md``, "Traffic around the kernels")."""

import pytest
import torch

from megatron_cp_ext.testing.pool import run_on_ranks
from megatron_cp_ext.testing.traffic import Traffic, layer_traffic


def test_fused_merge_counts_the_kernel():
    """A merge of 3 partial rows (bf16, 2 heads x 4) into fp32 accumulators: the partial (48 B)
    and its lse (24 B), 3 accumulator rows (96 B) and their lse (24 B) read and written, the
    index (24 B) read; one launch, the fallback's own ops unseen."""
    from megatron_cp_ext.schedules import common
    from megatron_cp_ext.testing.traffic import fused_merges

    out, lse = torch.zeros(10, 2, 4), torch.full((10, 2), -1e30)
    part, part_lse, idx = torch.ones(3, 2, 4, dtype=torch.bfloat16), torch.zeros(3, 2), torch.tensor([0, 4, 9])
    with Traffic() as tr, fused_merges(tr):
        common.merge_partial(out, lse, part, part_lse, idx, acc_finite=True)
    assert (tr.read, tr.written, tr.launches) == (48 + 24 + 120 + 24, 120, 1)
    assert out[4].eq(1).all() and out[1].eq(0).all()


def test_row_dot_counts_the_kernel():
    """a2a's 16-bit row dot (bf16, 3 rows x 2 heads x 4): both operands (48 B each) read, the
    fp32 result (24 B) written, one launch; the CPU form's widened copies unseen."""
    from megatron_cp_ext.schedules.delta import row_dot
    from megatron_cp_ext.testing.traffic import fused_merges

    a, b = (torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in (0, 1))
    with Traffic() as tr, fused_merges(tr):
        got = row_dot(a, b)
    assert (tr.read, tr.written, tr.launches) == (96, 24, 1)
    assert torch.equal(got, row_dot(a, b))


def test_out_argument_is_written_not_read():
    """``index_select(..., out=)``: the 3 gathered rows read and written, the index read; the
    ``out`` buffer it overwrites is not read."""
    a, idx = torch.zeros(10, 4), torch.tensor([1, 3, 5])
    dst = torch.empty(3, 4)
    with Traffic() as tr:
        torch.index_select(a, 0, idx, out=dst)
    assert (tr.read, tr.written) == (48 + 24, 48)


def test_rules_on_single_ops():
    a, b = torch.zeros(10, 4), torch.zeros(10, 4)  # 160 B each
    idx = torch.tensor([1, 3, 5])  # 24 B
    with Traffic() as tr:
        torch.empty(100, 100)  # an allocation moves nothing
        a.copy_(b)  # reads b, writes a: 320
    assert (tr.read, tr.written, tr.launches) == (160, 160, 1)
    with Traffic() as tr:
        a.add_(b)  # reads a and b, writes a
        a[2:4]  # a view: nothing
    assert (tr.read, tr.written, tr.launches) == (320, 160, 1)
    with Traffic() as tr:
        a.index_select(0, idx)  # 3 rows of 16 B read, 48 written, the index read
        a.to(torch.float64)  # reads 160, writes 320
        torch.zeros(5)  # a fill: 20 written
    assert (tr.read, tr.written, tr.launches) == (48 + 24 + 160, 48 + 320 + 20, 3)
    src = torch.ones(3, 4)
    with Traffic() as tr:
        a.index_add_(0, idx, src)  # 3 rows (48 B) read and written, source and index read
        a.index_copy_(0, idx, src)  # 3 rows written, source and index read
    assert (tr.read, tr.written) == ((48 + 24 + 48) + (48 + 24), 48 + 48)
    assert tr.by_op["index_add_"] == tr.by_op["index_copy_"] == 1 and tr.moved == tr.read + tr.written


LENS = [700, 3, 0, 250, 600, 64, 431]
# (cp, comm): (forward ÷ ideal, backward ÷ ideal, forward launches, backward launches), the
# largest over the ranks; 2048 tokens, 8/2 heads, d 64, bf16, workload balance
PINNED = {
    (2, "p2p"): (0.981, 1.208, 11, 17),  # staged (within its memory bound)
    (2, "all_gather"): (1.115, 1.551, 4, 12),
    (2, "a2a"): (2.208, 2.019, 8, 13),
    (4, "p2p"): (0.977, 1.35, 13, 27),  # staged
    (4, "all_gather"): (0.941, 1.272, 8, 15),
    (4, "a2a"): (1.871, 2.534, 11, 26),
    (4, "a2a+p2p"): (2.464, 2.615, 25, 41),  # its ring across groups staged
    (8, "p2p"): (5.462, 3.288, 8, 35),  # the ring: a rank receives more than two blocks
    (8, "all_gather"): (0.838, 1.441, 8, 15),
    (8, "a2a"): (1.81, 2.466, 15, 34),
    (8, "a2a+p2p"): (4.259, 4.088, 14, 43),  # the ring, as p2p's
}


# the rings forced each way: the ring where the default runs staged, staged where it runs the ring
FORCED = {
    (2, "p2p:ring"): (3.265, 2.314, 4, 11),
    (4, "p2p:ring"): (3.952, 2.731, 6, 21),
    (8, "p2p:staged"): (0.872, 1.509, 12, 40),
    (4, "a2a+p2p:ring"): (3.538, 3.601, 12, 31),
    (8, "a2a+p2p:staged"): (2.446, 2.587, 21, 57),
}

# a2a's moves all by route (run by run into place, ``schedules/route.py``), as the rows above
# would go on a GPU were their messages large enough
ROUTED = {
    (8, "a2a"): (0.872, 1.801, 39, 81),
    (4, "a2a+p2p"): (1.554, 2.105, 34, 50),
}


@pytest.mark.parametrize(
    "cp,comm,floor",
    [(*k, None) for k in PINNED] + [(*k, None) for k in FORCED] + [(*k, 0) for k in ROUTED],
    ids=lambda x: str(x),
)
def test_traffic_table_pinned(cp, comm, floor):
    res = run_on_ranks(cp, layer_traffic, comm, LENS, (8, 2, 64), "bfloat16", "workload", floor, timeout=300)
    got = (
        round(max(r["fwd"] for r in res), 3), round(max(r["bwd"] for r in res), 3),
        max(r["fwd_launches"] for r in res), max(r["bwd_launches"] for r in res),
    )  # fmt: skip
    assert got == (ROUTED if floor is not None else FORCED if ":" in comm else PINNED)[(cp, comm)], got
