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
    with pytest.raises(CPArgumentError, match="CP size 2"):
        make_packed_seq_params(CU, sharding=mcx.shard_sequences(CU, 2))
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
    assert cp_context(plain(), 2, 0, "workload", tokens=212).sharding.balance == "workload"  # the same split
    # that split vouched for one micro-batch: the next one with these cu_seqlens needs its own
    with pytest.raises(CPArgumentError, match="not already used, so nothing confirms load_balance='workload'"):
        cp_context(plain(), 2, 0, "workload", tokens=212)
    with pytest.raises(
        CPArgumentError, match=r"cu_seqlens_q\[-1\] = 424 tokens, but this CP rank holds 200 .*gives every rank 212\)"
    ):
        cp_context(plain(), 2, 0, "workload", tokens=200)
    # a params object already in use is re-checked when a new split is recorded (an int compare otherwise)
    mcx.shard_sequences(CU, 2).shard(torch.zeros(424), 0)  # the next micro-batch: same lengths, same split
    params = plain()
    cp_context(params, 2, 0, "workload", tokens=212)
    te_thd_sharding(CU, 2).shard(torch.zeros(424), 0)
    assert cp_context(params, 2, 0, "workload", tokens=212).sharding.balance == "workload"  # still one of them
    splits.clear()
    mcx.shard_sequences(CU, 2, balance="contiguous").shard(torch.zeros(424), 0)
    with pytest.raises(CPArgumentError, match="'contiguous' split"):
        cp_context(params, 2, 0, "workload", tokens=212)


def _plain(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t, cu_seqlens_kv=t)


def test_a_split_vouches_for_one_micro_batch():
    """The next micro-batch may have the same ``cu_seqlens`` but data split by Megatron's own
    step (nothing recorded): the last micro-batch's split must not confirm its layers' split."""
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron.context import cp_context

    sh = mcx.shard_sequences(CU, 2)
    for _ in ("tokens", "labels", "loss_mask"):  # one micro-batch's tensors: one event
        sh.shard(torch.zeros(424), 0)
    assert [s.balance for s in splits.pending(CU, 2, 0)] == ["workload"] and splits.pending(CU, 2, 1) == ()
    cp_context(_plain(CU), 2, 0, "workload", tokens=212)  # micro-batch 1 takes it
    assert splits.pending(CU, 2, 0) == ()
    with pytest.raises(CPArgumentError, match="nothing confirms load_balance='workload'"):
        cp_context(_plain(CU), 2, 0, "workload", tokens=212)  # micro-batch 2: nothing split it here
    sh.shard(torch.zeros(424), 0)  # the same sharding reused for micro-batch 2: armed again
    cp_context(_plain(CU), 2, 0, "workload", tokens=212)
    # rank 1's split does not confirm rank 0's layer (threads of one process each split their own)
    sh.shard(torch.zeros(424), 1)
    with pytest.raises(CPArgumentError, match="nothing confirms"):
        cp_context(_plain(CU), 2, 0, "workload", tokens=212)
    cp_context(_plain(CU), 2, 1, "workload", tokens=212)


def _carrying(sh):
    """Params carrying ``sh`` on CP rank 0 of 2 (what ``make_packed_seq_params(sharding=)`` builds)."""
    from megatron_cp_ext.megatron.context import CONTEXT_ATTR, CPBatchContext, version_of

    p = _plain(sh.cu_seqlens)
    cu = p.cu_seqlens_q
    setattr(p, CONTEXT_ATTR, CPBatchContext(sharding=sh, rank=0, source=(cu,), version=(version_of(cu),)))
    return p


def test_pending_splits_are_taken_in_order_and_a_foreign_one_is_a_mismatch():
    pytest.importorskip("megatron.core")
    from megatron_cp_ext.megatron.context import cp_context

    worker = [pickle.dumps(mcx.shard_sequences(CU, 2)) for _ in range(3)]  # three micro-batches split ahead
    received = [pickle.loads(w) for w in worker]
    assert len(splits.pending(CU, 2, 0)) == 3  # each unpickled sharding is one event, for any rank
    for sh in received:  # each micro-batch's layers take one
        cp_context(_carrying(sh), 2, 0, tokens=212)
    assert splits.pending(CU, 2, 0) == ()
    mcx.shard_sequences(CU, 2, balance="contiguous").shard(torch.zeros(424), 0)  # this micro-batch's data
    with pytest.raises(CPArgumentError, match=r"CP split mismatch.*'contiguous' split.*'workload' split"):
        cp_context(_carrying(received[0]), 2, 0, tokens=212)  # a stale sharding
