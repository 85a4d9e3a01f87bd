"""Mask decomposition and host plans: every visible (q, k) pair computed exactly once,
nothing invisible computed, every call expressible by a flash varlen kernel."""

import itertools
import random
from collections import Counter

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.masks import MaskSpec, flash_visible, visible_blocks
from megatron_cp_ext.plan import expand_rows, layout_of
from megatron_cp_ext.schedules import all_gather, p2p
from megatron_cp_ext.testing.cases import PLAN_MASKS
from megatron_cp_ext.testing.reference import visibility_matrix

MASKS = PLAN_MASKS


@pytest.mark.parametrize("mask_kw", MASKS)
def test_visible_blocks_exact(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(0)
    for _ in range(300):
        qs, ks = rng.randint(0, 15), rng.randint(0, 15)
        qe, ke = qs + rng.randint(0, 12), ks + rng.randint(0, 12)
        seen = Counter()
        for b in visible_blocks(mask, qs, qe, ks, ke):
            sq, sk = b.qe - b.qs, b.ke - b.ks
            assert min(b.window) >= -1 and (not b.causal or b.window[1] == 0)
            for i in range(sq):
                row = [j for j in range(sk) if flash_visible(i, j, sq, sk, b.causal, b.window)]
                assert row, f"block {b} has a query row with no visible key"
                seen.update((b.qs + i, b.ks + j) for j in row)
        want = {(q, k) for q in range(qs, qe) for k in range(ks, ke) if mask.visible(q, k)}
        assert set(seen) == want and set(seen.values()) <= {1}


def _pairs_of_step(step, q_glob: list[int], kv_glob: list[int]) -> Counter:
    """Global (q token, k token) pairs a step's calls compute, under flash semantics."""
    seen = Counter()
    for call in step.calls:
        q_rows_all = set()
        for qr, kr in zip(call.q_rows, call.k_rows):
            qrows, krows = expand_rows(qr), expand_rows(kr)
            assert not (q_rows_all & set(qrows)), "query rows repeat inside one call"
            q_rows_all |= set(qrows)
            for i, qrow in enumerate(qrows):
                for j, krow in enumerate(krows):
                    if flash_visible(i, j, len(qrows), len(krows), call.causal, call.window):
                        seen[(q_glob[qrow], kv_glob[krow])] += 1
    return seen


def _check_plan_covers(sh, mask_kw, schedule):
    mask = MaskSpec.make(**mask_kw)
    vis = visibility_matrix(sh.cu_seqlens, **mask_kw)
    glob = [sh.global_index(r).tolist() for r in range(sh.cp_size)]
    total = Counter()
    for r in range(sh.cp_size):
        plan = schedule.build_plan(list(sh.segments), list(sh.segments), r, mask)
        if schedule is p2p:  # compact ring buffers: map their rows back through the owner's rows
            for src, held, step in plan.blocks():
                total += _pairs_of_step(step, glob[r], [glob[src][i] for i in expand_rows(held)])
        else:
            kv_glob = [-1] * (plan.pad * sh.cp_size)
            for j in range(sh.cp_size):
                kv_glob[j * plan.pad : j * plan.pad + len(glob[j])] = glob[j]
            total += _pairs_of_step(plan.step, glob[r], kv_glob)
    want = {(i, j) for i, j in zip(*torch.nonzero(vis, as_tuple=True)) for i, j in [(int(i), int(j))]}
    assert set(total) == want, f"missing {sorted(want - set(total))[:5]} extra {sorted(set(total) - want)[:5]}"
    assert set(total.values()) <= {1}, "a pair is computed twice"


@pytest.mark.parametrize("schedule", [p2p, all_gather], ids=["p2p", "all_gather"])
@pytest.mark.parametrize("mask_kw", MASKS)
@pytest.mark.parametrize("balance", ["dualchunk", "contiguous"])
def test_plan_exact_cover(schedule, mask_kw, balance):
    rng = random.Random(1)
    for cp in (1, 2, 3, 4):
        cu = [0]
        for _ in range(rng.randint(1, 4)):
            cu.append(cu[-1] + rng.choice([0, 1, 2, 5, 11, 17]))
        _check_plan_covers(mcx.shard_sequences(cu, cp, balance), mask_kw, schedule)


def test_plan_exact_cover_whole_sequences_per_rank():
    sh = mcx.CPSharding.from_segments([0, 6, 7, 19, 19], [[(0, 0, 6), (3, 0, 0)], [(1, 0, 1), (2, 0, 12)]])
    for mask_kw in MASKS[:3]:
        for schedule in (p2p, all_gather):
            _check_plan_covers(sh, mask_kw, schedule)


def test_causal_ring_skips_masked_work():
    """Dual-chunk causal: only step 0 (own KV) has causal (diagonal) calls; every later step
    computes exactly half of the possible (q, k) block area, as full (unmasked) calls."""
    cp = 4
    sh = mcx.shard_sequences([0, 64], cp)
    mask = MaskSpec.make(causal=True)
    for r in range(cp):
        plan = p2p.build_plan(list(sh.segments), list(sh.segments), r, mask)
        assert plan.num_steps == cp and [lane.direction for lane in plan.lanes] == [1]  # the one-way ring
        assert any(c.causal for c in plan.own.calls)
        for t in range(1, cp):
            calls = plan.lanes[0].hops[t - 1].step.calls
            assert calls and not any(c.causal for c in calls)
            area = sum(len(expand_rows(qr)) * len(expand_rows(kr)) for c in calls for qr, kr in zip(c.q_rows, c.k_rows))
            assert area == 16 * 16 // 2  # 16 local tokens against 16 remote: half visible


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
    plan = all_gather.build_plan(list(sh.segments), list(sh.segments), 0, MaskSpec.make(causal=True))
    (call,) = plan.step.calls
    assert call.q_slice == (0, 16) and call.q_index is None and call.k_slice == (0, 16)


@pytest.mark.parametrize("kw, match", [
    (dict(causal=True, window_size=(-2, -1)), "window_size"),
    (dict(causal=True, window_size=(1, 2, 3)), "window_size"),
    (dict(causal=True, chunk_size=0), "chunk_size"),
    (dict(causal="yes"), "causal"),
])  # fmt: skip
def test_mask_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        MaskSpec.make(**kw)


def test_layout_rows():
    lay = layout_of([mcx.Segment(0, 0, 3), mcx.Segment(1, 2, 4)], row0=5)
    assert [(p.row, p.end - p.start) for p in lay] == [(5, 3), (8, 2)]
    assert list(itertools.chain(*[range(p.row, p.row + p.end - p.start) for p in lay])) == [5, 6, 7, 8, 9]
