"""What the cuDNN candidate (``backends/cudnn.py``) hands cuDNN, checked on CPU.

cuDNN's documented varlen semantics are emulated here, independently of the reference: per
entry ``b < B`` the element offsets locate its rows, the lengths bound them (the padding mask),
the band (anchored bottom-right, or top-left for equal entries) masks keys, the stats are
token-major ``[T, H, 1]``, and a row whose keys are all band-masked reads out 0 and stats -inf
(what the H200 run showed). The emulation runs on exactly the operands the wrapper binds
(:func:`cudnn.fwd_buffers`, :func:`cudnn.bwd_buffers`, keyed by :func:`cudnn.graph_key`) and
must give the reference backend's outputs, lse and gradients on random calls: any lengths, 0
and 1 included, queries without keys and keys without queries, every window, GQA/MQA/MLA,
ragged or padded stats. Outputs the wrapper leaves unfilled are poisoned first, so a row
cuDNN would not write shows up. Graph keys: none new after the first 10 of 50 random
micro-batches for whole-batch calls (what the GPU suite counts), a handful for a CP plan's calls.
"""

import itertools
import logging
import random

import numpy as np
import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import cudnn, reference
from megatron_cp_ext.backends import cudnn_args as ca
from megatron_cp_ext.testing.reference import ENTRY_WINDOWS, entry_band, random_call

U = cudnn._U
WINDOWS = ENTRY_WINDOWS


def test_band_is_the_contract_mask():
    for (sq, sk), causal, window in itertools.product(
        [(50, 13), (13, 50), (1, 7), (7, 1), (30, 30), (1, 1)], [True, False], WINDOWS
    ):
        if causal and window[1] not in (-1, 0):
            continue
        b = ca.band(causal, window)
        assert torch.equal(ca.visible(sq, sk, b), entry_band(sq, sk, causal, window)), (sq, sk, causal, window)
        if sq == sk:  # equal entries: top-left is the same mask
            assert torch.equal(ca.visible(sq, sk, b, top_left=True), entry_band(sq, sk, causal, window))
    assert ca.band(True, (-1, 0)) == ca.Band(left_bound=None, right_bound=0)
    assert ca.band(False, (4, 2)) == ca.Band(left_bound=5, right_bound=2)  # left W -> W + 1
    assert not ca.band(False, (-1, -1)).bottom_right


def test_buckets_bound_and_coarse():
    for n in range(0, 5000, 7):
        b = ca.bucket(n, 64)
        assert b >= max(n, 64) and b & (b - 1) == 0 and (b < 2 * n or b == 64)
    assert len({ca.bucket(n, 1) for n in range(1000, 100_000)}) == 8


def test_ragged_pads_with_empty_entries():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    r = ca.ragged(cu, 8, (4, 2, 4))
    assert r.lengths.flatten().tolist() == [3, 0, 7, 0, 0, 0, 0, 0] and r.lengths.dtype == torch.int32
    assert r.offsets[0].flatten().tolist() == [0, 12, 12, 40, 40, 40, 40, 40, 40] and r.offsets[0].dtype == torch.int64
    assert r.offsets[1].flatten().tolist() == [0, 6, 6, 20, 20, 20, 20, 20, 20]
    assert r.offsets[2] is r.offsets[0] and r.offsets[0].shape == (9, 1, 1, 1)


def test_contract_lse_maps_empty_rows():
    stats = torch.tensor([[1.0, float("inf")], [float("-inf"), -3e38], [float("nan"), -5.0]]).unsqueeze(-1)
    lse = ca.contract_lse(stats)
    assert lse[0, 0] == 1 and lse[1, 1] == float("-inf") and lse[0, 1] == float("-inf") and lse[2, 1] == -5
    assert lse[1, 0] == float("-inf") and torch.isnan(lse[2, 0])
    assert lse.is_contiguous()  # what the merges' CUDA kernel takes


# ---- the emulated kernel -------------------------------------------------------------------------
def _entry(bufs, key, b: int):
    """Entry ``b``'s query and key rows from the bound offsets (strides as the graph declares)."""
    lq, lk = int(bufs[U.LEN_Q][b]), int(bufs[U.LEN_K][b])
    assert lq <= key.sq and lk <= key.sk, "a length above the graph's bound"
    oq, ok = int(bufs[U.OFF_Q][b]), int(bufs[U.OFF_K][b])
    assert oq % (key.hq * key.d) == 0 and ok % (key.hk * key.d) == 0
    q0, k0 = oq // (key.hq * key.d), ok // (key.hk * key.d)
    assert int(bufs[U.OFF_O][b]) == q0 * key.hq * key.dv and int(bufs[U.OFF_V][b]) == k0 * key.hk * key.dv
    if U.OFF_STATS in bufs:
        assert int(bufs[U.OFF_STATS][b]) == q0 * key.hq
    return slice(q0, q0 + lq), slice(k0, k0 + lk), lq, lk


