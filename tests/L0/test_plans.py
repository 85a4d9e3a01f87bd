"""Host plans against brute force: every visible (q, k) pair computed exactly once and nothing
else, every call flash-expressible, p2p sends matching receives with exactly the needed rows,
and the shapes the GPU wants (slices, few calls) where the layout allows them."""

import pickle
import random
from collections import Counter

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext import schedules
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.plan import Layout, plan_steps
from megatron_cp_ext.schedules import a2a, all_gather, p2p, p2p_plan, staged_plan
from megatron_cp_ext.schedules.staged_plan import STAGE_SLICES, build_staged
from megatron_cp_ext.testing.cases import PLAN_MASKS
from megatron_cp_ext.testing.plancheck import call_pairs, check_p2p_plans, token_ids, visible_pairs


def _random_layout(rng: random.Random, lens: list[int], nbuf: int) -> Layout:
    """Sequences cut at random points, pieces on random buffers in random order and offsets."""
    per = [[] for _ in range(nbuf)]
    for s, n in enumerate(lens):
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(0, 4)))})
        for a, b in zip(cuts[:-1], cuts[1:]):
            per[rng.randrange(nbuf)].append((s, a, b))
    parts = []
    for b, p in enumerate(per):
        rng.shuffle(p)
        if p:
            parts.append(Layout.packed(*zip(*p), row0=rng.randint(0, 3), buf=b))
    return Layout.concat(parts)


def _ids(lay: Layout) -> dict:
    return {(int(bf), int(r) + i): (int(s), int(a) + i)
            for s, a, b, r, bf in zip(lay.seq, lay.start, lay.end, lay.row, lay.buf) for i in range(b - a)}  # fmt: skip


@pytest.mark.parametrize("mask_kw", PLAN_MASKS, ids=str)
def test_plan_steps_exact_cover_random_layouts(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(PLAN_MASKS.index(mask_kw))
    for _ in range(60):
        lens = [rng.choice([0, 1, 2, 5, 9, 14, 23, 31]) for _ in range(rng.randint(1, 4))]
        q, kv = _random_layout(rng, lens, 1), _random_layout(rng, lens, rng.randint(1, 3))
        qid, kid = _ids(q), _ids(kv)
        seen = Counter()
        for b, step in plan_steps(q, kv, mask).items():
            rows_q = max((r for bf, r in qid), default=-1) + 1
            rows_k = max((r for bf, r in kid if bf == b), default=-1) + 1
            seen += call_pairs(step, [qid.get((0, i)) for i in range(rows_q)],
                               [(b, kid.get((b, i))) for i in range(rows_k)])  # fmt: skip
        want = {(qt, (b, kt)) for (_, _), qt in qid.items() for (b, _), kt in kid.items()
                if qt[0] == kt[0] and mask.visible(qt[1], kt[1])}  # fmt: skip
        assert set(seen) == want and set(seen.values()) <= {1}


def _random_sharding(rng: random.Random, cp: int, lens: list[int]) -> mcx.CPSharding:
    per_rank = [[] for _ in range(cp)]
    for s, n in enumerate(lens):
        cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(1, 6)))})
        for a, b in zip(cuts[:-1], cuts[1:]):
            per_rank[rng.randrange(cp)].append((s, a, b))
    for segs in per_rank:
        rng.shuffle(segs)
    return mcx.CPSharding.from_segments([0, *np.cumsum(lens).tolist()], per_rank)


def _shardings(rng: random.Random, cp: int, mask_kw: dict) -> list[mcx.CPSharding]:
    lens = [rng.choice([0, 1, 3, 7, 12, 19, 30]) for _ in range(rng.randint(1, 4))]
    cu = [0, *np.cumsum(lens).tolist()]
    return [mcx.shard_sequences(cu, cp, b, **mask_kw) for b in mcx.BALANCES] + [_random_sharding(rng, cp, lens)]


