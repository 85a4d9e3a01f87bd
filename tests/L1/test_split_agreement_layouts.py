"""The split-agreement family on layouts beyond the plain THD reproductions
(``test_split_agreement.py`` holds those and the randomized family; its helpers run here):

- plain ``PackedSeqParams`` under a non-``te`` ``load_balance`` refuse on every rank, however the
  data was split (also by that very balance, in this process): only TransformerEngine's split is
  assumed, any other must come with the params;
- sbhd through ``CPCoreAttention`` (Megatron's dual-chunk split): data cut by Megatron's
  ``get_batch_on_this_cp_rank`` or the ``dualchunk`` balance is exact, a ``contiguous`` cut refuses;
- ``shard_batch_for_cp`` on a bshd batch records its dual-chunk split: thd params of ``[0, s]``
  with another split refuse, and a split over another group of the CP size refuses.

Expected outcomes come from ``global_index`` comparisons or the rule, not from the split record.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_split_agreement import (  # noqa: E402
    COMMS,
    DIM,
    GROUPS,
    HEADS,
    ODD,
    _config,
    _exact,
    _one_error_everywhere,
    _setup,
    core_case,
)

from megatron_cp_ext.testing.pool import run_on_ranks  # noqa: E402

BALANCE_CASES = [
    pytest.param(balance, data, world, lengths, id=f"{balance}-{data}-{world}-{name}")
    for world in (2, 4)
    for data in ("index-workload", "megatron-te", "readme", "dualchunk")
    for balance in ("workload", "dualchunk", "contiguous")
    # multiples of 2cp at CP 2 and 4 (TE's split takes them), and lengths that are not
    for name, lengths in (("2cp", [32, 120, 0, 64, 200, 8]), ("odd", ODD))
    if name == "2cp" or data == "readme"
]


@pytest.mark.parametrize("balance,data,world,lengths", BALANCE_CASES)
def test_load_balance_other_than_te_needs_the_split_carried(balance, data, world, lengths):
    """Plain params under a non-``te`` ``load_balance`` refuse on every rank whatever split the
    data got: by Megatron's own TransformerEngine split (read as a workload split, this was
    silently wrong), by the package's split applied by index, or recorded by ``shard`` with the
    same balance (a record cannot say which micro-batch it belongs to: one with the same
    ``cu_seqlens`` split by Megatron's step was read as the last one's split). The same data with
    ``make_packed_seq_params(cu, sharding=...)`` runs (``test_split_agreement.py``)."""
    results = run_on_ranks(world, core_case, data, "plain", lengths, "p2p", None, balance)
    _one_error_everywhere(results, "carry no megatron_cp_ext split", f"load_balance={balance!r}", "sharding=")


def test_a_rank_that_alone_refuses_stops_every_rank():
    """CP rank 0 split its data with ``shard`` (recorded), rank 1 cut the same rows by index; the
    layer refuses plain params under ``workload`` on both alike (no rank waits in an exchange)."""
    results = run_on_ranks(
        2, core_case, "rank0-recorded", "plain", [32, 120, 0, 64], "p2p", None, "workload", timeout=120
    )
    _one_error_everywhere(results, "carry no megatron_cp_ext split")


def sbhd_case(rank: int, world: int, data: str, comm: str) -> dict:
    """``CPCoreAttention`` on sbhd input (no ``PackedSeqParams``: Megatron's dual-chunk split),
    the data cut by Megatron's ``get_batch_on_this_cp_rank`` or by ``shard_sequences([0, s])``,
    against dense fp64 attention over each whole sample."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_cp_ext as mcx
    from megatron_cp_ext.megatron import CPCoreAttention
    from megatron_cp_ext.testing.megatron import megatron_dual_chunk
    from megatron_cp_ext.testing.reference import dense_attention

    group = _setup(world, comm)
    core = CPCoreAttention(_config(world, comm, None), 1, AttnMaskType.causal,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())  # fmt: skip
    s, b = 96 * world, 2
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, b, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, GROUPS, GROUPS))
    if data == "megatron":  # Megatron's own pipeline: [b, s, ...] batches, nothing recorded
        got = megatron_dual_chunk({n: x.transpose(0, 1) for n, x in zip("qkv", (q, k, v))}, group)
        local = [got[n].transpose(0, 1) for n in "qkv"]
        rows = torch.as_tensor(mcx.shard_sequences([0, s], world, balance="dualchunk").global_index(rank))
    else:
        sh = mcx.shard_sequences([0, s], world, balance=data)
        local, rows = [sh.shard(x, rank) for x in (q, k, v)], torch.as_tensor(sh.global_index(rank))
    try:
        out = core(*local, None)
    except mcx.CPArgumentError as err:
        return {"error": type(err).__name__, "message": str(err)}
    want = torch.stack([dense_attention(q[:, i], k[:, i], v[:, i], [0, s], causal=True) for i in range(b)], 1)
    return {"errs": {"out": (out - want[rows].reshape(len(rows), b, -1)).abs().max().item()}}


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("data", ["megatron", "dualchunk", "contiguous"])
def test_sbhd_layer_agrees_or_refuses(data, comm):
    """sbhd through Megatron: data cut by Megatron's own function or by the dual-chunk balance is
    exact; a contiguous cut of the sequence refuses on every rank (it was silently wrong)."""
    results = run_on_ranks(4, sbhd_case, data, comm)
    if data == "contiguous":
        _one_error_everywhere(
            results, "CP split mismatch", "'contiguous' split", "dual-chunk split (qkv_format='sbhd')"
        )
    else:
        _exact(results, 1e-10)