def _scores(bufs, key, qs, ks, lq, lk, scale):
    g = key.hq // key.hk
    qh = bufs[U.Q][qs].double().transpose(0, 1)  # [H, lq, D]
    kh = bufs[U.K][ks].double().repeat_interleave(g, 1).transpose(0, 1)
    vis = ca.visible(lq, lk, key.band, key.top_left)
    return torch.where(vis, scale * qh @ kh.transpose(1, 2), float("-inf"))


def _emulate_fwd(key, bufs, scale) -> None:
    g = key.hq // key.hk
    for b in range(key.batch):
        qs, ks, lq, lk = _entry(bufs, key, b)
        if lq == 0:
            continue
        assert lk > 0, "cuDNN computes an entry without keys wrongly: the wrapper must drop its queries"
        s = _scores(bufs, key, qs, ks, lq, lk, scale)
        lse = torch.logsumexp(s, -1)  # [H, lq]
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        vh = bufs[U.V][ks].double().repeat_interleave(g, 1).transpose(0, 1)
        bufs[U.O][qs] = (p @ vh).transpose(0, 1).to(bufs[U.O].dtype)
        bufs[U.STATS][qs] = lse.t()[..., None].float()


def _stats_of(bufs, key, b: int, qs, lq: int) -> torch.Tensor:
    """Entry ``b``'s stats ``[H, lq]``: ragged (token-major rows) or padded ``[B, H, S, 1]``."""
    st = bufs[U.STATS]
    return (st[qs, :, 0].t() if key.ragged_stats else st[b, :, :lq, 0]).double()


def _emulate_bwd(key, bufs, scale) -> None:
    g = key.hq // key.hk
    bufs[U.DK].zero_()
    bufs[U.DV].zero_()
    for b in range(key.batch):
        qs, ks, lq, lk = _entry(bufs, key, b)
        if lq == 0 or lk == 0:
            continue
        p = torch.exp(_scores(bufs, key, qs, ks, lq, lk, scale) - _stats_of(bufs, key, b, qs, lq)[..., None])
        do = bufs[U.DO][qs].double().transpose(0, 1)
        o = bufs[U.O][qs].double().transpose(0, 1)
        vh = bufs[U.V][ks].double().repeat_interleave(g, 1).transpose(0, 1)
        kh = bufs[U.K][ks].double().repeat_interleave(g, 1).transpose(0, 1)
        qh = bufs[U.Q][qs].double().transpose(0, 1)
        ds = p * (do @ vh.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        bufs[U.DQ][qs] = (scale * ds @ kh).transpose(0, 1).to(bufs[U.DQ].dtype)
        fold = lambda x: x.unflatten(0, (key.hk, g)).sum(1).transpose(0, 1)  # noqa: E731 - GQA heads add up
        bufs[U.DK][ks] = fold(scale * ds.transpose(1, 2) @ qh).to(bufs[U.DK].dtype)
        bufs[U.DV][ks] = fold(p.transpose(1, 2) @ do).to(bufs[U.DV].dtype)


def _poison(bufs, key, ids) -> None:
    """What the wrapper leaves unfilled may hold anything: NaN, so an unwritten row shows."""
    if key.top_left:
        for u in ids:
            bufs[u].fill_(float("nan"))


def _call(rng: random.Random):
    lens_q, lens_k, same, causal, window, heads = random_call(rng, [(4, 2, 16, 16), (4, 1, 24, 16), (2, 2, 8, 8)])
    return lens_q, lens_k, same, causal, window, heads


@pytest.mark.parametrize("ragged_stats", [True, False])
def test_emulated_cudnn_matches_reference(ragged_stats):
    rng, scale = random.Random(7), 0.3
    for trial in range(40):
        lens_q, lens_k, same, causal, window, (hq, hk, d, dv) = _call(rng)
        g = torch.Generator().manual_seed(trial)
        q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
        k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64)
        v = torch.randn(sum(lens_k), hk, dv, generator=g, dtype=torch.float64)
        cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
        cu_k = cu_q if same else torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
        mq, mk = max(max(lens_q), 1), max(max(lens_k), 1)
        args = (cu_q, cu_k, mq, mk, causal, window, scale)
        if q.shape[0] == 0 or k.shape[0] == 0:
            continue  # answered before any graph (attn_fwd)
        ref_out, ref_lse = reference.attn_fwd(q, k, v, *args)
        key = cudnn._key(q, k, v, cu_q, cu_k, mq, mk, causal, window, scale, bwd=False, ragged_stats=True)
        assert key.top_left == same
        bufs = cudnn.fwd_buffers(key, q, k, v, cu_q, cu_k)
        _poison(bufs, key, (U.O, U.STATS))
        _emulate_fwd(key, bufs, scale)
        out, lse = bufs[U.O], ca.contract_lse(bufs[U.STATS])
        torch.testing.assert_close(out, ref_out, atol=1e-9, rtol=0, msg=f"trial {trial}: out")
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"trial {trial}: empty rows"
        seen = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=1e-5, rtol=0)
        dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
        want = reference.attn_bwd(dout, q, k, v, ref_out, ref_lse, *args)
        key = cudnn._key(q, k, v, cu_q, cu_k, mq, mk, causal, window, scale, bwd=True, ragged_stats=ragged_stats)
        bufs = cudnn.bwd_buffers(key, dout, q, k, v, ref_out, ref_lse.float(), cu_q, cu_k)
        _poison(bufs, key, (U.DQ,))
        _emulate_bwd(key, bufs, scale)
        for u, w, name in zip((U.DQ, U.DK, U.DV), want, ("dq", "dk", "dv")):
            torch.testing.assert_close(bufs[u], w, atol=1e-4, rtol=0, msg=f"trial {trial}: {name}")