@pytest.mark.parametrize("mask_kw", PLAN_MASKS, ids=str)
def test_p2p_plans_cover_match_and_move_only_needed_rows(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(10 + PLAN_MASKS.index(mask_kw))
    for cp in (1, 2, 3, 4, 5, 2, 3, 4):
        for sh in _shardings(rng, cp, mask_kw):
            segs = [sh.rank_segments(r) for r in range(cp)]
            check_p2p_plans(sh, [_with_stages(p2p.build_plan(segs, r, mask), segs, mask) for r in range(cp)], mask)


def _with_stages(plan: p2p.P2PPlan, segs, mask) -> p2p.P2PPlan:
    """The ring plan with the staged schedule's stages beside it (both are then checked)."""
    plan.staged = build_staged(plan, segs, mask)
    return plan


@pytest.mark.parametrize("mask_kw", [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(100, -1)),
                                     dict(causal=True, chunk_size=256)], ids=str)  # fmt: skip
def test_workload_cut_documents_exact_cover(mask_kw):
    """Long documents cut into tile-aligned pieces across ranks: still exact, traffic = need."""
    mask = MaskSpec.make(**mask_kw)
    for cp, lens in ((2, [420, 3, 0, 260]), (4, [520, 40, 1, 300, 64])):
        sh = mcx.shard_sequences([0, *np.cumsum(lens).tolist()], cp, "workload", **mask_kw)
        assert any(a > 0 or b < sh.seq_len(s) for s, a, b in sh.seg.tolist()), "expected a cut document"
        segs = [sh.rank_segments(r) for r in range(cp)]
        check_p2p_plans(sh, [_with_stages(p2p.build_plan(segs, r, mask), segs, mask) for r in range(cp)], mask)


