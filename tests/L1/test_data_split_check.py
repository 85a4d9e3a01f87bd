"""``cp_attention`` itself (no Megatron): the split the data got and the split the call attends
with are one split, or every CP rank raises the same ``CPArgumentError`` (design rule 5).

- thd: data split by one ``shard_sequences`` result (``CPSharding.shard``), the call given
  another sharding of the same ``cu_seqlens`` (another balance, or the same balance under the
  layer's own mask: the README's per-layer mistake);
- bshd/sbhd: data cut along its sequence dimension by ``shard_sequences([0, s], cp)``, while
  these formats always attend with Megatron's dual-chunk split.

The expected outcome is computed without the package's split record: a case must be exact
(against dense fp64 attention over the whole batch) when both splits give every rank the same
global rows, by ``global_index`` or by Megatron's dual-chunk formula written out here, and
must refuse otherwise. Data split outside the package (``x[global_index]``: nothing recorded)
keeps working, and a rank that did not record the split raises the same error as the rank
that did (gloo processes: each keeps its own record).
"""

from __future__ import annotations

import pytest
import torch

from megatron_cp_ext.testing.inproc import run_threads
from megatron_cp_ext.testing.pool import run_on_ranks

CU = [0, 700, 1000, 1001, 1001, 1600]
H, G, D = 4, 2, 16
WINDOW = (64, 0)
BALANCES = {
    "workload": dict(),
    "workload-window": dict(causal=True, window_size=WINDOW),  # balanced under the layer's own mask
    "dualchunk": dict(balance="dualchunk"),
    "contiguous": dict(balance="contiguous"),
}


def _qkv(n: int, shape=lambda n, h: (n, h, D)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape(n, h), generator=g, dtype=torch.float64) for h in (H, G, G)]


def _same_rows(a, b, world: int) -> bool:
    """Independent of the split record: every rank holds the same global rows, in order."""
    return all(
        torch.equal(torch.as_tensor(a.global_index(r)), torch.as_tensor(b.global_index(r))) for r in range(world)
    )


def _thd_case(rank: int, world: int, data: str, layer: str, record: bool) -> dict:
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.testing.reference import dense_attention

    q, k, v = _qkv(CU[-1])
    a = mcx.shard_sequences(CU, world, **BALANCES[data])
    b = mcx.shard_sequences(CU, world, **BALANCES[layer])
    cut = (lambda x: a.shard(x, rank)) if record else (lambda x: x[torch.as_tensor(a.global_index(rank))])
    local = [cut(x) for x in (q, k, v)]
    try:
        out = mcx.cp_attention(*local, cp_group=dist.group.WORLD, sharding=b, causal=True, window_size=WINDOW)
    except mcx.CPArgumentError as err:
        return {"error": str(err)}
    want = dense_attention(q, k, v, CU, causal=True, window_size=WINDOW)
    return {"err": (out - cut(want)).abs().max().item(), "same": _same_rows(a, b, world)}


