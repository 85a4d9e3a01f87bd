"""a2a+p2p with fewer query heads than a2a members: a member without heads computes nothing and
skips the ring across groups, and ``inspect_plan`` counts no ring bytes for it: the ring
messages each rank posts equal its report's ring steps, forward and backward, and the results
equal the dense fp64 reference. (The ``auto`` estimate prices such members the same way; it
reports the slowest rank, which these members are not, so it is not asserted here.)"""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime import comm
from megatron_cp_ext.schedules import p2p
from megatron_cp_ext.testing.cases import AttnCase, check_case, p2p_schedule, run_case
from megatron_cp_ext.testing.inproc import run_threads

LENS = (13, 0, 1, 30, 7, 2, 11)
SENT: dict = {}
"""Ring bytes posted, by (rank, phase)."""


@pytest.mark.parametrize("schedule", ["ring", "staged"])
def test_members_without_heads_send_nothing_the_report_does_not_count(monkeypatch, schedule: str) -> None:
    post = comm.Peers.post

    def posted(self, sends, recvs):
        if self.tag == p2p._KV_TAG:  # the ring's messages (a2a's moves go by all-to-all or route)
            key = (dist.get_rank(), "backward" if torch._C._current_graph_task_id() != -1 else "forward")
            SENT[key] = SENT.get(key, 0) + sum(m[1].numel() * m[1].element_size() for m in sends)
        return post(self, sends, recvs)

    SENT.clear()
    monkeypatch.setattr(comm.Peers, "post", posted)
    case = AttnCase(seqlens=LENS, comm_type="a2a+p2p", a2a_size=2, hq=1, hkv=1, d=8, dv=8, causal=False,
                    dtype="float32", p2p_schedule=schedule)  # fmt: skip
    check_case(run_threads(4, run_case, case, timeout=120), case)
    with p2p_schedule(schedule):
        rep = mcx.inspect_plan(case.sharding(4), "a2a+p2p", causal=False, a2a_size=2, num_heads=1, num_kv_heads=1,
                               head_dim=8, dtype=torch.float32)  # fmt: skip
    for r in range(4):
        for phase in ("forward", "backward"):
            want = sum(s.bytes_sent[phase] for s in rep.ranks[r].steps if s.kind != "a2a")
            assert SENT.get((r, phase), 0) == want, (r, phase, SENT, want)
    assert any(rep.ranks[r].heads == 0 for r in range(4)), "the case has members without heads"
