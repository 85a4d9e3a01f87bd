"""Strict argument checks of the helpers around the engine (single process): sharding,
masks, the Megatron batch split and options. Each case asserts the exception class and that
the message names the argument; integer-valued arguments refuse non-integers."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.runtime.validation import CPArgumentError as VE
from megatron_cp_ext.runtime.validation import CPArgumentTypeError as TE
from megatron_cp_ext.runtime.validation import as_int, as_scale
from megatron_cp_ext.sharding import check_cu_seqlens

CU = [0, 5, 5, 12]


@pytest.mark.parametrize(
    "cu, err, names",
    [
        ([0, 10.5, 20], TE, "cu_seqlens"),  # used to be truncated to 10
        ([0, 10.0, 20], TE, "cu_seqlens"),  # a float where a count belongs: refused, not converted
        (torch.tensor([0.0, 4.0]), TE, "cu_seqlens"),
        (torch.tensor([0, 1]).bool(), TE, "cu_seqlens"),
        ([0, "4"], TE, "cu_seqlens"),
        ([0, True, 3], TE, "cu_seqlens"),
        ("0,4", TE, "cu_seqlens"),
        (5, TE, "cu_seqlens"),
        ([0, 5, 3], VE, "non-decreasing"),
        ([1, 5], VE, "start at 0"),
        ([], VE, "at least one entry"),
        ([0, 2**63], VE, "int32"),  # past int64 as well: no numpy overflow
        ([0, 5, -(2**70)], VE, "non-decreasing"),
        (torch.tensor([[0, 4]]), TE, "1-D"),
    ],
    ids=lambda x: repr(x)[:24],
)
def test_cu_seqlens_refuses_non_integers(cu, err, names):
    with pytest.raises(err, match=names):
        mcx.shard_sequences(cu, 2)


def test_cu_seqlens_accepts_integer_kinds():
    assert check_cu_seqlens([0, np.int64(3), torch.tensor(5)]) == [0, 3, 5]
    assert check_cu_seqlens(torch.tensor([0, 2, 9], dtype=torch.int32)) == [0, 2, 9]


@pytest.mark.parametrize(
    "kw, err, names",
    [
        (dict(cp_size=2.0), TE, "cp_size"),
        (dict(cp_size=True), TE, "cp_size"),
        (dict(cp_size=0), VE, "cp_size"),
        (dict(cp_size="2"), TE, "cp_size"),
        (dict(cp_size=2, balance="zigzag"), VE, "balance"),
        (dict(cp_size=2, balance=None), VE, "balance"),
    ],
)
def test_shard_sequences_arguments(kw, err, names):
    with pytest.raises(err, match=names):
        mcx.shard_sequences(CU, **kw)


@pytest.mark.parametrize(
    "rank, dim, err, names",
    [(-1, 0, VE, "rank"), (2, 0, VE, "rank"), (1.0, 0, TE, "rank"), (0, 0.0, TE, "dim"), (0, 3, VE, "dim")],
)
def test_shard_rank_and_dim(rank, dim, err, names):
    sh = mcx.shard_sequences(CU, 2)
    with pytest.raises(err, match=names):
        sh.shard(torch.zeros(12, 2), rank, dim=dim)


def test_shard_wrong_length_and_custom_segments():
    sh = mcx.shard_sequences(CU, 2)
    with pytest.raises(VE, match="tokens along dim 0"):
        sh.shard(torch.zeros(11, 2), 0)
    with pytest.raises(TE, match="segments"):
        mcx.CPSharding.from_segments(CU, [[(0, 0, 2.5), (0, 2.5, 5), (2, 0, 7)]])
    with pytest.raises(VE, match=r"\(seq, start, end\)"):
        mcx.CPSharding.from_segments(CU, [[(0, 0)]])


@pytest.mark.parametrize(
    "kw, err, names",
    [
        (dict(causal=1), TE, "causal"),
        (dict(causal=True, window_size=(2.7, 0)), TE, "window_size"),
        (dict(causal=True, window_size=5), TE, "window_size"),
        (dict(causal=True, chunk_size=16.0), TE, "chunk_size"),
        (dict(causal=True, chunk_size=np.float64(4)), TE, "chunk_size"),
    ],
)
def test_mask_spec_is_strict(kw, err, names):
    with pytest.raises(err, match=names):
        mcx.MaskSpec.make(**kw)


def test_validators_name_the_argument_and_list_choices():
    with pytest.raises(TE, match=r"depth must be an int >= 1, got 2\.5 \(float\)"):
        as_int(2.5, "depth", minimum=1)
    with pytest.raises(VE, match=r"comm_type must be one of \('p2p', 'all_gather', 'a2a', 'a2a\+p2p', 'auto'\)"):
        mcx.cp_attention(*(torch.zeros(4, 1, 2),) * 3, cp_group=None, comm_type="ring", sharding=None)
    assert as_scale(np.float32(0.5)) == 0.5 and as_scale(None) is None
    err = pytest.raises(TE, match="softmax_scale")
    with err:
        as_scale("0.5")
    assert issubclass(TE, TypeError) and issubclass(TE, ValueError)  # catchable either way


def test_single_rank_errors_raise_locally_without_a_process_group():
    sh = mcx.shard_sequences([0, 8], 1)
    q = torch.randn(8, 2, 4)
    with pytest.raises(TE, match="window_size"):
        mcx.cp_attention(q, q, q, cp_group=None, sharding=sh, window_size=None)
    with pytest.raises(VE, match="backend 'flash' runs float16/bfloat16 only|needs CUDA"):
        mcx.cp_attention(q, q, q, cp_group=None, sharding=sh, backend="flash")
    out = mcx.cp_attention(q, q, q, cp_group=None, sharding=sh, check=True)  # check mode at CP 1: no exchange
    assert out.shape == q.shape


# ---- Megatron batch split and options ----------------------------------------------------
@pytest.fixture
def megatron_batch():
    """The Megatron batch split: skipped (these tests only) without megatron-core, the piece they
    need; a broken ``megatron_cp_ext.megatron.batch`` fails instead of skipping."""
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron import batch

    return batch


def _batch(total: int, **extra):
    b = {"tokens": torch.arange(total)[None], "labels": torch.arange(total)[None], "loss_mask": torch.ones(1, total)}
    return b | extra


@pytest.mark.parametrize(
    "batch, cu, err, names",
    [
        (_batch(12, labels=torch.zeros(1, 11)), CU, VE, "labels"),  # used to pass through unsharded
        (_batch(12, loss_mask=torch.ones(1, 13, 2)), CU, VE, "loss_mask"),
        (_batch(12, tokens=torch.arange(12)), CU, VE, "tokens"),  # 1-D: [1, T] expected
        (_batch(12, position_ids=torch.arange(12)), CU, VE, "position_ids"),
        (_batch(12), [0, 5.0, 12], TE, "cu_seqlens"),  # float cu_seqlens refused, as by the core
        (_batch(12), torch.tensor([0.0, 5.0, 12.0]), TE, "cu_seqlens"),
        (_batch(12), [0, 7, 5], VE, "cu_seqlens"),
        (_batch(12, tokens=torch.zeros(2, 12)), CU, VE, "'tokens'.*one row"),  # failed later, as a 4-D q
    ],
    ids=[
        "labels_short",
        "mask_long",
        "tokens_1d",
        "positions_1d",
        "cu_float",
        "cu_float_tensor",
        "cu_decreasing",
        "two_rows",
    ],  # fmt: skip
)
def test_thd_batch_split_validates_every_tensor(megatron_batch, batch, cu, err, names):
    with pytest.raises(err, match=names):
        megatron_batch.shard_batch_for_cp(batch, cu_seqlens=cu, cp_group=None)


def test_thd_batch_split_keeps_unrelated_entries(megatron_batch):
    batch = _batch(12, cu_seqlens=torch.tensor(CU), max_seqlen=torch.tensor(7), attention_mask=torch.ones(1))
    out = megatron_batch.shard_batch_for_cp(batch, cu_seqlens=CU, cp_group=None)
    assert out["cu_seqlens"] is batch["cu_seqlens"] and out["max_seqlen"] is batch["max_seqlen"]
    assert out["attention_mask"] is None and out["tokens"].shape == (1, 12)


def test_thd_batch_split_passes_the_packing_entries_through(megatron_batch):
    """Megatron's packed datasets carry ``cu_seqlens`` as ``[1, n + 1]``: global values, never cut,
    even when ``n + 1`` equals the token count (it was cut like tokens then)."""
    cu = [0, 2, 3, 4]
    packing = {"cu_seqlens": torch.tensor([cu]), "cu_seqlens_argmin": torch.tensor([[4]])}
    packing["max_seqlen"] = torch.tensor([[2]])
    batch = _batch(4, **packing)
    out = megatron_batch.shard_batch_for_cp(batch, cu_seqlens=cu, cp_group=None)
    assert all(out[k] is batch[k] for k in ("cu_seqlens", "cu_seqlens_argmin", "max_seqlen"))


def test_plain_packed_seq_params_with_float_cu_seqlens_refused(megatron_batch):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0.0, 5.0, 12.0])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(TE, match="cu_seqlens"):
        megatron_batch.cp_context(params, 1, 0)


def test_bshd_batch_split_needs_one_sequence_length(megatron_batch):
    batch = {"tokens": torch.zeros(2, 8), "labels": torch.zeros(2, 7)}
    with pytest.raises(VE, match="labels"):
        megatron_batch.shard_batch_for_cp(batch, cp_group=None)


def test_attention_options_are_strict_and_flag_sets_check():
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron import core_attention as core
    from megatron_cp_ext.megatron.args import add_arguments, cp_attention_options_from_args

    for kw, err, names in [
        (dict(chunk_size=16.0), TE, "chunk_size"),
        (dict(backend="triton"), VE, "backend"),
        (dict(check=1), TE, "check"),
        (dict(load_balance="zigzag"), VE, "load_balance"),
    ]:
        with pytest.raises(err, match=names):
            core.CPAttentionOptions(**kw)
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--cp-attention-check"])
    assert cp_attention_options_from_args(args).check is True
    assert cp_attention_options_from_args(add_arguments(argparse.ArgumentParser()).parse_args([])).check is False


def test_device_cu_seqlens_named_by_the_package_error():
    """Plans are built on the host: a device ``cu_seqlens`` is refused as the other bad inputs are."""
    with pytest.raises(VE, match="cu_seqlens must be a CPU tensor"):
        mcx.shard_sequences(torch.tensor([0, 4, 8], device="meta"), 2)
