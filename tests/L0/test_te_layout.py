"""TransformerEngine's THD split as a sharding, and the Megatron batch context that follows
``cu_seqlens`` values (in-place refills) rather than tensor objects. Host only, no ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.sharding import splits
from megatron_cp_ext.sharding.te_layout import separate_padding


def te_indices(cu: list[int], cp: int, rank: int) -> list[int]:
    """TransformerEngine's ``thd_get_partitioned_indices``, from its definition."""
    idx: list[int] = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // (2 * cp)
        idx += range(start + rank * c, start + (rank + 1) * c)
        idx += range(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c)
    return idx


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_te_sharding_is_transformer_engines_split(cp: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = (rng.integers(0, 40, size=rng.integers(1, 9)) * 2 * cp).tolist()  # 0 included
    cu = [0, *np.cumsum(lengths).tolist()]
    sharding = mcx.te_thd_sharding(cu, cp)
    assert sharding.balance == "te" and sharding.counts() == [cu[-1] // cp] * cp
    for rank in range(cp):
        assert sharding.global_index(rank).tolist() == te_indices(cu, cp, rank)
    x = torch.randn(cu[-1], 3)
    torch.testing.assert_close(sharding.unshard([sharding.shard(x, r) for r in range(cp)]), x, rtol=0, atol=0)


def test_te_sharding_refuses_lengths_it_cannot_split_and_takes_any_at_cp1() -> None:
    with pytest.raises(mcx.CPArgumentError, match=r"cu_seqlens_padded describe sequence 1 of length 6.*2\*cp = 4"):
        mcx.te_thd_sharding([0, 8, 14], 2)
    assert mcx.te_thd_sharding([0, 3, 8], 1).counts() == [8]


def _plain(cu: torch.Tensor, padded: torch.Tensor | None = None):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded
    )


def test_context_follows_an_in_place_refill_of_cu_seqlens() -> None:
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron.context import cp_context

    a, b = [0, 8, 32, 36, 48], [0, 16, 20, 40, 48]
    buf = torch.tensor(a, dtype=torch.int32)
    params = _plain(buf)
    first = cp_context(params, 2, 1)
    assert cp_context(params, 2, 1) is first  # cached while the values stay
    buf.copy_(torch.tensor(b))  # a static buffer refilled for the next micro-batch
    second = cp_context(params, 2, 1)
    assert second is not first and second.sharding.cu_seqlens == tuple(b)
    assert second.sharding.global_index(1).tolist() == te_indices(b, 2, 1)
    assert cp_context(params, 2, 1) is second


def test_attached_split_is_reapplied_after_a_refill() -> None:
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron import make_packed_seq_params
    from megatron_cp_ext.megatron.context import cp_context

    params = make_packed_seq_params([0, 5, 12, 20], balance="contiguous", window_size=(4, 0))
    params.cu_seqlens_q.copy_(torch.tensor([0, 9, 10, 20]))
    ctx = cp_context(params, 1, 0)
    assert ctx.sharding.cu_seqlens == (0, 9, 10, 20) and ctx.recipe.balance == "contiguous"
    assert ctx.recipe.window_size == (4, 0)


def test_padded_cu_seqlens_mean_the_te_split_whatever_the_balance() -> None:
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron.context import cp_context

    real, padded = torch.tensor([0, 3, 8]), torch.tensor([0, 4, 12])
    ctx = cp_context(_plain(real, padded), 2, 0, "workload")
    assert ctx.sharding.balance == "te" and ctx.sharding.cu_seqlens == (0, 3, 4, 9, 12)
    with pytest.raises(mcx.CPArgumentError, match="cu_seqlens_q describe sequence 0 of length 3.*shard_batch_for_cp"):
        cp_context(_plain(real), 2, 0)  # Megatron's split cannot have produced these lengths
    splits.clear()
    try:
        mcx.shard_sequences(real, 2).shard(torch.zeros(8), 0)  # this process split the data that way:
        with pytest.raises(mcx.CPArgumentError, match="carry no megatron_cp_ext split .*load_balance='workload'"):
            cp_context(_plain(real), 2, 0, "workload")  # still refused: only TE's split is assumed
    finally:
        splits.clear()


def test_padding_becomes_sequences_of_its_own_in_the_same_local_order() -> None:
    padded = [0, 8, 16, 24]
    real = [0, 5, 13, 13]  # 5 real of 8, 8 real of 8, 0 real of 8
    te = mcx.te_thd_sharding(padded, 2)
    split = separate_padding(te, real)
    assert split.cu_seqlens == (0, 5, 8, 16, 16, 16, 24)
    assert split.muted == {1, 5}  # the padding sequences that hold tokens: they attend nothing
    for rank in range(2):  # same global tokens, same order: the data split needs no change
        assert split.global_index(rank).tolist() == te.global_index(rank).tolist()
    with pytest.raises(mcx.CPArgumentError, match="no longer than its padded slot"):
        separate_padding(te, [0, 9, 13, 13])


def test_padded_context_keeps_padding_apart() -> None:
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron.context import cp_context

    real, padded = torch.tensor([0, 3, 8]), torch.tensor([0, 4, 12])
    ctx = cp_context(_plain(real, padded), 2, 0)
    assert ctx.sharding.cu_seqlens == (0, 3, 4, 9, 12)
    real.copy_(torch.tensor([0, 4, 6]))  # the real lengths alone refilled: the context follows
    assert cp_context(ctx_params := _plain(real, padded), 2, 0).sharding.cu_seqlens == (0, 4, 4, 6, 12)
    assert cp_context(ctx_params, 2, 0) is cp_context(ctx_params, 2, 0)


def test_muted_must_be_sequence_ids() -> None:
    import dataclasses

    sh = mcx.shard_sequences([0, 4, 8], 2)
    assert dataclasses.replace(sh, muted=[1]).muted == frozenset({1})
    with pytest.raises(mcx.CPArgumentError, match="muted holds sequence 2"):
        dataclasses.replace(sh, muted={2})
    for bad in (["x"], "1", {1.0}):
        with pytest.raises(TypeError, match="muted"):
            dataclasses.replace(sh, muted=bad)
