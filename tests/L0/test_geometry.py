"""Mask geometry against brute force: one flash entry per range pair, visible-pair counts,
chunk units and tile areas."""

import itertools
import random

import numpy as np
import pytest

from megatron_cp_ext.masks import MaskSpec, flash_visible, visible_blocks
from megatron_cp_ext.masks.geometry import BIG, TILE, band_blocks, band_count, bounds, chunk_units, tile_area
from megatron_cp_ext.testing.cases import PLAN_MASKS


@pytest.mark.parametrize("mask_kw", PLAN_MASKS, ids=str)
def test_visible_blocks_exact(mask_kw):
    """Scalar spec: the blocks cover the visible pairs of a range pair exactly once, each a
    flash-expressible entry in which every query sees a key."""
    mask = MaskSpec.make(**mask_kw)
    rng = random.Random(0)
    for _ in range(300):
        qs, ks = rng.randint(0, 15), rng.randint(0, 15)
        qe, ke = qs + rng.randint(0, 12), ks + rng.randint(0, 12)
        seen = []
        for b in visible_blocks(mask, qs, qe, ks, ke):
            sq, sk = b.qe - b.qs, b.ke - b.ks
            assert min(b.window) >= -1 and b.causal == (b.window[1] == 0)
            for i in range(sq):
                row = [j for j in range(sk) if flash_visible(i, j, sq, sk, b.causal, b.window)]
                assert row, f"block {b} has a query row with no visible key"
                seen += [(b.qs + i, b.ks + j) for j in row]
        want = {(q, k) for q in range(qs, qe) for k in range(ks, ke) if mask.visible(q, k)}
        assert set(seen) == want and len(seen) == len(want)


@pytest.mark.parametrize("mask_kw", [m for m in PLAN_MASKS if m.get("chunk_size") is None], ids=str)
def test_band_blocks_match_the_scalar_spec(mask_kw):
    mask = MaskSpec.make(**mask_kw)
    lo, up = bounds(mask)
    rng = random.Random(1)
    pairs = [(qs, qs + rng.randint(0, 12), ks, ks + rng.randint(0, 12)) for qs, ks in
             ((rng.randint(0, 15), rng.randint(0, 15)) for _ in range(400))]  # fmt: skip
    p, a, b, k0, k1, causal, left, right = band_blocks(*np.array(pairs).T, lo, up)
    got = sorted(zip(p.tolist(), a.tolist(), b.tolist(), k0.tolist(), k1.tolist(), causal.tolist(),
                     zip(left.tolist(), right.tolist())))  # fmt: skip
    want = sorted((i, *blk[:5], blk.window) for i, pr in enumerate(pairs) for blk in visible_blocks(mask, *pr))
    assert got == want


def test_band_count_brute_force():
    rng = random.Random(2)
    for _ in range(3000):
        nq, nk, shift = rng.randint(0, 20), rng.randint(0, 20), rng.randint(-25, 25)
        lo, up = rng.choice([0, 1, 3, 7, BIG]), rng.choice([0, 1, 4, BIG])
        want = sum(1 for i in range(nq) for j in range(nk) if i + shift - lo <= j <= i + shift + up)
        assert int(band_count(nq, nk, shift, lo, up)) == want


def test_chunk_units_cut_at_boundaries():
    src, unit, s, e = chunk_units([0, 1, 2], [0, 3, 5], [10, 17, 5], 4)
    assert list(zip(src.tolist(), s.tolist(), e.tolist())) == [
        (0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 3, 4), (1, 4, 8), (1, 8, 12), (1, 12, 16), (1, 16, 17), (2, 5, 5),
    ]  # fmt: skip
    assert len(set(unit[:3].tolist())) == 3 and unit[3] != unit[0]  # (sequence, chunk) units
    src, unit, s, e = chunk_units([3], [2], [9], None)
    assert (src.tolist(), unit.tolist(), s.tolist(), e.tolist()) == ([0], [3], [2], [9])


TILE_CASES = [(300, 300, -1, 0), (5, 5, -1, 0), (128, 384, -1, -1), (200, 260, 64, 0), (257, 300, 100, -1),
              (130, 500, 7, 200)]  # fmt: skip


@pytest.mark.parametrize("nq, nk, left, right", TILE_CASES)
def test_tile_area_brute_force(nq, nk, left, right):
    visited = set()
    for i, j in itertools.product(range(nq), range(nk)):
        if flash_visible(i, j, nq, nk, right == 0, (left, right)):
            visited.add((i // TILE, j // TILE))
    assert int(tile_area([nq], [nk], [left], [right])[0]) == len(visited) * TILE * TILE
    useful = sum(flash_visible(i, j, nq, nk, right == 0, (left, right)) for i in range(nq) for j in range(nk))
    assert int(band_count(nq, nk, nk - nq, BIG if left < 0 else left, BIG if right < 0 else right)) == useful
