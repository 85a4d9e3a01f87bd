"""``balance="workload"`` end to end: every comm type and mask, on gloo worlds of 2 and 4, against
the dense fp64 reference, with documents long enough to be cut into tile-aligned pieces
across ranks next to empty, one-token and odd-length ones (bshd/sbhd keep Megatron's split:
their tokens are placed by the data loader, not by us)."""

import pytest

from megatron_cp_ext.schedules import p2p_plan
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (700, 0, 1, 301, 45, 2)  # 700 and 301 are cut on 2 and 4 ranks
COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]
MASKS = {
    "causal": dict(causal=True),
    "nomask": dict(causal=False),
    "left64": dict(causal=True, window_size=(64, 0)),
    "bidir-50-30": dict(causal=False, window_size=(50, 30)),
    "chunk100": dict(causal=True, chunk_size=100),
    "chunk256-left40": dict(causal=True, chunk_size=256, window_size=(40, -1)),
}
HEADS = {"mha": dict(hq=4, hkv=4), "gqa": dict(hq=4, hkv=2), "mla": dict(hq=4, hkv=4, d=12, dv=8)}


def _grid() -> list:
    """Every comm type x mask once, causal with every head layout; the world alternates so that
    each comm type and each mask runs on both worlds (32 cases: the full product, 80, had each
    plan shape several times over at about 2 s a case)."""
    out = []
    for ci, comm in enumerate(COMM_TYPES):
        for mi, mask in enumerate(MASKS):
            heads_of = list(HEADS) if mask == "causal" else [list(HEADS)[(ci + mi) % 3] if mask == "left64" else "gqa"]
            for hi, heads in enumerate(heads_of):
                world = (2, 4)[(ci + mi + hi) % 2]
                out.append(pytest.param(comm, mask, world, heads, id=f"{comm}-{mask}-w{world}-{heads}"))
    return out


def test_grid_covers_pairs():
    grid = [p.values for p in _grid()]
    assert {(c, m) for c, m, _, _ in grid} == {(c, m) for c in COMM_TYPES for m in MASKS}
    assert {(c, w) for c, _, w, _ in grid} == {(c, w) for c in COMM_TYPES for w in (2, 4)}
    assert {(m, w) for _, m, w, _ in grid} == {(m, w) for m in MASKS for w in (2, 4)}
    assert {(c, h) for c, m, _, h in grid if m == "causal"} == {(c, h) for c in COMM_TYPES for h in HEADS}


@pytest.mark.parametrize("comm, mask, world, heads", _grid())
def test_workload_matches_dense(comm, mask, world, heads):
    a2a = {"a2a+p2p": 2 if world == 4 else 1}.get(comm, 0)
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, balance="workload", a2a_size=a2a, **HEADS[heads], **MASKS[mask])
    check_case(run_on_ranks(world, run_case, case), case)


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_workload_bf16(comm):
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, balance="workload", dtype="bfloat16", hkv=2,
                    a2a_size=2 if comm == "a2a+p2p" else 0)  # fmt: skip
    check_case(run_on_ranks(4, run_case, case), case)


def _split_case(rank: int, world: int, case: AttnCase) -> dict:
    """``run_case`` with a2a+p2p's forward running its halved wide calls at this small size."""
    floor, p2p_plan.SPLIT_MIN_BYTES = p2p_plan.SPLIT_MIN_BYTES, 0
    try:
        return run_case(rank, world, case)
    finally:
        p2p_plan.SPLIT_MIN_BYTES = floor


@pytest.mark.parametrize("mask", ["causal", "nomask", "left64", "chunk100"])
def test_a2a_p2p_halved_forward_calls_match_dense(mask):
    """The ring calls a2a+p2p's forward halves (``p2p_plan.split_wide``; on this batch cut
    inside a document under causal and no mask) give the dense result, forward and backward."""
    case = AttnCase(seqlens=SEQLENS, comm_type="a2a+p2p", balance="workload", a2a_size=2, hkv=2, **MASKS[mask])
    check_case(run_on_ranks(4, _split_case, case), case)


@pytest.mark.parametrize("mask, world", [("bidir-50-30", 2), ("chunk256-left40", 4)])
def test_grid_exercises_the_reference_step(mask, world, monkeypatch):
    """Two cells of the grid above run a plain split that the reference step keeps for its
    shorter critical path (``balance.pick.shorter_reference``: the contiguous split, the
    packed order), so its shardings are checked against the dense reference too."""
    import numpy as np

    import megatron_cp_ext as mcx
    from megatron_cp_ext.balance import pick as balance_pick

    cu = np.concatenate([[0], np.cumsum(SEQLENS)]).tolist()
    new = mcx.shard_sequences(cu, world, **MASKS[mask])
    monkeypatch.setattr(balance_pick, "PATH_STEP", False)
    old = mcx.shard_sequences(cu, world, **MASKS[mask])
    assert any(not np.array_equal(new.rank_segments(r), old.rank_segments(r)) for r in range(world))