# ---- graph reuse ---------------------------------------------------------------------------------
def _lognormal(tokens: int, median: int, seed: int) -> list[int]:
    rng, out = np.random.default_rng(seed), []
    while sum(out) < tokens:
        out.append(max(1, int(rng.lognormal(np.log(median), 1.0))))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def _new_keys(keys_per_batch: list[set]) -> list[int]:
    seen, new = set(), []
    for keys in keys_per_batch:
        new.append(len(keys - seen))
        seen |= keys
    return new


def _keys(cu_q, cu_k, causal, window, **kw) -> set:
    common = dict(dtype=torch.bfloat16, entries=len(cu_q) - 1, tokens_q=cu_q[-1], tokens_k=cu_k[-1],
                  max_q=int(np.diff(cu_q).max()), max_k=int(np.diff(cu_k).max()), hq=32, hk=8, d=128, dv=128,
                  causal=causal, window=window, scale=0.088, same_entries=list(cu_q) == list(cu_k), **kw)  # fmt: skip
    return {cudnn.graph_key(bwd=b, **common) for b in (False, True)}


@pytest.mark.parametrize("tokens", [16384, 131072])
def test_whole_batch_graphs_stop_after_ten_micro_batches(tokens):
    """The GPU suite's count (``gpu_bench.bench_graphs``: causal and unmasked forward and
    backward over 50 lognormal micro-batches): a pure function of the keys, computed here."""
    per = []
    for seed in range(50):
        cu = np.concatenate([[0], np.cumsum(_lognormal(tokens, 2048, 100 + seed))])
        per.append(_keys(cu, cu, True, (-1, 0)) | _keys(cu, cu, False, (-1, -1)))
    new = _new_keys(per)
    assert sum(new[10:]) == 0, new
    assert sum(new) <= 24, new


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_plan_calls_build_few_graphs(comm_type):
    """Every call of every rank of a causal CP 4 plan over 50 random micro-batches of 32K tokens:
    a handful of graphs in all, at most two geometries (forward and backward) new after the 10th."""
    per = []
    for seed in range(50):
        cu = np.concatenate([[0], np.cumsum(_lognormal(32768, 2048, 300 + seed))])
        rep = mcx.inspect_plan(mcx.shard_sequences(cu.tolist(), 4, causal=True), comm_type, causal=True)
        keys = set()
        for r in rep.ranks.values():
            for c in r.calls:
                keys |= _keys(np.asarray(c.cu_seqlens_q), np.asarray(c.cu_seqlens_k), c.causal, c.window)
        per.append(keys)
    new = _new_keys(per)
    assert sum(new[10:]) <= 4 and sum(new) <= 12, new


def test_refused_graph_falls_back(monkeypatch, caplog):
    """A geometry cuDNN refuses runs on the next kernel (here the reference: fp64 on CPU), with
    one logged line per refused graph; a refused ragged-stats backward turns to padded stats."""

    def refuse(*a, **kw):
        raise RuntimeError("not supported (test)")

    monkeypatch.setattr(cudnn, "_module", lambda: None)
    monkeypatch.setattr(cudnn, "_handle", lambda mod, device: None)
    monkeypatch.setattr(cudnn, "_build", refuse)
    monkeypatch.setattr(cudnn, "_GRAPHS", {})
    monkeypatch.setitem(cudnn._STATE, "ragged_stats_bwd", True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 40], dtype=torch.int32)
    args = (cu, cu, 33, 33, True, (-1, 0), 0.25)
    with caplog.at_level(logging.WARNING, logger="megatron_cp_ext.kernels"):
        for _ in range(2):
            out, lse = cudnn.attn_fwd(q, k, v, *args)
            grads = cudnn.attn_bwd(torch.ones_like(out), q, k, v, out, lse, *args)
    want_out, want_lse = reference.attn_fwd(q, k, v, *args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for x, w in zip(grads, reference.attn_bwd(torch.ones_like(out), q, k, v, out, lse, *args)):
        assert torch.equal(x, w)
    said = [r.getMessage() for r in caplog.records]
    assert sum("graph refused" in m for m in said) == 3, said  # forward, ragged and padded backward
    assert sum("padded stats from now on" in m for m in said) == 1
    assert not cudnn._STATE["ragged_stats_bwd"]
