"""p2p traffic follows the mask: subset sends, skipped hops, and gradients that still get home.

Everything here is host-side: the plans of all ranks are built and the ring protocol is
simulated symbolically (rows tagged by owner), so a mismatch between what one rank sends and
what its peer expects, a computed pair that is not visible, or a dK/dV row that never gets
home fails here before any process group is involved.
"""

import random
from collections import Counter, defaultdict

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec, flash_visible
from megatron_cp_ext.plan import expand_rows
from megatron_cp_ext.schedules import p2p
from megatron_cp_ext.schedules.rowsets import Rows
from megatron_cp_ext.testing.cases import PLAN_MASKS
from megatron_cp_ext.testing.reference import visibility_matrix

MASKS = PLAN_MASKS


def _random_sharding(rng: random.Random, cp: int) -> mcx.CPSharding:
    """Sequences cut into random pieces on random ranks, in random local order."""
    cu, per_rank = [0], [[] for _ in range(cp)]
    for s in range(rng.randint(1, 4)):
        n = rng.choice([0, 1, 2, 5, 9, 14, 23, 31])
        cu.append(cu[-1] + n)
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(1, 6)))})
        for a, b in zip(cuts[:-1], cuts[1:]):
            per_rank[rng.randrange(cp)].append((s, a, b))
    for segs in per_rank:
        rng.shuffle(segs)
    return mcx.CPSharding.from_segments(cu, per_rank)


def _layouts(rng: random.Random, cp: int) -> list[mcx.CPSharding]:
    cu = [0]
    for _ in range(rng.randint(1, 4)):
        cu.append(cu[-1] + rng.choice([0, 1, 3, 7, 12, 19, 30]))
    return [
        mcx.shard_sequences(cu, cp, "dualchunk"),
        mcx.shard_sequences(cu, cp, "contiguous"),
        _random_sharding(rng, cp),
    ]


def _computed(plan, glob: list[list[int]], q_glob: list[int]) -> tuple[Counter, dict]:
    """Global (q, k) pairs a rank computes, and per (source, held buffer) the owner rows it
    contributes dK/dV to; every call is checked to be flash-expressible."""
    pairs, touched = Counter(), defaultdict(set)
    for src, held, step in plan.blocks():
        owner_rows = expand_rows(held)
        for call in step.calls:
            assert min(call.window) >= -1 and (not call.causal or call.window[1] in (0, -1)), call
            for qr, kr in zip(call.q_rows, call.k_rows):
                qrows, krows = expand_rows(qr), expand_rows(kr)
                for i, qrow in enumerate(qrows):
                    for j, krow in enumerate(krows):
                        if flash_visible(i, j, len(qrows), len(krows), call.causal, call.window):
                            pairs[(q_glob[qrow], glob[src][owner_rows[krow]])] += 1
                            touched[src].add(owner_rows[krow])
    return pairs, touched


def _check_protocol(plans: list[p2p.RingPlan]) -> None:
    """Every planned send matches its receive (same step, stream, peers, rows in order)."""
    n = len(plans)
    assert len({(p.num_steps, tuple((lane.direction, len(lane.hops)) for lane in p.lanes)) for p in plans}) == 1
    sent, recv = {}, {}
    for r, plan in enumerate(plans):
        for lane in plan.lanes:
            d = lane.direction
            for t in range(plan.num_steps):
                hop = lane.hops[t - 1] if 1 <= t <= len(lane.hops) else None
                nxt = lane.hops[t] if t < len(lane.hops) else None
                buf = [(r, x) for x in range(plan.counts[r])] if t == 0 else []
                if hop is not None:
                    buf = [(hop.source, x) for x in expand_rows(hop.held)]
                    assert hop.n == len(buf) and sorted(hop.forward.rows() + hop.home.rows()) == list(range(hop.n))
                    assert hop.n or hop.step.empty, "an empty hop computes"
                sel = lane.first if t == 0 else hop.forward if hop is not None else Rows(0)
                if sel.n:
                    sent[("kv", d, t, r, (r + d) % n)] = [buf[i] for i in sel.rows()]
                if nxt is not None and nxt.n:
                    recv[("kv", d, t, (r - d) % n, r)] = [(nxt.source, x) for x in expand_rows(nxt.held)]
                if hop is not None and hop.home.n:
                    sent[("home", d, t, r, (r - d * t) % n)] = [buf[i] for i in hop.home.rows()]
                if 1 <= t <= len(lane.home_in) and lane.home_in[t - 1].n:
                    recv[("home", d, t, (r + d * t) % n, r)] = [(r, x) for x in lane.home_in[t - 1].rows()]
    assert sent == recv


