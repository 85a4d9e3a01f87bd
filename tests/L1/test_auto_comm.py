"""comm_type="auto": exact against the dense fp64 reference, the same choice on every rank,
the fastest of its own predictions, which match timelines worked out by hand, and the plan it
dispatches is that comm type's."""

import dataclasses

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.planner import auto
from megatron_cp_ext.planner.profiles import HardwareProfile, load_profile
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
    # the choice is the fastest of the predictions it reports; where the winner follows by
    # hand (test_auto_follows_hand_timelines' reasons) it is that one
    assert res[0]["times"][best] == min(res[0]["times"].values())
    if prof == "launch-bound":
        assert best == "a2a"  # one kernel call per phase; the others make one per KV source at least
    if seqlens == SHORT:
        assert best == "p2p"  # whole documents on every rank: p2p moves nothing
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


def _hand_profile(*, launch_s: float, link_bytes_per_s: float, latency_s: float = 0.0) -> HardwareProfile:
    """A profile whose kernels cost only their launch (throughput 1e9 TFLOP/s: a call's FLOPs
    take under 1e-15 s), so a timeline is calls, bytes and latencies, countable by hand."""
    return HardwareProfile(
        name="hand", fwd_tflops=1e9, bwd_tflops=1e9, launch_us=launch_s * 1e6, latency_us=latency_s * 1e6,
        intra_gbps=link_bytes_per_s / 1e9, inter_gbps=link_bytes_per_s / 1e9, ranks_per_node=64, kernel="reference",
    )  # fmt: skip


def _choose(seqlens, balance, prof, backward):
    sharding = AttnCase(seqlens=seqlens, balance=balance).sharding(4)
    return auto.choose_comm_type(
        sharding, MaskSpec.make(causal=True), candidates=CANDIDATES[False], a2a_size=1, num_heads=4, num_kv_heads=2,
        head_dim=8, v_head_dim=8, dtype=torch.float64, profile=prof, backward=backward,
    )  # fmt: skip


def test_auto_follows_hand_timelines():
    """The predicted layer times and the choice, against timelines worked out by hand.

    Shapes: cp 4, causal, 4 query heads, 2 KV heads, d 8, fp64. One token's K and V are
    2 heads x 8 x 8 B x 2 = 256 B; one token's q (or out) on one head is 64 B.

    SHORT (16 documents of 16 tokens, workload): every rank holds 4 whole documents, 64
    tokens. p2p needs no other rank's KV: one call per phase, nothing sent. all_gather sends
    its 64 tokens' K|V to 3 peers (3 x 16,384 B); a2a sends each peer that peer's head share
    of q (one head), of K and V (2 KV heads over 4 members: one head each, replicated) and
    gets back its output share: 4 x 64 x 64 B = 16,384 B per peer, 49,152 B. Both pay 3
    latencies too, so p2p wins on any link.

    One 64-token document, dualchunk: rank r holds chunks r and 7 - r of 8 tokens. A peer's
    early chunk is visible to r's late chunk always, its late chunk only to a higher rank's
    late chunk, so rank r needs 16 of peer p's tokens (4,096 B) if r < p, else 8 (2,048 B).
    p2p: one call per ring step (4 per phase). Rank 0 gets 4,096 B at each of its 3 steps
    (peers 3, 2, 1). Each transfer is posted when the previous step's call starts and the
    next call waits for it. a2a moves the same 3 x 4,096 B per rank as above (16 tokens,
    one head each of q, K, V, out) and makes one call.
    """
    # SHORT, any link: p2p is its one call per phase, the others add 49,152 B and 3 latencies
    L, B, lat = 1e-3, 1e6, 1e-4
    for backward, calls in ((False, 1), (True, 2)):
        best, t = _choose(SHORT, "workload", _hand_profile(launch_s=L, link_bytes_per_s=B, latency_s=lat), backward)
        assert best == "p2p" and t["p2p"] == pytest.approx(calls * L, rel=1e-9), t
        for ct in ("all_gather", "a2a"):
            assert t[ct] >= calls * L + 49152 / B + 3 * lat, (ct, t)

    # one document, launch-bound (1 s a call, links free): p2p 4 calls, a2a 1 call
    L, B = 1.0, 1e15
    best, t = _choose((64,), "dualchunk", _hand_profile(launch_s=L, link_bytes_per_s=B), False)
    assert best == "a2a", t
    assert t["p2p"] == pytest.approx(4 * L, rel=1e-9) and t["a2a"] == pytest.approx(L + 12288 / B, rel=1e-9), t

    # one document, each 4,096 B transfer half a call long: rank 0's ring hides it (calls at
    # [0, 1], [1, 2], [2, 3], [3, 4] ms; transfers [0, .5], [1, 1.5], [2, 2.5] ms): p2p 4 ms;
    # a2a's 12,288 B are exposed before its call: 1.5 + 1 = 2.5 ms
    L, B = 1e-3, 4096 / 0.5e-3
    best, t = _choose((64,), "dualchunk", _hand_profile(launch_s=L, link_bytes_per_s=B), False)
    assert best == "a2a", t
    assert t["p2p"] == pytest.approx(4e-3, rel=1e-9) and t["a2a"] == pytest.approx(2.5e-3, rel=1e-9), t

    # transfers twice a call long: nothing hides; rank 0 waits 2 ms for each: 3 x 2 + 1 = 7 ms
    L, B = 1e-3, 4096 / 2e-3
    best, t = _choose((64,), "dualchunk", _hand_profile(launch_s=L, link_bytes_per_s=B), False)
    assert t["p2p"] == pytest.approx(7e-3, rel=1e-9) and t["a2a"] == pytest.approx(7e-3, rel=1e-9), t
    assert best == "p2p"  # a tie goes to the earlier candidate


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


def _mismatch_worker(rank, world, what):
    """``auto`` on every rank, its choice flipped on rank 1 by its profile or by q/k/v's dtype."""
    if what == "profile":
        auto.set_auto_profile(load_profile("cpu-gloo", **PROFILES[("launch-bound", "link-bound")[rank]]))
        sharding, dtype = AttnCase(seqlens=SEQLENS, balance="dualchunk").sharding(world), torch.float64
    else:  # on an H100's profile this batch's choice follows the element size
        auto.set_auto_profile("h100")
        sharding, dtype = mcx.shard_sequences([0, 2000, 2048], world), (torch.float32, torch.bfloat16)[rank]
    q, k, v = (torch.randn(sharding.num_tokens(rank), h, 8, dtype=dtype) for h in (4, 2, 2))
    try:
        mcx.cp_attention(q, k, v, cp_group=torch.distributed.group.WORLD, comm_type="auto", sharding=sharding)
    except mcx.CPRankMismatchError as err:
        return str(err)
    finally:
        auto.set_auto_profile(None)
    return "ran"


@pytest.mark.parametrize(
    "what, needles",
    [
        ("profile", ("comm_type='auto' chose differently", "'a2a' on CP ranks [0]", "set_auto_profile")),
        ("dtype", ("dtype differs", "torch.float32", "comm_type='auto' chose differently too")),
    ],
)
def test_auto_choices_that_differ_name_the_cause(what, needles):
    """Every rank passed ``comm_type="auto"``: a differing choice is not reported as a differing
    ``comm_type`` argument, but as the input that differs (dtype here) or, with equal inputs,
    auto's profile; the same message on every rank."""
    msgs = run_on_ranks(2, _mismatch_worker, what, timeout=120)
    assert len(set(msgs)) == 1, msgs
    assert all(n in msgs[0] for n in needles), msgs[0]