def bshd_batch_case(rank: int, world: int, window) -> dict:
    """A ``[1, s]`` batch split by ``shard_batch_for_cp`` without ``cu_seqlens`` (Megatron's
    dual-chunk cut of the row), then attended as thd with ``make_packed_seq_params([0, s])``
    under the layer's mask: the output rows against dense fp64 attention, or the error."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_cp_ext import CPArgumentError
    from megatron_cp_ext.megatron import CPCoreAttention, make_packed_seq_params, shard_batch_for_cp
    from megatron_cp_ext.testing.reference import dense_attention

    group = _setup(world, "p2p")
    core = CPCoreAttention(_config(world, "p2p", window), 1, AttnMaskType.causal,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())  # fmt: skip
    s, c = 64 * world, 32  # c: one of the 2 * world chunks of the row
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, GROUPS, GROUPS))
    got = shard_batch_for_cp({"q": q[None], "k": k[None], "v": v[None]}, cp_group=group)
    rows = torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    )
    assert torch.equal(got["q"][0], q[rows])  # Megatron's dual-chunk rows, written out
    params = make_packed_seq_params([0, s], cp_group=group, window_size=window or (-1, -1))
    layer_rows = [torch.as_tensor(params._mcx_cp_context.sharding.global_index(r)) for r in range(world)]
    try:
        out = core(got["q"][0], got["k"][0], got["v"][0], None, packed_seq_params=params)
    except CPArgumentError as err:
        return {"error": type(err).__name__, "message": str(err), "same_rows": torch.equal(layer_rows[rank], rows)}
    want = dense_attention(q, k, v, [0, s], causal=True, window_size=window or (-1, -1)).flatten(-2)
    return {"errs": {"out": (out - want[rows]).abs().max().item()}, "same_rows": torch.equal(layer_rows[rank], rows)}


@pytest.mark.parametrize("world, window", [(2, (16, 0)), (4, (16, 0)), (4, None)])
def test_bshd_batch_split_then_thd_params_agree_or_refuse(world, window):
    """The package's bshd batch split (no ``cu_seqlens``) records its split like ``CPSharding.shard``:
    thd params whose split differs from it (a window moves the workload cuts) refuse on every
    rank (they ran silently wrong); where the splits give every rank the same rows, exact."""
    results = run_on_ranks(world, bshd_batch_case, window)
    if all(r["same_rows"] for r in results):
        _exact(results, 1e-10)
    else:
        _one_error_everywhere(results, "CP split mismatch", "'dualchunk' split", "'workload' split")


def dp_group_split_case(rank: int, world: int) -> dict:
    """CP 2 × DP 2: an sbhd batch split by ``shard_batch_for_cp`` over the data-parallel group
    (a group of the CP size): ranks 1 and 2 took another CP rank's chunks."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_cp_ext import CPArgumentError
    from megatron_cp_ext.megatron import CPCoreAttention, shard_batch_for_cp

    _setup(2, "p2p")
    core = CPCoreAttention(_config(2, "p2p", None), 1, AttnMaskType.causal,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())  # fmt: skip
    g = torch.Generator().manual_seed(5)
    batch = {n: torch.randn(1, 64, h, DIM, generator=g) for n, h in zip("qkv", (HEADS, GROUPS, GROUPS))}
    got = shard_batch_for_cp(batch, cp_group=parallel_state.get_data_parallel_group())
    try:
        core(*(got[n].transpose(0, 1) for n in "qkv"), None)
    except CPArgumentError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"errs": {}}


def test_bshd_batch_split_over_another_group_is_refused():
    """It ran silently wrong (docs listed it as not caught); the split's record names the CP rank
    whose chunks were taken, so both ranks of each CP group refuse alike."""
    results = run_on_ranks(4, dp_group_split_case)
    for group in (results[:2], results[2:]):
        _one_error_everywhere(group, "CP shard mismatch", "attends as CP rank")
