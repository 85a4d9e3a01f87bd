"""``balance="workload"``: a partition, tile-aligned, balanced in work and tokens, deterministic;
and ``inspect_plan`` against brute-force counts."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.balance.pick import WORK_BOUND, WORK_SLACK
from megatron_cp_ext.masks import MaskSpec
from megatron_cp_ext.masks.geometry import TILE
from megatron_cp_ext.sharding.batches import cu_seqlens, lognormal, long_short
from megatron_cp_ext.testing.reference import visibility_matrix

MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(2048, -1)),
    "chunk": dict(causal=True, chunk_size=4096),
    "nomask": dict(causal=False),
}
BATCHES = {
    "lognormal-256K": lambda: lognormal(1 << 18, seed=5),
    "long+short": lambda: long_short(1 << 17, long=1 << 16, count=157, seed=2),
}


def _work(sh: mcx.CPSharding, **mask_kw) -> np.ndarray:
    rep = mcx.inspect_plan(sh, "p2p", **mask_kw)
    return np.array([rep.ranks[r].work for r in range(sh.cp_size)], dtype=float)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("cp", [8, 16])
@pytest.mark.parametrize("mask", MASKS)
def test_partition_alignment_tokens_and_work(batch, cp, mask):
    lens = BATCHES[batch]()
    cu = cu_seqlens(lens)
    sh = mcx.shard_sequences(cu, cp, "workload", **MASKS[mask])
    # every token exactly once
    idx = torch.cat([sh.global_index(r) for r in range(cp)])
    assert torch.equal(idx.sort().values, torch.arange(cu[-1]))
    # equal tokens; a cut off a tile multiple (and not at a sequence's end) only where a rank
    # boundary needs it: at most two per rank boundary
    assert max(sh.counts()) - min(sh.counts()) <= 1
    ragged = {(s, x) for s, a, b in sh.seg.tolist() for x in (a, b) if x % TILE and x != lens[s]}
    assert len(ragged) <= 2 * (cp - 1), sorted(ragged)
    work = _work(sh, **MASKS[mask])
    dual = _work(mcx.shard_sequences(cu, cp, "dualchunk", **MASKS[mask]), **MASKS[mask])
    imbalance, dual_imbalance = work.max() / work.mean(), dual.max() / dual.mean()
    # (dual-chunk is exact for causal work at the price of 2*cp slivers per document: there the
    # bound is the 3% goal; on windows and chunks dual-chunk is 1.1-1.2 and workload must beat it)
    assert imbalance <= max(dual_imbalance, 1.03), (imbalance, dual_imbalance)


def test_short_documents_stay_whole_and_long_ones_are_cut():
    lens = [70000, *([300] * 200)]
    sh = mcx.shard_sequences(cu_seqlens(lens), 8)
    pieces = {}
    for s, a, b in sh.seg.tolist():
        pieces.setdefault(s, []).append((a, b))
    cut_short = [s for s, p in pieces.items() if s > 0 and len(p) > 1]
    assert len(cut_short) <= 2 * 7, "short documents are cut only at rank boundaries"
    assert len(pieces[0]) >= 8, "the long document should be spread over the ranks"
    assert sh.rank_segments(0).shape[0] > 0


def test_same_result_in_separate_processes():
    code = (
        "import hashlib, megatron_cp_ext as mcx;"
        "from megatron_cp_ext.sharding.batches import lognormal, cu_seqlens;"
        "sh = mcx.shard_sequences(cu_seqlens(lognormal(1 << 18, seed=7)), 16, causal=True, window_size=(1000, -1));"
        "print(hashlib.sha256(sh.seg.tobytes() + sh.rank_ptr.tobytes()).hexdigest())"
    )
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}  # fmt: skip
    sh = mcx.shard_sequences(cu_seqlens(lognormal(1 << 18, seed=7)), 16, causal=True, window_size=(1000, -1))
    import hashlib

    assert outs == {hashlib.sha256(sh.seg.tobytes() + sh.rank_ptr.tobytes()).hexdigest() + "\n"}


def test_cp1_and_tiny_batches():
    for cu in ([0], [0, 0], [0, 1], [0, 5, 5, 6]):
        for cp in (1, 2, 4):
            sh = mcx.shard_sequences(cu, cp)
            assert sum(sh.counts()) == cu[-1]


# ---- inspect_plan against brute force ---------------------------------------------------------
def _brute(sh: mcx.CPSharding, mask_kw: dict):
    """Per rank: visible pairs of its queries, and rows of other ranks' KV they see."""
    vis = visibility_matrix(sh.cu_seqlens, **mask_kw)
    owner = torch.empty(sh.total_tokens, dtype=torch.long)
    for r in range(sh.cp_size):
        owner[sh.global_index(r)] = r
    work, need = [], []
    for r in range(sh.cp_size):
        rows = vis[sh.global_index(r)]
        work.append(int(rows.sum()))
        seen = rows.any(0) & (owner != r)
        need.append(int(seen.sum()))
    return work, need


