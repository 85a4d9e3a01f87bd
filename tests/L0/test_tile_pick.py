"""The exact tile step of ``balance="workload"``: per-rank tile areas counted without building
plans must be the ones the ``p2p`` plans visit, and the step may only shorten the largest
rank's tiles (the kernels' critical path), within the work bounds."""

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext import schedules
from megatron_cp_ext.balance import pick as balance_pick
from megatron_cp_ext.balance.tile_pick import GOAL, GOAL_OF_ONE, rank_paths, rank_tiles
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.sharding.batches import cu_seqlens, lognormal

MASKS = {
    "causal": dict(causal=True),
    "window1k": dict(causal=True, window_size=(1024, -1)),
    "chunk2k": dict(causal=True, chunk_size=2048),
    "nomask": dict(causal=False),
}


@pytest.fixture(autouse=True)
def _ring(monkeypatch):
    """The tile step counts the ring's calls (one per peer block): compared with ring plans."""
    monkeypatch.setattr(schedules, "P2P_SCHEDULE", "ring")


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


def _paths(shs: list[mcx.CPSharding], kw: dict):
    return rank_paths([[sh.rank_segments(r) for r in range(sh.cp_size)] for sh in shs], MaskSpec.make(**kw))


def test_rank_paths_are_the_planned_steps_and_rows():
    """Ring steps with calls, rows sent and received per rank: as the p2p plans have them."""
    cases = [([1361, 261, 841, 3056, 342, 44], 4, dict(causal=True, window_size=(300, -1))),
             ([20000], 8, dict(causal=True, chunk_size=1500)), ([9000, 40], 5, dict(causal=False))]  # fmt: skip
    for lens, cp, kw in cases:
        cu = cu_seqlens(lens)
        shs = [mcx.shard_sequences(cu, cp, b, **kw) for b in mcx.BALANCES]
        paths = _paths(shs, kw)
        for i, sh in enumerate(shs):
            rep = mcx.inspect_plan(sh, "p2p", num_heads=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, **kw)
            for r, rr in rep.ranks.items():
                assert paths.steps[i, r] == len({c.step for c in rr.calls}), (lens, sh.balance, r)
                assert paths.sent[i, r] * rep.kv_row_bytes == rr.bytes_sent["forward"], (lens, sh.balance, r)
                assert paths.received[i, r] * rep.kv_row_bytes == rr.bytes_received["forward"], (lens, sh.balance, r)


@pytest.mark.parametrize(
    "lens, cp, kw",
    [([48495], 64, dict(window_size=(2048, -1))), ([1 << 20], 64, dict(window_size=(4096, -1))),
     ([222593], 64, dict(window_size=(1024, -1))), ([56759], 32, dict(window_size=(3000, -1))),
     ([65536] * 4, 64, dict(window_size=(2048, -1))), ([20000] * 20, 32, dict(window_size=(1024, -1)))],
)  # fmt: skip
def test_reference_step_on_long_documents(lens, cp, kw, monkeypatch):
    """Long documents under a sliding window (above and below the search's size): the
    work-exact stream deals the window's first positions out to every rank as a small extra
    piece, a ring step per peer each; the reference step keeps a plain split there (one
    document: the contiguous one; several: the packed order), within the work goal, with a
    shorter largest rank and a step or two per rank."""
    kw = dict(causal=True, **kw)
    cu = cu_seqlens(lens)
    new = mcx.shard_sequences(cu, cp, **kw)
    monkeypatch.setattr(balance_pick, "PATH_STEP", False)
    old = mcx.shard_sequences(cu, cp, **kw)
    dual = mcx.inspect_plan(mcx.shard_sequences(cu, cp, "dualchunk", **kw), "p2p", **kw)
    paths = _paths([old, new], kw)
    assert paths.area[1].max() <= paths.area[0].max()
    assert paths.area[1].max() <= 0.95 * paths.area[0].max() or len(lens) > 1
    assert paths.steps[1].max() <= 4 < paths.steps[0].max()
    assert paths.sent[1].max() <= paths.sent[0].max() and paths.received[1].max() <= paths.received[0].max()
    work = mcx.inspect_plan(new, "p2p", **kw).work_imbalance
    assert work <= min(balance_pick.WORK_BOUND, dual.work_imbalance + balance_pick.WORK_SLACK) + 1e-12


def test_reference_step_never_lengthens_the_critical_path(monkeypatch):
    """Random batches of one to three long documents under windows and chunks: with the step
    the largest rank's tile area, ring steps and rows are never more than without it, and the
    work stays within the goal and dual-chunk's bound; on some of them it changes the pick."""
    rng = np.random.default_rng(3)  # also drawn so that dropping the steps and rows checks fails
    changed = 0
    for _ in range(12):
        total, cp, docs = int(2 ** rng.uniform(14, 18)), int(2 ** rng.integers(2, 7)), int(rng.integers(1, 4))
        cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False)).tolist()
        cu = [0, *cuts, total]
        kw = dict(
            causal=True,
            **rng.choice([dict(window_size=(1024, -1)), dict(window_size=(4096, -1)), dict(chunk_size=2048)]),
        )
        monkeypatch.setattr(balance_pick, "PATH_STEP", True)
        new = mcx.shard_sequences(cu, cp, **kw)
        monkeypatch.setattr(balance_pick, "PATH_STEP", False)
        old = mcx.shard_sequences(cu, cp, **kw)
        dual = mcx.inspect_plan(mcx.shard_sequences(cu, cp, "dualchunk", **kw), "p2p", **kw).work_imbalance
        paths = _paths([old, new], kw)
        for x in paths:
            assert x[1].max() <= x[0].max(), (cu, cp, kw)
        work = mcx.inspect_plan(new, "p2p", **kw).work_imbalance
        assert work <= min(balance_pick.WORK_BOUND, dual + balance_pick.WORK_SLACK) + 1e-12, (cu, cp, kw)
        changed += not all(np.array_equal(new.rank_segments(r), old.rank_segments(r)) for r in range(cp))
    assert changed >= 2


def test_in_order_split_is_the_packed_order():
    """The in-order reference: rank r holds exactly ``counts[r]`` tokens, the ones after rank
    r - 1's, documents of length 0 and 1 included."""
    from megatron_cp_ext.sharding import _in_order, rank_counts

    rng = np.random.default_rng(0)
    for _ in range(30):
        lens = rng.choice([0, 1, 2, 7, 130, 1000], size=int(rng.integers(1, 9)))
        cp, m = int(rng.integers(1, 9)), int(rng.choice([1, 2, 8]))
        counts = rank_counts(int(lens.sum()), cp, m)
        segs = _in_order(lens, counts)
        cu = np.concatenate([[0], np.cumsum(lens)])
        flat = [cu[q] + i for s in segs for q, a, b in s for i in range(a, b)]
        assert flat == list(range(int(lens.sum()))), (lens, cp, m)
        assert [int((s[:, 2] - s[:, 1]).sum()) for s in segs] == counts
