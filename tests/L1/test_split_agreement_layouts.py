"""The split-agreement family on layouts beyond the plain THD reproductions
(``test_split_agreement.py`` holds those and the randomized family; its helpers run here):

- plain ``PackedSeqParams`` under a non-``te`` ``load_balance``: the layer runs only on a split
  this process recorded; data split by Megatron's own TransformerEngine split, or by the
  package's split applied by index, refuses on every rank, also when one rank alone refuses;
- sbhd through ``CPCoreAttention`` (Megatron's dual-chunk split): data cut by Megatron's
  ``get_batch_on_this_cp_rank`` or the ``dualchunk`` balance is exact, a ``contiguous`` cut refuses.

Expected outcomes come from ``global_index`` comparisons, not from the split record.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_split_agreement import (  # noqa: E402
    COMMS,
    DATA,
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
    for data in ("index-workload", "megatron-te", "readme", "dualchunk", "index-dualchunk")
    for balance in ("workload", "dualchunk", "contiguous")
    # multiples of 2cp at CP 2 and 4 (TE's split takes them), and lengths that are not
    for name, lengths in (("2cp", [32, 120, 0, 64, 200, 8]), ("odd", ODD))
    if not (data == "megatron-te" and name == "odd")
]


@pytest.mark.parametrize("balance,data,world,lengths", BALANCE_CASES)
def test_load_balance_needs_the_data_split_on_record(balance, data, world, lengths):
    """Plain params under a non-``te`` ``load_balance``: the layer runs only on a split this
    process made and recorded (the same balance: exact; another: the mismatch). Data split
    outside the package, by Megatron's own TransformerEngine split or by the package's split
    applied by index, refuses on every rank (the first was silently wrong)."""
    results = run_on_ranks(world, core_case, data, "plain", lengths, "p2p", None, balance)
    if data.startswith("index-") or data.startswith("megatron"):
        _one_error_everywhere(results, "nothing confirms load_balance", "load_balance='te'", "sharding=")
    elif _same_rows(lengths, world, DATA[data], balance):  # e.g. workload choosing the dual-chunk cut
        _exact(results, 1e-10)
    else:
        _one_error_everywhere(results, "CP split mismatch", f"load_balance={balance!r}")


def test_a_rank_that_alone_cannot_confirm_the_split_stops_every_rank():
    """CP rank 0 recorded its data's split, rank 1 cut the same rows by index: rank 1 refuses
    (nothing confirms ``load_balance``) and rank 0, which could run, raises the same error in
    its first exchange instead of waiting for rank 1 there."""
    results = run_on_ranks(
        2, core_case, "rank0-recorded", "plain", [32, 120, 0, 64], "p2p", None, "workload", timeout=120
    )
    _one_error_everywhere(results, "nothing confirms load_balance")


def two_micro_batches(rank: int, world: int, second: str, balance: str) -> list[dict]:
    """Micro-batch A split by the package's workload split, then micro-batch B with the very
    same ``cu_seqlens`` split by ``second``; plain params for both, in one process."""
    lengths = [32, 120, 0, 64, 200, 8]
    return [core_case(rank, world, data, "plain", lengths, "p2p", None, balance) for data in ("readme", second)]


@pytest.mark.parametrize("second", ["readme", "megatron-te"])
def test_a_split_confirms_one_micro_batch_only(second):
    """B split by Megatron's own step records nothing: A's split, already taken by A's layers,
    must not vouch for B (it did: B ran on A's split, max error 2.05 against dense fp64). B
    split by the package again runs."""
    results = run_on_ranks(2, two_micro_batches, second, "workload", timeout=120)
    _exact([r[0] for r in results], 1e-10)
    if second == "readme":
        _exact([r[1] for r in results], 1e-10)
    else:
        _one_error_everywhere([r[1] for r in results], "nothing confirms load_balance='workload'")


def _same_rows(lengths: list[int], world: int, a: str, b: str) -> bool:
    """Whether two balances give every rank the same global rows (not through the split record)."""
    import megatron_cp_ext as mcx

    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x, y = (mcx.shard_sequences(cu, world, balance=n) for n in (a, b))
    return all(list(x.global_index(r)) == list(y.global_index(r)) for r in range(world))


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