def _check_grads_get_home(plans, touched: list[dict]) -> None:
    """Simulate the backward: each dK/dV contribution reaches the owner exactly once."""
    n, home = len(plans), Counter()
    riding: dict = {}
    for t in range(1, plans[0].num_steps):
        for r, plan in enumerate(plans):
            for lane in plan.lanes:
                hop = lane.hops[t - 1] if t <= len(lane.hops) else None
                if hop is None or not hop.n:
                    assert (r, lane.direction, t) not in riding
                    continue
                buf = [(hop.source, x) for x in expand_rows(hop.held)]
                part = {row: [r] if row[1] in touched[r].get(hop.source, ()) else [] for row in buf}
                for row, who in riding.pop((r, lane.direction, t), {}).items():
                    part[row] += who
                if hop.forward.n:
                    nxt = ((r + lane.direction) % n, lane.direction, t + 1)
                    riding[nxt] = {buf[i]: part[buf[i]] for i in hop.forward.rows()}
                home.update((buf[i], w) for i in hop.home.rows() for w in part[buf[i]])
    assert not riding, "a partial rides past the end of its lane"
    want = Counter(((o, x), r) for r in range(n) for o, rows in touched[r].items() if o != r for x in rows)
    assert home == want


@pytest.mark.parametrize("mask_kw", MASKS, ids=str)
def test_subset_ring_exact_cover_protocol_and_gradients(mask_kw):
    rng = random.Random(MASKS.index(mask_kw))
    mask = MaskSpec.make(**mask_kw)
    for cp in (1, 2, 3, 4, 5, 2, 3, 4, 5, 6):
        for sh in _layouts(rng, cp):
            segs = list(sh.segments)
            plans = [p2p.build_plan(segs, segs, r, mask) for r in range(cp)]
            glob = [sh.global_index(r).tolist() for r in range(cp)]
            total, touched = Counter(), []
            for r, plan in enumerate(plans):
                pairs, t = _computed(plan, glob, glob[r])
                total += pairs
                touched.append(t)
            vis = visibility_matrix(sh.cu_seqlens, **mask_kw)
            want = {(int(i), int(j)) for i, j in zip(*torch.nonzero(vis, as_tuple=True))}
            assert set(total) == want and set(total.values()) <= {1}, (cp, sh.segments)
            _check_protocol(plans)
            _check_grads_get_home(plans, touched)


CU = [0, 1000, 1333, 3381, 3458, 3458]  # lengths 1000, 333, 2048, 77, 0
BPR = p2p.kv_row_bytes(8, 128, 128, torch.bfloat16)


def _traffic(balance: str, cp: int, **mask_kw) -> tuple[list[p2p.CommBytes], list[p2p.RingPlan]]:
    segs = list(mcx.shard_sequences(CU, cp, balance).segments)
    mask = MaskSpec.make(**mask_kw)
    plans = [p2p.build_plan(segs, segs, r, mask) for r in range(cp)]
    per_rank = p2p.ring_comm_bytes(segs, segs, mask, BPR)
    assert [p.comm_bytes(BPR) for p in plans] == per_rank  # one accounting, two entry points
    assert sum(c.sent for c in per_rank) == sum(c.received for c in per_rank)
    return per_rank, plans


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize(
    "mask_kw",
    [dict(causal=True, window_size=(16, -1)), dict(causal=True, window_size=(64, -1)),
     dict(causal=False, window_size=(32, 32)), dict(causal=False, window_size=(8, 0))],
    ids=["causal-16", "causal-64", "bidir-32", "left-only-8"],
)  # fmt: skip
def test_contiguous_window_sends_only_what_is_needed(cp, mask_kw):
    per_rank, plans = _traffic("contiguous", cp, **mask_kw)
    sent, needed = sum(c.sent for c in per_rank), sum(c.needed for c in per_rank)
    assert 0 < sent <= 1.1 * needed
    assert all(c.received <= 1.1 * c.needed for c in per_rank)
    dense, _ = _traffic("contiguous", cp, causal=mask_kw["causal"])
    assert sent <= 0.2 * sum(c.sent for c in dense)


def test_halo_rows_and_skipped_steps():
    """cp 4, causal window 16 on contiguous slices: each rank receives the last 16 keys of its
    predecessor's slice of every sequence longer than the slices, and nothing else."""
    per_rank, plans = _traffic("contiguous", 4, causal=True, window_size=(16, -1))
    lengths = [b - a for a, b in zip(CU[:-1], CU[1:])]
    for r, plan in enumerate(plans):
        (lane,) = plan.lanes
        (hop,) = lane.hops  # one step after the own block; the ring stops there
        halo = sum(min(16, n // 4) for n in lengths if n >= 4) if r else 0
        assert hop.n == hop.visible == halo and per_rank[r].received == halo * BPR


def test_dualchunk_causal_keeps_the_one_way_ring():
    """Full blocks for cp - 1 hops; only rank 0's late chunk (seen by no one else) stays home."""
    cp = 4
    per_rank, plans = _traffic("dualchunk", cp, causal=True)
    counts = plans[0].counts
    for r, plan in enumerate(plans):
        assert plan.num_steps == cp and [lane.direction for lane in plan.lanes] == [1]
        for t, hop in enumerate(plan.lanes[0].hops, 1):
            src = (r - t) % cp
            assert hop.source == src and (hop.n == counts[src] or src == 0)
            assert hop.forward.sl == (0, hop.n) or t == cp - 1  # relays forward the buffer itself
    early0 = sum(b - a for a, b in zip(CU[:-1], CU[1:]) for a, b in [(0, (b - a) // (2 * cp))])
    assert plans[1].lanes[0].hops[0].n == early0
    assert sum(c.sent for c in per_rank) == ((cp - 1) * (sum(counts) - counts[0]) + (cp - 1) * early0) * BPR