INSPECT_MASKS = [dict(causal=True), dict(causal=False, window_size=(5, 9)), dict(causal=True, chunk_size=7),
                 dict(causal=True, window_size=(3, -1))]  # fmt: skip


@pytest.mark.parametrize("mask_kw", INSPECT_MASKS, ids=str)
@pytest.mark.parametrize("balance", mcx.BALANCES)
def test_inspect_plan_matches_brute_force(mask_kw, balance):
    cu = [0, 40, 41, 41, 90, 300, 333]
    for cp in (2, 3, 4):
        sh = mcx.shard_sequences(cu, cp, balance, **mask_kw)
        work, need = _brute(sh, mask_kw)
        row = 2 * (8 + 8) * 2  # 2 KV heads, d 8, bf16
        for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            a2a = 1 if comm == "a2a+p2p" else None
            rep = mcx.inspect_plan(sh, comm, **mask_kw, a2a_size=a2a, num_heads=4, num_kv_heads=2, head_dim=8)
            assert rep.kv_row_bytes == row
            for r, rr in rep.ranks.items():
                assert rr.tokens == sh.num_tokens(r)
                assert rr.bytes_needed["forward"] == need[r] * row
                if comm in ("p2p", "all_gather", "a2a+p2p"):  # a2a+p2p with groups of one is p2p
                    assert rr.work == work[r] == rr.useful, (comm, r)
                for c in rr.calls:
                    assert c.cu_seqlens_q[0] == 0 and c.cu_seqlens_q == sorted(c.cu_seqlens_q)
                    assert c.causal == (c.window[1] == 0) and c.useful <= c.tile_area
            if comm in ("p2p", "a2a+p2p"):
                assert [rr.bytes_received["forward"] for rr in rep.ranks.values()] == [n * row for n in need]
                assert sum(rr.bytes_sent["forward"] for rr in rep.ranks.values()) == sum(need) * row
            if comm == "all_gather":
                pad = max(sh.counts())
                assert [rr.padding for rr in rep.ranks.values()] == [pad - t for t in sh.counts()]
                assert all(rr.bytes_sent["forward"] == (cp - 1) * pad * row for rr in rep.ranks.values())
            if comm == "a2a":  # every rank computes 1/cp of the heads over all tokens
                assert sum(rr.work for rr in rep.ranks.values()) == pytest.approx(sum(work), abs=cp)


def test_inspect_plan_selected_ranks_and_errors():
    sh = mcx.shard_sequences(cu_seqlens(lognormal(50000, seed=1)), 8)
    rep = mcx.inspect_plan(sh, ranks=[3, 5])
    assert sorted(rep.ranks) == [3, 5] and rep.ranks[3].rank == 3
    with pytest.raises(ValueError, match="comm_type"):
        mcx.inspect_plan(sh, "ring")
    with pytest.raises(ValueError, match="a2a_size"):
        mcx.inspect_plan(sh, "a2a+p2p")
    with pytest.raises(ValueError, match="ranks"):
        mcx.inspect_plan(sh, ranks=[8])
    mask = MaskSpec.make(causal=True)
    assert rep.mask == mask


