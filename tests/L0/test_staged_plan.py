"""The staged p2p schedule's host side (``schedules/staged_plan.py``): its memory bound is an
upper bound of the rows each rank receives, counted by brute force; its moves' runs. The
stages themselves are checked pair by pair in ``test_plans.py`` (``plancheck``)."""

import random

import numpy as np
import pytest

import megatron_cp_ext as mcx
from megatron_cp_ext import schedules
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.schedules import staged_plan
from megatron_cp_ext.schedules.staged_moves import Moves
from megatron_cp_ext.schedules.staged_plan import need_bound
from megatron_cp_ext.testing.cases import PLAN_MASKS
from megatron_cp_ext.testing.plancheck import token_ids


def _received(sh: mcx.CPSharding, mask: MaskSpec) -> list[int]:
    """Rows each rank receives, by definition: other ranks' tokens some local query sees."""
    ids = [token_ids(sh, r) for r in range(sh.cp_size)]
    out = []
    for r in range(sh.cp_size):
        mine = {}
        for s, p in ids[r]:
            mine.setdefault(s, []).append(p)
        seen = {
            (s, k) for j in range(sh.cp_size) if j != r for s, k in ids[j]
            if any(mask.visible(q, k) for q in mine.get(s, ()))
        }  # fmt: skip
        out.append(len(seen))
    return out


@pytest.mark.parametrize("mask_kw", PLAN_MASKS, ids=str)
def test_need_bound_is_an_upper_bound(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(7)
    for cp in (2, 3, 4):
        lens = [rng.choice([0, 1, 5, 13, 30, 41]) for _ in range(rng.randint(1, 4))]
        for b in mcx.BALANCES:
            sh = mcx.shard_sequences(np.cumsum([0, *lens]).tolist(), cp, b, **mask_kw)
            owner = np.repeat(np.arange(cp), np.diff(sh.rank_ptr))
            bound, tokens = need_bound(sh.seg, owner, np.asarray(lens, np.int64), cp, mask)
            exact = _received(sh, mask)
            assert all(x <= y for x, y in zip(exact, bound)), (lens, b, exact, bound)
            assert tokens.tolist() == [sh.num_tokens(r) for r in range(cp)]


def test_memory_bound_picks_the_ring_for_wide_needs(monkeypatch):
    """dualchunk at cp 8 sends every rank a part of every block: above the bound, the ring runs;
    a workload split of short documents stays within it and runs staged."""
    monkeypatch.setattr(schedules, "P2P_SCHEDULE", "staged")
    mask = MaskSpec.make(causal=True)
    wide = mcx.shard_sequences([0, 8192], 8, "dualchunk")
    assert schedules.build_plan(wide, "p2p", 3, 1, mask).staged is None
    short = mcx.shard_sequences(np.cumsum([0] + [700] * 16).tolist(), 8, "workload")
    assert schedules.build_plan(short, "p2p", 3, 1, mask).staged is not None
    monkeypatch.setattr(staged_plan, "MAX_BLOCKS", float("inf"))
    assert schedules.build_plan(wide, "p2p", 3, 1, mask).staged is not None


def test_moves_runs():
    m = Moves(np.array([0, 1, 2, 7, 8]), np.array([4, 5, 6, 0, 1]))
    assert m.runs == ((0, 4, 3), (7, 0, 2)) and not m.identity_src
    assert Moves(np.arange(3), np.array([2, 0, 1])).identity_src
    assert Moves(np.arange(20), np.arange(20)[::-1].copy()).runs is None  # 20 runs > MAX_RUNS


def test_identity_move_takes_the_leading_rows():
    """An identity-source move may leave the buffer's last rows out: it copies the leading ones."""
    import torch

    from megatron_cp_ext.schedules.staged import _move_into

    src = torch.arange(10.0)[:, None]
    dst = torch.zeros(12, 1)
    moves = Moves(np.arange(9), np.array([11, 9, 7, 5, 3, 1, 0, 2, 4]))  # 9 runs: by index
    assert moves.runs is None and moves.identity_src
    _move_into(dst, src, moves)
    want = torch.zeros(12, 1)
    want[moves.dst] = src[:9]
    assert torch.equal(dst, want)
