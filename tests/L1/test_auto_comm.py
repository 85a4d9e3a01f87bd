"""comm_type="auto": exact against the dense fp64 reference, the same choice on every rank,
the one the host-side cost model predicts, and the plan it dispatches is that comm type's."""

import dataclasses

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner import auto
from megatron_cp_ext.planner.profiles import load_profile
from megatron_cp_ext.testing.cases import AttnCase, check_case, local_shard
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (40, 3, 0, 17, 64, 9)
SHORT = (16,) * 16  # whole documents per rank under workload balance: p2p moves nothing
# cpu-gloo; and one where launches dominate (fewest calls wins); one with a slow link
PROFILES = {
    "cpu-gloo": {},
    "launch-bound": dict(launch_us=1e5, latency_us=0.0),
    "link-bound": dict(intra_gbps=1e-6, inter_gbps=1e-6),
}
CANDIDATES = {False: ("p2p", "all_gather", "a2a"), True: ("a2a+p2p", "p2p", "all_gather", "a2a")}


def _worker(rank, world, case, prof, hier):
    auto.set_auto_profile(load_profile("cpu-gloo", **PROFILES[prof]))
    sharding = case.sharding(world)
    q, k, v, dout = (local_shard(case, world, rank, x, sharding).double() for x in case.inputs())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    group = mcx.hierarchical_cp_groups(2) if hier else torch.distributed.group.WORLD
    out = mcx.cp_attention(q, k, v, cp_group=group, comm_type="auto", sharding=sharding, causal=case.causal)
    out.backward(dout)
    best, times = auto.LAST[0]
    built = [key[0] for key in sharding._plans if key[0] in mcx.COMM_TYPES]
    auto.set_auto_profile(None)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "best": best, "times": times, "built": built}


BATCHES = [(SEQLENS, "dualchunk", p) for p in PROFILES] + [(SHORT, "workload", "link-bound")]


@pytest.mark.parametrize("hier", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"{len(b[0])}docs-{b[1]}-{b[2]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_auto_exact_and_agreed(causal, batch, hier):
    world = 4
    seqlens, balance, prof = batch
    case = AttnCase(seqlens=seqlens, comm_type="auto", causal=causal, hq=4, hkv=2, dtype="float64", balance=balance)
    res = run_on_ranks(world, _worker, case, prof, hier)
    choices = {r["best"] for r in res}
    assert len(choices) == 1, f"ranks chose differently: {[r['best'] for r in res]}"
    best = choices.pop()
    assert all(r["built"] == [best] for r in res), [r["built"] for r in res]
    assert all(r["times"] == res[0]["times"] for r in res)
    assert tuple(res[0]["times"]) == CANDIDATES[hier]
    # the driver recomputes the choice on the host: a pure function of the sharding and shapes
    profile = load_profile("cpu-gloo", **PROFILES[prof])
    want, _ = auto.choose_comm_type(
        case.sharding(world), MaskSpec.make(causal=causal), candidates=CANDIDATES[hier], a2a_size=2 if hier else 1,
        num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype=torch.float64, profile=profile,
    )  # fmt: skip
    assert best == want
    check_case([{n: r[n] for n in ("out", "dq", "dk", "dv")} for r in res], dataclasses.replace(case, comm_type="p2p"))


def test_auto_choice_depends_on_profile():
    """Launches and compute favour a2a's one call on its head share here; a slow link makes p2p
    win, on the cut documents too (a2a's backward moves its replicated KV heads to heads again
    and sends their dK/dV home in fp64): the choice follows the model, it is not fixed."""
    picks = {}
    for (seqlens, balance, prof), want in zip(BATCHES, ("a2a", "a2a", "p2p", "p2p"), strict=True):
        sharding = AttnCase(seqlens=seqlens, balance=balance).sharding(4)
        best, times = auto.choose_comm_type(
            sharding, MaskSpec.make(causal=True), candidates=CANDIDATES[False], a2a_size=1, num_heads=4,
            num_kv_heads=2, head_dim=8, v_head_dim=8, dtype=torch.float64,
            profile=load_profile("cpu-gloo", **PROFILES[prof]),
        )  # fmt: skip
        assert times[best] == min(times.values())
        picks[(len(seqlens), prof)] = (best, want)
    assert all(b == w for b, w in picks.values()), picks


def _megatron_worker(rank, world, hcp):
    from test_megatron_layer import layer_case

    auto.LAST[0] = None
    errs = layer_case(rank, world, "thd-long", "auto", None, hcp)
    return errs, tuple(auto.LAST[0][1])


@pytest.mark.parametrize("hcp", [None, (2, 2)], ids=["flat", "hierarchical"])
def test_megatron_layer_auto_matches_cp1(hcp):
    """--cp-comm-type auto through the Megatron layer (thd, cut documents) == the CP-1 layer;
    a2a+p2p is a candidate exactly when hierarchical CP groups are configured."""
    pytest.importorskip("megatron.core")
    res = run_on_ranks(4, _megatron_worker, hcp)
    for rank, (per_rank, candidates) in enumerate(res):
        assert candidates == CANDIDATES[hcp is not None], candidates
        bad = {k: v for k, v in per_rank.items() if v > 2e-5}
        assert not bad, f"rank {rank}: auto differs from CP1: {bad}"