# ---- small ranks: never less balanced than dual-chunk -------------------------------------------
def _small_family(count: int, seed: int) -> list[tuple[list[int], int]]:
    """Random batches with a few hundred to a few thousand tokens per rank (where equal counts
    force cuts through most documents): totals 2K-16K, cp 2-16, lognormal lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        total, cp = int(2 ** rng.uniform(11, 14)), int(2 ** rng.integers(1, 5))
        median, sigma = int(2 ** rng.uniform(8, 13)), float(rng.uniform(0, 2))
        out.append((lognormal(total, median=median, sigma=sigma, seed=int(rng.integers(1 << 30))), cp))
    return out


@pytest.mark.parametrize("mask", ["causal", "nomask"])
def test_small_ranks_at_least_as_balanced_as_dualchunk(mask):
    for lens, cp in _small_family(6, seed=28)[2:]:  # the batches where one pass falls short
        cu = cu_seqlens(lens)
        sh = mcx.shard_sequences(cu, cp, **MASKS[mask])
        assert max(sh.counts()) - min(sh.counts()) <= 1
        rep = mcx.inspect_plan(sh, "p2p", **MASKS[mask])
        dual = mcx.inspect_plan(mcx.shard_sequences(cu, cp, "dualchunk", **MASKS[mask]), "p2p", **MASKS[mask])
        # as balanced as dual-chunk (up to one token's share of work), within the goal, and
        # with at least its tile efficiency wherever dual-chunk itself meets the work goal
        assert rep.work_imbalance <= min(dual.work_imbalance + WORK_SLACK, WORK_BOUND) + 1e-12, (cu[-1], cp)
        if dual.work_imbalance <= WORK_BOUND:
            assert rep.tile_efficiency >= dual.tile_efficiency - 1e-12, (cu[-1], cp)


def _exhaustive_pick(lens, counts, mask, dual):
    """The search without its shortcuts: every pass run in full and scored on its own."""
    from megatron_cp_ext.balance.pick import TOLERANCES, rank_work, tile_estimate
    from megatron_cp_ext.balance.workload import workload_segments

    cands = [workload_segments(lens, counts, mask, t) for t in TOLERANCES]
    cands.insert(1, dual)
    cands.append(workload_segments(lens, counts[::-1], mask)[::-1])
    work = [rank_work(lens, c, mask) for c in cands]
    imb = [w.max() / max(w.mean(), 1e-30) for w in work]
    tiles = [tile_estimate(lens, c, mask) for c in cands]
    bound = min(imb[1] + WORK_SLACK, WORK_BOUND)
    if imb[0] <= bound and (tiles[0] <= tiles[1] or imb[1] > bound):
        return cands[0]
    if imb[0] <= bound:
        bound = min(bound, imb[0] + WORK_SLACK)
    ok = [i for i in range(len(cands)) if imb[i] <= bound] or [int(np.argmin(imb))]
    return cands[min((tiles[i], imb[i], i) for i in ok)[2]]


@pytest.mark.parametrize(
    "lens, cp, mask",
    [([12502, 516], 8, dict(causal=False)), ([5269, 4873], 2, dict(causal=True)),
     ([25147], 4, dict(causal=True, window_size=(1024, -1))), ([10716, 24963, 21473], 16, dict(causal=True)),
     ([1361, 261, 841, 3056, 342, 44], 16, dict(causal=False)), ([10555, 22548, 60030], 64, dict(causal=True))],
)  # fmt: skip
def test_search_shortcuts_pick_what_the_full_search_picks(lens, cp, mask, monkeypatch):
    """The search reuses probes across passes, stops passes that cannot win and skips the
    reversed pass on symmetric counts: none of that may change the pick (batches where the
    extra passes run, some with symmetric counts). The exact tile step after it is off here
    (tests/L0/test_tile_pick.py)."""
    from megatron_cp_ext.balance import pick as balance_pick
    from megatron_cp_ext.balance.pick import pick

    monkeypatch.setattr(balance_pick, "TILE_STEP", False)
    from megatron_cp_ext.sharding import _dualchunk, rank_counts

    lens = np.asarray(lens, dtype=np.int64)
    spec = MaskSpec.make(**mask)
    counts = rank_counts(int(lens.sum()), cp)
    want = _exhaustive_pick(lens, counts, spec, _dualchunk(lens, cp, 1))
    got = pick(lens, counts, spec, lambda: _dualchunk(lens, cp, 1))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("window", [(5, 9), (40, 40), (3, -1), (70, 2), (-1, 6), (300, 300)], ids=str)
def test_mirror_halves_rise_in_their_own_order(window):
    """Under a non-causal window each unit's halves (the second read in mirrored order) have
    non-decreasing visible keys per query, counted from the mask's definition, and their
    closed-form work matches that count."""
    from megatron_cp_ext.balance.workload import _work
    from megatron_cp_ext.balance.workload_mirror import halves, mirror_split
    from megatron_cp_ext.masks.geometry import bounds

    mask = MaskSpec.make(causal=False, window_size=window)
    lens = np.array([1, 2, 7, 64, 129, 300])
    lo, up = bounds(mask)
    m = mirror_split(lens, lo, up)
    if m is None:  # nothing falls: every unit rises as it is
        m = lens
    vlen, vwork, params, _ = halves(lens, m, lo, up)
    for u, n in enumerate(lens.tolist()):
        keys = np.array([sum(mask.visible(q, k) for k in range(n)) for q in range(n)], dtype=np.int64)
        for v, order in ((2 * u, keys[: m[u]]), (2 * u + 1, keys[m[u] :][::-1])):
            assert len(order) == vlen[v] and (np.diff(order) >= 0).all(), (n, v, order)
            assert vwork[v] == order.sum() == _work(params[v][0], len(order), *params[v][1:])


def test_long_short_fills_the_total_exactly():
    """Short documents raised to one token used to overshoot (65,700 asked, 65,857 planned)."""
    for extra in (157, 160, 190, 300, 1000):
        lens = long_short(65536 + extra)
        assert sum(lens) == 65536 + extra and min(lens) >= 1 and len(lens) == 158
