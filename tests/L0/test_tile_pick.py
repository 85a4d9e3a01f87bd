"""The exact tile step of ``balance="workload"``: per-rank tile areas counted without building
plans must be the ones the ``p2p`` plans visit, and the step may only shorten the largest
rank's tiles (the kernels' critical path), within the work bounds."""

import numpy as np
import pytest

import megatron_cp_ext as mcx
from megatron_cp_ext import balance_pick
from megatron_cp_ext.batches import cu_seqlens, lognormal
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.tile_pick import GOAL, GOAL_OF_ONE, rank_tiles

MASKS = {
    "causal": dict(causal=True),
    "window1k": dict(causal=True, window_size=(1024, -1)),
    "chunk2k": dict(causal=True, chunk_size=2048),
    "nomask": dict(causal=False),
}


def _planned_tiles(sh: mcx.CPSharding, kw: dict) -> np.ndarray:
    rep = mcx.inspect_plan(sh, "p2p", **kw)
    return np.array([rep.ranks[r].tile_area for r in range(sh.cp_size)])


@pytest.mark.parametrize("mask", MASKS)
def test_rank_tiles_are_the_planned_tiles(mask):
    """All three balances of a few batches, counted in one call: the count joins every rank of
    every candidate at once, so a leak between ranks or candidates would show."""
    kw = MASKS[mask]
    for lens, cp in (([1361, 261, 841, 3056, 342, 44], 4), (lognormal(9000, median=700, sigma=1.2, seed=3), 8),
                     ([5000], 3)):  # fmt: skip
        cu = cu_seqlens(lens)
        shs = [mcx.shard_sequences(cu, cp, b, **kw) for b in mcx.BALANCES]
        got = rank_tiles([[sh.rank_segments(r) for r in range(cp)] for sh in shs], MaskSpec.make(**kw))
        for sh, g in zip(shs, got, strict=True):
            assert np.array_equal(g, _planned_tiles(sh, kw)), (lens, cp, sh.balance)


@pytest.mark.parametrize(
    "total, cp, median, sigma, seed, window, meets",
    [(9261, 4, 2722, 1.08, 361895471, 4096, True), (8033, 4, 2141, 1.67, 537238232, 1024, False)],
)
def test_tile_step_shortens_the_critical_path(total, cp, median, sigma, seed, window, meets, monkeypatch):
    """Batches of 2K tokens per rank whose default pick misses the tile goal under a sliding
    window (where dual-chunk's own work is out of bounds): the step raises the efficiency (on
    the first to the goal) with a smaller largest-rank tile area and work within 3 %."""
    kw = dict(causal=True, window_size=(window, -1))
    cu = cu_seqlens(lognormal(total, median=median, sigma=sigma, seed=seed))
    new = mcx.shard_sequences(cu, cp, **kw)
    monkeypatch.setattr(balance_pick, "TILE_STEP", False)
    old = mcx.shard_sequences(cu, cp, **kw)
    dual = mcx.inspect_plan(mcx.shard_sequences(cu, cp, "dualchunk", **kw), "p2p", **kw)
    one = mcx.inspect_plan(mcx.shard_sequences(cu, 1, **kw), "p2p", **kw).tile_efficiency
    rep_new, rep_old = (mcx.inspect_plan(sh, "p2p", **kw) for sh in (new, old))
    assert dual.work_imbalance > balance_pick.WORK_BOUND
    assert min(rep_old.tile_efficiency / GOAL, rep_old.tile_efficiency / one / GOAL_OF_ONE) < 1
    assert rep_new.tile_efficiency > rep_old.tile_efficiency
    assert (max(rep_new.tile_efficiency / GOAL, rep_new.tile_efficiency / one / GOAL_OF_ONE) >= 1) == meets
    assert _planned_tiles(new, kw).max() < _planned_tiles(old, kw).max()
    assert rep_new.work_imbalance <= balance_pick.WORK_BOUND
    assert new.counts() == old.counts()
