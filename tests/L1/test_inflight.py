"""Transfer buffers stay held until their wait (``runtime/inflight.py``, ``comm.Peers``): a real p2p
layer (forward and backward, CP 4 through the in-process runner) posts only batches it later
waits, every byte sent is a byte received; a batch dropped before its wait is caught; the
allocator-trace check flags exactly the allocations inside an in-flight window."""

import gc

import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime import inflight
from megatron_cp_ext.runtime.comm import Batch, Peers
from megatron_cp_ext.testing.inproc import run_threads


def _layer(rank: int, world: int) -> None:
    cu = [0, 1, 40, 41, 130, 200]
    sh = mcx.shard_sequences(cu, world)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(sh.num_tokens(rank), h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    out = mcx.cp_attention(q, k, v, cp_group=dist.group.WORLD, comm_type="p2p", sharding=sh, causal=True)
    out.backward(torch.ones_like(out))


def test_p2p_layer_holds_every_buffer_until_its_wait():
    with inflight.tracking() as ledger:
        run_threads(4, _layer, timeout=120)
    gc.collect()
    s = ledger.summary()
    assert s["batches"] > 0 and s["unwaited"] == [] and s["violations"] == []
    sent = sum(b.nbytes for b in ledger.buffers if b.role == "send")
    assert sent > 0 and sent == sum(b.nbytes for b in ledger.buffers if b.role == "recv")
    assert all(w > b.posted for b, w in ledger.windows())


def _drop(rank: int, world: int) -> list:
    x = torch.arange(12.0).reshape(3, 4)
    peers = Peers(dist.group.WORLD)
    if rank == 0:
        b1 = peers.post([(1, x.t())], [])  # non-contiguous: the batch holds the copy it sent
        held = b1.tensors[0]
        assert isinstance(b1, Batch) and held.is_contiguous() and held.data_ptr() != x.data_ptr()
        Peers.wait(b1)
        assert b1.tensors == []
        peers.post([(1, x)], [])  # dropped without a wait
        return []
    got, lost = torch.empty(4, 3), torch.empty(3, 4)
    b1, b2 = peers.post([], [(0, got)]), peers.post([], [(0, lost)])
    Peers.wait(b1)
    Peers.wait(b2)
    assert torch.equal(got, x.t()) and torch.equal(lost, x)
    return []


def test_batch_released_before_wait_is_a_violation():
    with inflight.tracking() as ledger:
        run_threads(2, _drop, timeout=60)
    gc.collect()
    s = ledger.summary()
    assert s["batches"] == 4 and len(s["unwaited"]) == 1
    assert len(s["violations"]) == 1 and "released before its wait" in s["violations"][0]


def test_reuse_hazards_on_a_trace():
    buf = inflight.InFlight(batch=3, role="recv", addr=0x1000, nbytes=0x100, device="cuda:0", stream=7, posted=3)
    allocs = [
        {"addr": 0x1080, "size": 0x200, "stream": 0, "seq": 2},  # before the post
        {"addr": 0x1080, "size": 0x200, "stream": 0, "seq": 3},  # in flight, other stream
        {"addr": 0x10F0, "size": 0x10, "stream": 7, "seq": 4},  # in flight, same stream
        {"addr": 0x1100, "size": 0x10, "stream": 0, "seq": 4},  # in flight, adjacent bytes only
        {"addr": 0x1000, "size": 0x100, "stream": 0, "seq": 5},  # after the wait
        {"addr": 0x1000, "size": 0x100, "stream": 0, "seq": None},  # untagged
    ]
    hazards = inflight.reuse_hazards([(buf, 5)], allocs)
    assert len(hazards) == 2 and "across streams" in hazards[0] and "across streams" not in hazards[1]
    assert len(inflight.reuse_hazards([(buf, -1)], allocs)) == 3  # never waited: in flight to the end
    trace = {"device_traces": [[
        {"action": "alloc", "addr": 16, "size": 512, "stream": 5, "user_metadata": "mcx-seq:9"},
        {"action": "free_requested", "addr": 16, "size": 512, "stream": 5},
        {"action": "alloc", "addr": 32, "size": 512, "stream": 0},
    ]]}  # fmt: skip
    assert inflight.trace_allocs(trace) == [
        {"addr": 16, "size": 512, "stream": 5, "seq": 9},
        {"addr": 32, "size": 512, "stream": 0, "seq": None},
    ]


def test_reuse_hazards_with_per_thread_tags():
    """The allocator's tags are per thread: an allocation tagged 4 by a thread whose next tick
    is 9 may have come after the wait at 5 (not a reuse); one tagged 3 by a thread that ticks
    again at 5 came before the wait (a reuse)."""
    ledger = inflight.Ledger(tag_allocations=False)
    ledger.thread_of = {3: 1, 4: 2, 5: 1, 9: 2, 10: 1}
    nxt = ledger.next_ticks()
    assert nxt == {3: 5, 4: 9, 5: 10}
    buf = inflight.InFlight(batch=3, role="recv", addr=0x1000, nbytes=0x100, device="cuda:0", stream=0, posted=3)
    allocs = [
        {"addr": 0x1000, "size": 0x100, "stream": 0, "seq": 3},  # thread 1, before its tick 5: in flight
        {"addr": 0x1000, "size": 0x100, "stream": 0, "seq": 4},  # thread 2, any time before 9
        {"addr": 0x1000, "size": 0x100, "stream": 0, "seq": 10},  # thread 1's last tick: after the wait
    ]
    hazards = inflight.reuse_hazards([(buf, 5)], allocs, nxt)
    assert len(hazards) == 1 and "allocated at 3" in hazards[0]
    assert len(inflight.reuse_hazards([(buf, -1)], allocs, nxt)) == 3  # never waited