@pytest.mark.parametrize("mask_kw", PLAN_MASKS[:4] + PLAN_MASKS[8:10], ids=str)
def test_all_gather_and_a2a_plans_exact_cover(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(20 + PLAN_MASKS.index(mask_kw))
    for cp in (1, 2, 4):
        for sh in _shardings(rng, cp, mask_kw):
            want = visible_pairs(sh, mask)
            ids = [token_ids(sh, r) for r in range(cp)]
            segs = [sh.rank_segments(r) for r in range(cp)]
            total = Counter()
            for r in range(cp):
                plan = all_gather.build_plan(segs, r, mask)
                kv_ids = [None] * (plan.pad * cp)
                for j in range(cp):
                    kv_ids[j * plan.pad : j * plan.pad + len(ids[j])] = ids[j]
                if plan.keep is not None:  # the calls address the kept rows, in document order
                    kept = [kv_ids[i] for i in plan.keep.tolist()]
                    assert kept == sorted(kept) and None not in kept
                    kv_ids = kept
                total += call_pairs(plan.step, ids[r], kv_ids)
            assert set(total) == want and set(total.values()) <= {1}
            # a2a: each group attends over its members' tokens in global order
            for a2a_size in {1, cp} if cp > 1 else ():
                union_of = [a2a.group_union(sh, range(g * a2a_size, (g + 1) * a2a_size)) for g in range(cp // a2a_size)]
                member_ids = [[t for m in range(g * a2a_size, (g + 1) * a2a_size) for t in ids[m]]
                              for g in range(cp // a2a_size)]  # fmt: skip
                for g, (union, perm, _) in enumerate(union_of):
                    in_order = [member_ids[g][i] for i in perm.tolist()]
                    assert in_order == sorted(member_ids[g])
                    assert in_order == [(s, p) for s, a, b in union.tolist() for p in range(a, b)]
                assert sum(len(u[1]) for u in union_of) == sh.total_tokens


def test_dense_masks_need_no_gathers_and_one_call_per_step(monkeypatch):
    """Workload layouts on a long-tail batch: dense-mask calls run on slices, at most two per ring
    step (a document cut at rank boundaries can be shared by non-consecutive ranks; its rows then
    sit in a second slice of the step), at most :data:`STAGE_SLICES` per stage of the staged
    schedule."""
    lens = mcx.batches.lognormal(1 << 16, seed=3)
    for mask_kw in (dict(causal=True), dict(causal=True, chunk_size=4096)):
        sh = mcx.shard_sequences(mcx.batches.cu_seqlens(lens), 8, **mask_kw)
        for schedule, most in (("ring", 2), ("staged", STAGE_SLICES)):
            monkeypatch.setattr(schedules, "P2P_SCHEDULE", schedule)
            rep = mcx.inspect_plan(sh, "p2p", **mask_kw)
            for r in rep.ranks.values():
                assert r.gathered_rows == 0, schedule
                steps = Counter(c.step for c in r.calls)
                assert max(steps.values()) <= most, (schedule, steps)


def test_length_one_documents_join_the_causal_call():
    """A length-1 document's entry is fully visible and causal at once: it joins the causal call
    of its step instead of making a call of its own that splits that call's rows into runs."""
    lens = [300, 1, 57, 1, 1, 500, 1, 200, 1, 2000, 1, 90]
    for mask_kw in (dict(causal=True), dict(causal=True, chunk_size=256)):
        sh = mcx.shard_sequences(mcx.batches.cu_seqlens(lens), 4, **mask_kw)
        rep = mcx.inspect_plan(sh, "p2p", **mask_kw, num_heads=2, num_kv_heads=2, head_dim=16)
        assert [r.gathered_rows for r in rep.ranks.values()] == [0] * 4
        own = [sum(c.step == 0 for c in r.calls) for r in rep.ranks.values()]
        assert max(own) <= 2, own


def test_plan_is_cached_on_sharding_and_uploaded_once():
    sh = mcx.shard_sequences([0, 9, 20], 1)
    q = torch.randn(20, 2, 4)
    mcx.cp_attention(q, q, q, cp_group=None, sharding=sh)
    assert len(sh._plans) == 1
    plan = next(iter(sh._plans.values()))
    first = plan.step.on(q.device)
    mcx.cp_attention(q, q, q, cp_group=None, sharding=sh)
    assert len(sh._plans) == 1 and plan.step.on(q.device) is first


def test_contiguous_rows_become_slices():
    sh = mcx.shard_sequences([0, 16], 1)
    plan = all_gather.build_plan([sh.rank_segments(0)], 0, MaskSpec.make(causal=True))
    (call,) = plan.step.calls
    assert call.q_slice == (0, 16) and call.q_index is None and call.k_slice == (0, 16)


def test_shardings_and_plans_pickle():
    cu = mcx.batches.cu_seqlens(mcx.batches.lognormal(20000, seed=1))
    for balance in mcx.BALANCES:
        sh = mcx.shard_sequences(cu, 4, balance)
        q = torch.randn(sh.num_tokens(0), 2, 8)
        plan = p2p.build_plan([sh.rank_segments(r) for r in range(4)], 0, MaskSpec.make(causal=True))
        plan.own.on(q.device)  # a device upload must not travel
        sh2, plan2 = pickle.loads(pickle.dumps((sh, plan)))
        assert np.array_equal(sh2.seg, sh.seg) and sh2.cu_seqlens == sh.cu_seqlens and not sh2._plans
        assert torch.equal(sh2.global_index(3), sh.global_index(3))
        assert [s.slot for s in plan2.steps] == [s.slot for s in plan.steps] and not plan2.own._device_calls
        for c1, c2 in zip(plan.own.calls, plan2.own.calls):
            assert np.array_equal(c1.entries, c2.entries) and torch.equal(c1.cu_seqlens_q, c2.cu_seqlens_q)


@pytest.mark.parametrize("kw, match", [
    (dict(causal=True, window_size=(-2, -1)), "window_size"),
    (dict(causal=True, window_size=(1, 2, 3)), "window_size"),
    (dict(causal=True, chunk_size=0), "chunk_size"),
    (dict(causal=True, chunk_size=2**63), "chunk_size"),  # the cross-rank exchange carries int64
    (dict(causal=True, window_size=(2**63, 0)), "window_size"),
    (dict(causal=False, window_size=(0, 2**64)), "window_size"),
    (dict(causal="yes"), "causal"),
])  # fmt: skip
def test_mask_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec.make(**kw)


@pytest.mark.parametrize("mask_kw", PLAN_MASKS, ids=str)
def test_split_forward_calls_cover_the_same_pairs(mask_kw, monkeypatch):
    """a2a+p2p's forward halves its ring calls over most local queries (``split_wide``): the
    halves compute exactly the (query, key) pairs of the call they replace, for every mask,
    whether cut between entries or inside one (tile 4 here, so small batches cut too)."""
    monkeypatch.setattr(p2p_plan, "SPLIT_TILE", 4)
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(40 + PLAN_MASKS.index(mask_kw))
    split = inner = 0
    for _ in range(12):
        lens = [rng.choice([0, 1, 7, 19, 40, 90]) for _ in range(rng.randint(1, 5))]
        for sh in _shardings_of(rng, rng.choice([2, 3, 4]), lens, mask_kw):
            segs = [sh.rank_segments(r) for r in range(sh.cp_size)]
            for r in range(sh.cp_size):
                plan = p2p.build_plan(segs, r, mask)
                p2p_plan.split_wide(plan)
                q_ids = list(range(plan.counts[r]))
                for st in plan.steps:
                    if st.fwd is None:
                        continue
                    k_ids = list(range(st.recv.n))
                    assert call_pairs(st.fwd, q_ids, k_ids) == call_pairs(st.plan, q_ids, k_ids)
                    split += 1
                    rows = lambda p: sorted(int(a) for c in p.calls for a in c.entries[:, 0])  # noqa: E731
                    inner += rows(st.fwd) != rows(st.plan)
    wide = mask_kw in (dict(causal=True), dict(causal=False), dict(causal=False, window_size=(40, 40)))
    assert split > 0 or not wide  # narrow windows and chunks leave no call over most queries here
    assert inner > 0 or not mask_kw.keys() == {"causal"}  # a cut inside an entry was exercised


def _shardings_of(rng: random.Random, cp: int, lens: list[int], mask_kw: dict) -> list[mcx.CPSharding]:
    cu = [0, *np.cumsum(lens).tolist()]
    return [mcx.shard_sequences(cu, cp, b, **mask_kw) for b in mcx.BALANCES] + [_random_sharding(rng, cp, lens)]


@pytest.mark.parametrize("mask_kw", PLAN_MASKS[:4] + PLAN_MASKS[8:10], ids=str)
def test_a2a_p2p_staged_ring_exact_cover(mask_kw, monkeypatch):
    """a2a+p2p's ring across the a2a groups, staged (forced past its memory bound): the plans
    each group's members share are checked as p2p plans over the groups' token sets, pair by
    pair, with every staged message landing in one of the same size."""
    monkeypatch.setattr(staged_plan, "MAX_BLOCKS", float("inf"))
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(30 + PLAN_MASKS.index(mask_kw))
    for cp, size in ((4, 2), (8, 2), (8, 4)):
        for sh in _shardings(rng, cp, mask_kw):
            groups = cp // size
            unions = [a2a.group_union(sh, range(g * size, (g + 1) * size))[0] for g in range(groups)]
            as_ranks = mcx.CPSharding.from_segments(sh.cu_seqlens, [[tuple(s) for s in u.tolist()] for u in unions])
            plans = [a2a.build_plan(sh, size, g * size, mask, "staged").ring for g in range(groups)]
            assert all(p.staged is not None for p in plans if len(p.counts) > 1)
            check_p2p_plans(as_ranks, plans, mask)


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),  # reported 4 of 6 heads' work
        (dict(num_heads=4, num_kv_heads=8), "multiple of num_kv_heads"),  # reported no heads at all
        (dict(v_head_dim=-200), "v_head_dim"),  # negative bytes
        (dict(ranks=[]), "at least one rank"),  # a bare max() error
    ],
)
def test_inspect_plan_refuses_what_cp_attention_cannot_run(kw, names):
    with pytest.raises(ValueError, match=names):
        mcx.inspect_plan(mcx.shard_sequences([0, 10, 20], 2), "a2a", **kw)


def test_inspect_plan_takes_integer_types_as_the_rest_of_the_api():
    """``a2a_size`` and head counts as any integer (NumPy's too), never a bool; ``dtype`` a
    floating dtype."""
    inspect_plan = mcx.inspect_plan
    sh = mcx.shard_sequences([0, 100, 300], 4)
    heads = dict(num_heads=8, num_kv_heads=2, head_dim=16)
    numpy_size = inspect_plan(sh, "a2a+p2p", a2a_size=np.int64(2), **{**heads, "num_heads": np.int64(8)})
    plain = inspect_plan(sh, "a2a+p2p", a2a_size=2, **heads)
    assert [(r.work, len(r.calls)) for r in numpy_size.ranks.values()] == [
        (r.work, len(r.calls)) for r in plain.ranks.values()
    ]
    bad = [(dict(a2a_size=True), "a2a_size"), (dict(a2a_size=3), "a2a_size"),
           (dict(a2a_size=2, dtype=torch.int32), "dtype"), (dict(a2a_size=2, head_dim=16.0), "head_dim")]  # fmt: skip
    for kw, name in bad:
        with pytest.raises((ValueError, TypeError), match=name):
            inspect_plan(sh, "a2a+p2p", **{**heads, **kw})
