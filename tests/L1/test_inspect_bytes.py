"""``inspect_plan``'s bytes against the bytes a run hands to its collectives, forward and
backward, for ``p2p`` and ``all_gather`` in fp32 and fp64 (fp64 keeps fp64 dK/dV accumulators
and sends them: the report priced them at 4 bytes an element). ``a2a``'s backward is held to
the report in ``tests/L1/test_a2a_stand_in.py``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime import comm
from megatron_cp_ext.schedules import all_gather
from megatron_cp_ext.testing.pool import run_on_ranks

LENGTHS = [40, 3, 0, 17, 64, 9]


def _sent_case(rank: int, world: int, comm_type: str, dtype: str) -> dict:
    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def count(n: int) -> None:
        sent[phase[0]] += n

    post, gather, scatter = comm.Peers.post, comm.all_gather_padded, comm.reduce_scatter_padded

    def posted(self, sends, recvs):
        for m in sends:
            t = m[1]
            count(t.numel() * t.element_size())
        return post(self, sends, recvs)

    def gathered(x, pad_rows, group):
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        count((dist.get_world_size(group) - 1) * pad_rows * row)
        return gather(x, pad_rows, group)

    def scattered(full, group):
        size = dist.get_world_size(group)
        count((size - 1) * full.numel() // size * full.element_size())
        return scatter(full, group)

    cu = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    sharding = mcx.shard_sequences(cu, world, balance="dualchunk")
    g = torch.Generator().manual_seed(rank)
    t = sharding.num_tokens(rank)
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=getattr(torch, dtype)).requires_grad_() for h in (4, 2, 2))
    with (
        mock.patch.object(comm.Peers, "post", posted),
        mock.patch.object(all_gather, "all_gather_padded", gathered),
        mock.patch.object(all_gather, "reduce_scatter_padded", scattered),
    ):
        out = mcx.cp_attention(q, k, v, cp_group=dist.group.WORLD, comm_type=comm_type, sharding=sharding)
        phase[0] = "backward"
        out.backward(torch.ones_like(out))
    report = mcx.inspect_plan(sharding, comm_type, num_heads=4, num_kv_heads=2, head_dim=8, dtype=getattr(torch, dtype))
    return {"sent": sent, "report": report.ranks[rank].bytes_sent}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_report_counts_what_the_run_sends(comm_type, dtype):
    for rank, res in enumerate(run_on_ranks(2, _sent_case, comm_type, dtype)):
        assert res["sent"]["forward"] > 0 and res["sent"]["backward"] > 0, res
        assert res["sent"] == res["report"], (rank, res)
