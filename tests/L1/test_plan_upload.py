"""The p2p schedules' per-plan caches are made with the plan, not by the first layer.

The ring walks precomputed steps (``p2p._walk``) and, in a2a+p2p's backward, keeps only the
query rows its calls read (``p2p._narrow``). Their host part is planned by ``build_plan`` and
their index tensors are uploaded where the plan is first looked up, so the first layer's
forward and backward find every cache filled and add nothing: no numpy, no upload that a
later layer would not do. The staged schedule's stages and moves likewise.
"""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.schedules import p2p, staged
from megatron_cp_ext.testing.cases import p2p_schedule
from megatron_cp_ext.testing.pool import run_on_ranks


def _caches(ring: p2p.P2PPlan) -> dict:
    """Every device cache of the ring plan, by name: the walk and narrow entries, the calls
    uploaded per step, the gather indices uploaded per row selection."""
    out = {"walks": sorted(ring.walks), "own": sorted(ring.own._device_calls)}
    for st in ring.steps:
        out[f"calls{st.slot}"] = sorted(st.plan._device_calls)
        out[f"send{st.slot}"] = sorted(st.send._dev)
        out[f"recv{st.slot}"] = sorted(st.recv._dev)
    if ring.staged is not None:
        sp = ring.staged
        moves = [sp.own] + [p.recv_moves for p in sp.pieces.values() if p.recv_moves is not None]
        out["staged"] = [sorted(x._device_calls) for x in (sp.local, sp.joined)] + [
            sorted(m._dev) for m in moves if m.runs is None
        ]
    return out


def _first_layer_worker(rank, world, comm, schedule):
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    sharding = mcx.shard_sequences([0, 40, 43, 70, 96], world, balance="dualchunk")
    t = sharding.num_tokens(rank)
    q, k, v = (torch.randn(t, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    seen = {}
    module = staged if schedule == "staged" and comm == "p2p" else p2p
    forward = module.forward

    def spy(run, *args, **kw):  # the schedule starts: what has the plan's preparation filled?
        seen["at_forward"] = _caches(run.plan)
        seen["ring"] = run.plan
        return forward(run, *args, **kw)

    module.forward = spy
    try:
        with p2p_schedule(schedule):  # staged forced: this small batch is above its memory bound
            out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding)  # layer 1
        out.sum().backward()
    finally:
        module.forward = forward
    return seen["at_forward"], _caches(seen["ring"])


@pytest.mark.parametrize("world,comm,schedule", [(2, "p2p", "staged"), (2, "p2p", "ring"), (4, "a2a+p2p", "ring")])
def test_first_layer_adds_no_ring_cache(world, comm, schedule):
    for at_forward, after in run_on_ranks(world, _first_layer_worker, comm, schedule, timeout=120):
        staged = schedule == "staged" and comm == "p2p"
        assert ("cpu" in at_forward["walks"]) != staged and ("staged" in at_forward) == staged, at_forward
        if comm == "a2a+p2p":  # the ring's backward owns dout and out: its narrowing is prepared too
            assert "cpu#narrow" in at_forward["walks"], at_forward
        assert after == at_forward
