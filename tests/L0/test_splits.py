"""The record of data splits (``megatron_cp_ext/sharding/splits.py``): what is recorded (``shard``, an
unpickled sharding), what counts as the same split (the token -> rank assignment, however cut into
segments), what is kept (the last ``KEEP`` micro-batches), and the Megatron side on one rank:
``make_packed_seq_params(sharding=...)`` and a plain ``PackedSeqParams`` against the record."""

import pickle

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext import CPArgumentError
from megatron_cp_ext.sharding import splits
from megatron_cp_ext.sharding.te_layout import te_thd_sharding

CU = [0, 36, 156, 156, 220, 420, 424]


def test_shard_records_and_only_the_same_assignment_matches():
    sh = mcx.shard_sequences(CU, 2)
    assert splits.recorded(CU, 2) == ()
    g0 = splits.generation()
    sh.shard(torch.zeros(424), 1)
    (rec,) = splits.recorded(CU, 2)
    assert rec.fingerprint == splits.layout_of(sh).fingerprint and splits.generation() > g0
    g1 = splits.generation()
    sh.shard(torch.zeros(424), 0)  # the same split again: nothing new
    assert splits.generation() == g1 and len(splits.recorded(CU, 2)) == 1
    # the same assignment cut into more segments is the same split
    finer = [[(int(s), int(a), int(m)), (int(s), int(m), int(b))] for s, a, b in sh.rank_segments(0)
             for m in [(int(a) + int(b)) // 2] if b - a > 1]  # fmt: skip
    segs = [sum(finer, []) + [tuple(map(int, x)) for x in sh.rank_segments(0) if x[2] - x[1] <= 1],
            [tuple(map(int, x)) for x in sh.rank_segments(1)]]  # fmt: skip
    cut = mcx.CPSharding.from_segments(CU, segs)
    same_tokens = [torch.equal(cut.global_index(r).sort().values, sh.global_index(r).sort().values) for r in (0, 1)]
    assert all(same_tokens)
    same_order = torch.equal(cut.global_index(0), sh.global_index(0))
    assert (splits.layout_of(cut).fingerprint == rec.fingerprint) == same_order
    te = te_thd_sharding(CU, 2)
    assert splits.layout_of(te).fingerprint != rec.fingerprint
    assert "rank 0" in splits.first_difference(rec, splits.layout_of(te))
    assert mcx.shard_sequences(CU, 1).shard(torch.zeros(424), 0).shape == (424,)
    assert splits.recorded(CU, 1) == ()  # CP 1: one rank holds everything, nothing to disagree on


def test_unpickled_sharding_is_recorded():
    data = pickle.dumps(mcx.shard_sequences(CU, 4, balance="dualchunk"))  # a data-loader worker's split
    assert splits.recorded(CU, 4) == ()
    sh = pickle.loads(data)
    assert [r.balance for r in splits.recorded(CU, 4)] == ["dualchunk"]
    assert splits.recorded(CU, 4)[0].fingerprint == splits.layout_of(sh).fingerprint


def test_only_the_last_micro_batches_are_kept():
    for n in range(splits.KEEP + 5):
        mcx.shard_sequences([0, 8 + n], 2).shard(torch.zeros(8 + n), 0)
    assert splits.recorded([0, 8], 2) == ()
    assert len(splits.recorded([0, 8 + splits.KEEP + 4], 2)) == 1
    splits.clear()
    assert splits.recorded([0, 8 + splits.KEEP + 4], 2) == ()


def test_given_sharding_must_fit():
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron import make_packed_seq_params

    sh = mcx.shard_sequences(CU, 1)
    params = make_packed_seq_params(CU, sharding=sh)
    assert params._mcx_cp_context.sharding is sh
    with pytest.raises(CPArgumentError, match="either sharding or balance"):
        make_packed_seq_params(CU, sharding=sh, balance="workload")
    with pytest.raises(CPArgumentError, match="other cu_seqlens"):
        make_packed_seq_params(CU[:-1], sharding=sh)
    with pytest.raises(CPArgumentError, match=r"CP size 2.*cp_group=None is CP size 1: pass parallel_state"):
        make_packed_seq_params(CU, sharding=mcx.shard_sequences(CU, 2))  # cp_group forgotten
    with pytest.raises(TypeError, match="CPSharding"):
        make_packed_seq_params(CU, sharding="workload")


def test_plain_params_checked_against_the_record_on_one_rank():
    """``cp_context`` at CP 2 on rank 0 (no collective is involved in settling the split)."""
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_cp_ext.megatron.context import cp_context

    cu = torch.tensor(CU, dtype=torch.int32)

    def plain():
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    assert cp_context(plain(), 2, 0, "te", tokens=212).sharding.balance == "te"  # nothing recorded: TE's split
    mcx.shard_sequences(CU, 2).shard(torch.zeros(424), 0)  # the README's split of these cu_seqlens
    with pytest.raises(CPArgumentError, match=r"CP split mismatch.*'workload' split.*'te' split"):
        cp_context(plain(), 2, 0, "te", tokens=212)
    # under another load_balance plain params are refused even when this process split the data
    # that way: cu_seqlens cannot say which micro-batch's split the data got
    with pytest.raises(CPArgumentError, match="carry no megatron_cp_ext split .*load_balance='workload'"):
        cp_context(plain(), 2, 0, "workload", tokens=212)
    with pytest.raises(
        CPArgumentError, match=r"cu_seqlens_q\[-1\] = 424 tokens, but this CP rank holds 200 .*gives every rank 212\)"
    ):
        cp_context(plain(), 2, 0, "workload", tokens=200)
    # a params object already in use is re-checked when a new split is recorded (an int compare otherwise)
    splits.clear()
    params = plain()
    cp_context(params, 2, 0, "te", tokens=212)
    te_thd_sharding(CU, 2).shard(torch.zeros(424), 0)
    assert cp_context(params, 2, 0, "te", tokens=212).sharding.balance == "te"  # the data's split
    mcx.shard_sequences(CU, 2, balance="contiguous").shard(torch.zeros(424), 0)
    assert cp_context(params, 2, 0, "te", tokens=212).sharding.balance == "te"  # still one of them
    splits.clear()
    mcx.shard_sequences(CU, 2, balance="contiguous").shard(torch.zeros(424), 0)
    with pytest.raises(CPArgumentError, match="'contiguous' split"):
        cp_context(params, 2, 0, "te", tokens=212)
