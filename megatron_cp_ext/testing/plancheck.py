"""Brute-force checks of host plans (tests): expand every call into the (query, key) pairs a
flash varlen kernel computes, and simulate the p2p protocol between all ranks' plans.

Independent of the planner: it only uses the flash visibility rule of one entry
(:func:`megatron_cp_ext.masks.flash_visible`) and the mask definition itself.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..masks import MaskSpec, flash_visible
from ..plan import StepPlan
from ..sharding import CPSharding

__all__ = ["call_pairs", "token_ids", "check_p2p_plans", "expand"]


def expand(ranges: np.ndarray) -> list[int]:
    """Row ranges ``[m, 2]`` -> the rows, in order."""
    return [i for a, b in np.asarray(ranges).reshape(-1, 2).tolist() for i in range(a, b)]


def call_pairs(plan: StepPlan, q_ids: list, k_ids: list) -> Counter:
    """(query id, key id) pairs the calls of ``plan`` compute under flash semantics; asserts that
    no call repeats a query row and that every query row of an entry sees a key."""
    seen: Counter = Counter()
    for call in plan.calls:
        rows_of_call: set[int] = set()
        for q0, q1, k0, k1 in call.entries.tolist():
            sq, sk = q1 - q0, k1 - k0
            assert not rows_of_call & set(range(q0, q1)), "query rows repeat inside one call"
            rows_of_call |= set(range(q0, q1))
            for i in range(sq):
                row = [j for j in range(sk) if flash_visible(i, j, sq, sk, call.causal, call.window)]
                assert row, f"a query row of {call.window} entry {(q0, q1, k0, k1)} sees no key"
                seen.update((q_ids[q0 + i], k_ids[k0 + j]) for j in row)
    return seen


def token_ids(sharding: CPSharding, rank: int) -> list[tuple[int, int]]:
    """(sequence, position) of each local token of ``rank``."""
    return [(int(s), p) for s, a, b in sharding.rank_segments(rank).tolist() for p in range(a, b)]


def visible_pairs(sharding: CPSharding, mask: MaskSpec) -> set:
    """Every visible ((seq, q position), (seq, k position)) pair of the batch, by definition."""
    out = set()
    for s in sorted(set(range(sharding.num_seqs)) - sharding.muted):  # muted sequences attend nothing
        n = sharding.seq_len(s)
        out |= {((s, q), (s, k)) for q in range(n) for k in range(n) if mask.visible(q, k)}
    return out


def check_p2p_plans(sharding: CPSharding, plans: list, mask: MaskSpec) -> None:
    """All ranks' p2p plans: every visible pair computed exactly once; each step's send matches
    the peer's receive (same step, rows in order); exactly the needed rows travel."""
    n = sharding.cp_size
    ids = [token_ids(sharding, r) for r in range(n)]
    total: Counter = Counter()
    for r, plan in enumerate(plans):
        total += call_pairs(plan.own, ids[r], ids[r])
        for st in plan.steps:
            k_ids = [ids[st.src][i] for i in expand(st.recv.ranges)]
            pairs = call_pairs(st.plan, ids[r], k_ids)
            total += pairs
            # traffic = need: every row that arrives is looked at
            assert {k for _, k in pairs} == set(k_ids), "a received row is never looked at"
    want = visible_pairs(sharding, mask)
    assert set(total) == want, f"missing {sorted(want - set(total))[:4]}, extra {sorted(set(total) - want)[:4]}"
    assert set(total.values()) <= {1}, "a pair is computed twice"
    if any(p.staged is not None for p in plans):
        staged = sum((_staged_pairs(p, ids) for p in plans), Counter())
        assert set(staged) == want and set(staged.values()) <= {1}, "the staged plans' pairs differ"
        for r, plan in enumerate(plans):  # every message lands in one of the same size
            for st in plan.steps:
                if st.send.n:
                    mine, peer = plan.staged.pieces[st.slot], plans[st.dst].staged.pieces[st.slot]
                    assert mine.send_packed == peer.recv_packed, (r, st.slot)
                    assert [n for _, n in mine.send] == [n for _, n in peer.recv], (r, st.slot)
    for r, plan in enumerate(plans):
        for st in plan.steps:
            peer = {s.slot: s for s in plans[st.dst].steps}.get(st.slot)
            if st.send.n:
                assert peer is not None and np.array_equal(peer.recv.ranges, st.send.ranges), (r, st.slot)
            if st.recv.n:
                src = {s.slot: s for s in plans[st.src].steps}[st.slot]
                assert np.array_equal(src.send.ranges, st.recv.ranges), (r, st.slot)


def _staged_pairs(plan, ids: list) -> Counter:
    """Pairs of a staged plan's two stages (:mod:`..schedules.staged_plan`), its joined buffer's
    rows named through its moves: own rows, and every received row once, in step order. Each
    query row is in one stage; every joined row is looked at."""
    st, r = plan.staged, plan.rank
    received = [ids[s.src][i] for s in plan.steps for i in expand(s.recv.ranges)]
    assert len(received) == st.received and list(st.recv.src) == list(range(st.received))
    joined = [None] * st.rows
    for i, j in zip(st.own.src.tolist(), st.own.dst.tolist()):
        joined[j] = ids[r][i]
    for i, j in zip(st.recv.src.tolist(), st.recv.dst.tolist()):
        assert joined[j] is None, "a joined row is written twice"
        joined[j] = received[i]
    assert None not in joined, "a joined row is never written"
    local, far = call_pairs(st.local, ids[r], ids[r]), call_pairs(st.joined, ids[r], joined)
    assert not {q for q, _ in local} & {q for q, _ in far}, "a query row is in both stages"
    assert {k for _, k in far} == set(joined), "a joined row is never looked at"
    return local + far