def _one_error(results: list[dict], *needles: str) -> None:
    assert all("error" in r for r in results), results
    assert len({r["error"] for r in results}) == 1, "ranks raised different messages"
    for needle in needles:
        assert needle in results[0]["error"], results[0]["error"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layer", list(BALANCES))
@pytest.mark.parametrize("data", list(BALANCES))
def test_thd_call_uses_the_data_split_or_refuses(data, layer, world):
    import megatron_cp_ext as mcx

    a, b = (mcx.shard_sequences(CU, world, **BALANCES[x]) for x in (data, layer))
    same = _same_rows(a, b, world)
    got = run_threads(world, _thd_case, data, layer, True, timeout=120)
    if same:
        assert all(r.get("err", 1.0) < 1e-12 for r in got), got
    else:
        _one_error(got, "CP split mismatch", "the sharding passed to cp_attention", "Pass cp_attention the sharding")


@pytest.mark.parametrize("world", [2, 4])
def test_grid_holds_the_per_layer_mistake(world):
    """The README's split balanced under the default mask and one rebuilt under a layer's
    window differ on this batch, so the grid above checks that mistake refuses."""
    import megatron_cp_ext as mcx

    a, b = (mcx.shard_sequences(CU, world, **BALANCES[x]) for x in ("workload", "workload-window"))
    assert not _same_rows(a, b, world)


def test_unrecorded_data_split_is_not_second_guessed():
    """Data cut by index outside the package records nothing: the call's split is taken as the
    data's (a wrong pairing there is the caller's; the package cannot see it)."""
    got = run_threads(2, _thd_case, "contiguous", "contiguous", False, timeout=120)
    assert all(r["err"] < 1e-12 for r in got), got


def test_a_rank_without_the_record_raises_the_same_error():
    """Rank 0 split its data with ``shard`` (recorded), rank 1 by index (nothing recorded):
    rank 1 sees no mismatch itself, yet raises rank 0's error instead of waiting for it."""
    got = run_on_ranks(2, _mixed_record_rank)
    _one_error(got, "CP split mismatch", "'contiguous' split")


def _mixed_record_rank(rank: int, world: int) -> dict:
    return _thd_case(rank, world, "contiguous", "workload", rank == 0)


def _other_ranks_shard(rank: int, world: int, wrong: tuple[int, ...]) -> dict:
    """Ranks in ``wrong`` take the next rank's tokens (equal counts: nothing else disagrees)."""
    import torch.distributed as dist

    import megatron_cp_ext as mcx

    cu = [0, 13, 13, 14, 40, 47, 48]  # 48 tokens: equal counts at CP 2 and 3
    sharding = mcx.shard_sequences(cu, world, "dualchunk")
    took = (rank + 1) % world if rank in wrong else rank
    local = [sharding.shard(x, took) for x in _qkv(cu[-1])]
    try:
        mcx.cp_attention(*local, cp_group=dist.group.WORLD, sharding=sharding)
    except mcx.CPArgumentError as err:
        return {"error": str(err)}
    return {"ran": True}


@pytest.mark.parametrize("world, wrong", [(2, (0, 1)), (3, (1,))])
def test_another_ranks_shard_is_refused(world, wrong):
    """A process that took another CP rank's tokens (the global or TP rank passed to ``shard``)
    attended on them at full speed: output wrong by O(1), no error. Each process records which
    ranks' tokens it took; attending as a rank it took none for raises, on every rank."""
    got = run_on_ranks(world, _other_ranks_shard, wrong, timeout=120)
    _one_error(got, "CP shard mismatch", f"attends as CP rank {wrong[0]}", "the rank in the CP group")


def _dual_chunk_rows(s: int, cp: int, rank: int) -> torch.Tensor:
    """Megatron's split of one sequence of length ``s``: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    c = s // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def _seq_case(rank: int, world: int, fmt: str, data: str, s: int, b: int) -> dict:
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.testing.reference import dense_attention

    shape = (lambda n, h: (n, b, h, D)) if fmt == "sbhd" else (lambda n, h: (b, n, h, D))
    q, k, v = _qkv(s, shape)
    a = mcx.shard_sequences([0, s], world, **BALANCES[data])
    if fmt == "sbhd":  # the sequence dimension leads: shard() cuts it for every sample at once
        local = [a.shard(x, rank) for x in (q, k, v)]
    else:  # bshd: each sample cut with the same split
        local = [torch.stack([a.shard(x[i], rank) for i in range(b)]) for x in (q, k, v)]
    try:
        out = mcx.cp_attention(*local, cp_group=dist.group.WORLD, qkv_format=fmt, sharding=None, causal=True)
    except mcx.CPArgumentError as err:
        return {"error": str(err)}
    rows = torch.as_tensor(a.global_index(rank))
    errs = []
    for i in range(b):
        pick = (lambda x: x[:, i]) if fmt == "sbhd" else (lambda x: x[i])  # noqa: B023
        want = dense_attention(pick(q), pick(k), pick(v), [0, s], causal=True)
        errs.append((pick(out) - want[rows]).abs().max().item())
    same = torch.equal(rows, _dual_chunk_rows(s, world, rank))
    return {"err": max(errs), "same": same}


@pytest.mark.parametrize("fmt,b", [("sbhd", 1), ("sbhd", 3), ("bshd", 2)])
@pytest.mark.parametrize("data", ["workload", "workload-window", "dualchunk", "contiguous"])
def test_bshd_sbhd_data_split_is_dual_chunk_or_refuses(data, fmt, b):
    got = run_threads(2, _seq_case, fmt, data, 1000, b, timeout=120)
    if "error" in got[0] or "error" in got[1]:
        _one_error(got, "CP split mismatch", "dual-chunk split", "balance='dualchunk'")
        import megatron_cp_ext as mcx

        a = mcx.shard_sequences([0, 1000], 2, **BALANCES[data])
        assert not all(torch.equal(torch.as_tensor(a.global_index(r)), _dual_chunk_rows(1000, 2, r)) for r in (0, 1))
    else:
        assert all(r["same"] and r["err"] < 1e-12 for r in got), got
    assert data not in ("dualchunk",) or "err" in got[0]  # Megatron's own split always runs
    assert data not in ("contiguous",) or "error" in got[0]  # a contiguous cut never equals it


def _split_changes_between_micro_batches(rank: int, world: int) -> list[str]:
    """Worker: micro-batch 1 split by ``shard`` (``workload``, recorded); micro-batch 2 of the
    same ``cu_seqlens`` cut by index for a dual-chunk split (nothing recorded for it)."""
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.sharding import splits

    cu, g = [0, 64, 128], torch.Generator().manual_seed(0)
    first = mcx.shard_sequences(cu, world, "workload")
    x = first.shard(torch.randn(128, 2, 8, generator=g, dtype=torch.float64), rank)
    mcx.cp_attention(x, x, x, cp_group=dist.group.WORLD, sharding=first)
    second = mcx.shard_sequences(cu, world, "dualchunk")
    y = torch.randn(128, 2, 8, generator=g, dtype=torch.float64)[torch.as_tensor(second.global_index(rank))]
    out = []
    for _ in range(2):
        try:
            mcx.cp_attention(y, y, y, cp_group=dist.group.WORLD, sharding=second)
            out.append("ran")
        except mcx.CPArgumentError as err:
            out.append(str(err))
            splits.clear()  # where the split changes: the next call runs
    return out


def test_a_split_change_on_the_same_cu_seqlens_names_its_way_out():
    """The record is per ``cu_seqlens``, so the second micro-batch is refused (a documented
    limit), with a message that says why and how to go on; after ``splits.clear()`` it runs."""
    for refused, ran in run_threads(2, _split_changes_between_micro_batches, timeout=120):
        assert "CP split mismatch" in refused and "splits.clear()" in refused and ran == "ran", (refused, ran)


def _rows_as_packed(rank: int, world: int, fmt: str, took: str) -> dict:
    """bshd/sbhd rows split otherwise than Megatron's per-row dual chunks: ``packed`` cuts the
    flattened ``b`` rows as packed sequences with the dual-chunk split of ``[0, s, ..., b*s]``
    (its segments are the rows' dual-chunk ones, only in sequence order); ``other-rank`` cuts
    each row for the next CP rank. Before, both ran with O(1) errors."""
    import torch.distributed as dist

    import megatron_cp_ext as mcx
    from megatron_cp_ext.sharding import splits

    splits.clear()  # the other case's record (threads share one process)
    b, s = 2, 16 * world
    q, k, v = _qkv(s, lambda n, h: (b, n, h, D))
    if took == "packed":
        sh = mcx.shard_sequences([i * s for i in range(b + 1)], world, "dualchunk")
        local = [sh.shard(x.reshape(b * s, *x.shape[2:]), rank).reshape(b, s // world, *x.shape[2:]) for x in (q, k, v)]
    else:
        one = mcx.shard_sequences([0, s], world, "dualchunk")
        local = [one.shard(x, (rank + 1) % world, dim=1) for x in (q, k, v)]
    if fmt == "sbhd":
        local = [x.transpose(0, 1) for x in local]
    try:
        mcx.cp_attention(*local, cp_group=dist.group.WORLD, qkv_format=fmt, causal=True)
    except mcx.CPArgumentError as err:
        return {"error": str(err)}
    return {"ran": True}


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_rows_split_as_packed_sequences_or_for_another_rank_are_refused(fmt):
    got = run_on_ranks(2, _rows_as_packed, fmt, "packed", timeout=120)
    _one_error(got, "CP split mismatch", "split as packed (thd) sequences", "dim=")
    got = run_on_ranks(2, _rows_as_packed, fmt, "other-rank", timeout=120)
    _one_error(got, "CP shard mismatch", "attends as CP rank", "the rank in the CP group")


def _copied_sharding(rank: int, world: int, how: str) -> dict:
    """Data taken for the wrong CP rank, then the sharding copied in the same process (a
    deepcopy, a pickle round trip): the copy arrives whole (rank unknown), which once widened
    the record to any rank, so the wrong shard ran (error 3.0)."""
    import copy
    import pickle

    import torch.distributed as dist

    import megatron_cp_ext as mcx

    cu = [0, 13, 13, 14, 40, 47, 48]
    sharding = mcx.shard_sequences(cu, world, "dualchunk")
    local = [sharding.shard(x, (rank + 1) % world) for x in _qkv(cu[-1])]
    _copy = copy.deepcopy(sharding) if how == "deepcopy" else pickle.loads(pickle.dumps(sharding))
    try:
        mcx.cp_attention(*local, cp_group=dist.group.WORLD, sharding=sharding)
    except mcx.CPArgumentError as err:
        return {"error": str(err)}
    return {"ran": True}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_the_sharding_keeps_the_rank_check(how):
    got = run_on_ranks(2, _copied_sharding, how, timeout=120)
    _one_error(got, "CP shard mismatch", "attends as CP rank", "the rank in the CP group")
