"""p2p on a backend without tags (NCCL matches each pair's messages in posting order only):
with every tag dropped, forward and backward still equal the dense fp64 reference. The
backward batch carries two streams (next KV block, previous dK/dV partial), so this checks
that both ends of every pair list them in the same order, empty slots included."""

import pytest

from megatron_cp_ext.runtime import comm
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads


@pytest.mark.parametrize(
    "world,balance,seqlens",
    [(8, "workload", (13, 0, 1, 30, 7, 2, 21)), (8, "dualchunk", (40, 3, 9, 25)), (4, "contiguous", (5, 50, 2, 11))],
)
def test_p2p_without_tags_matches_reference(monkeypatch, world, balance, seqlens):
    post = comm.Peers.post

    def untagged(self, sends, recvs):
        self.tag = 0
        return post(self, [m._replace(tag=None) for m in sends], [m._replace(tag=None) for m in recvs])

    monkeypatch.setattr(comm.Peers, "post", untagged)
    case = AttnCase(seqlens=seqlens, comm_type="p2p", hq=4, hkv=2, seed=world, balance=balance)
    check_case(run_threads(world, run_case, case, timeout=120), case)
