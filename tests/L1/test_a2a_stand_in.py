"""a2a's backward moves each row's ``dout . out`` to heads, not the output (``schedules/delta.py``):
the stand-in output gives the kernel the same row term, the gradients match those of the moved
output, and the backward's all-to-alls send exactly the bytes ``inspect_plan`` counts."""

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import reference
from megatron_cp_ext.schedules import a2a_groups, heads, route
from megatron_cp_ext.schedules.delta import row_dot, stand_in
from megatron_cp_ext.testing.inproc import run_threads

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
PRECISION = {torch.bfloat16: 2e-5, torch.float16: 2e-6, torch.float32: 2e-7, torch.float64: 1e-15}
"""Largest error of ``dout . stand_in`` against the row term, relative to the row's magnitude
``sum_d |dout_d * out_d|`` (the scale any kernel's rounding of the row term follows; relative
to the term itself, a cancelling fp16 row reaches the subnormal floor of the second entry):
about twice the 16-bit inputs' precision (two entries; one entry misses by 1e-4 and more), the
input's own for fp32 and fp64 (one)."""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stand_in_gives_the_row_term(dtype):
    g = torch.Generator().manual_seed(0)
    dout, out = (torch.randn(64, 3, 40, generator=g).to(dtype) for _ in range(2))
    dout[3] = 0  # a zero row
    dout[5, 1] = 0
    dout[5, 1, 7] = 2  # one nonzero entry
    dout[6, 0, 5] = float("nan")  # stays in its row
    delta = row_dot(dout, out)
    assert delta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = (dout.double() * out.double()).sum(-1)
    torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
    x = stand_in(dout, delta)
    assert x.dtype == dtype and x.shape == dout.shape
    got = (dout.double() * x.double()).sum(-1)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan.sum() == 1
    scale = (dout.double() * out.double()).abs().sum(-1)
    rel = (got - delta.double()).abs() / scale.clamp_min(1e-30)
    assert rel[~nan].max() <= PRECISION[dtype]
    assert torch.equal(x[3], torch.zeros_like(x[3]))


@pytest.mark.parametrize("mag", [2000.0, 40000.0])
def test_stand_in_of_rows_past_the_fp16_range(mag):
    """fp16 outputs whose magnitudes sum past 65504 (|out| ~ 2000 and ~ 40000 at Dv 64, and
    rows where two ``dout`` entries hold it all): ``delta / dout_k`` overflows fp16, so those
    rows spread the term over every entry, signs, +0 and -0 included. Finite, and within
    ``2^-11 * share * |dout_l|`` of the row term (``l`` the second largest entry); rows in
    range keep their two entries. Before, the a2a backward's dq and dk were NaN."""
    g = torch.Generator().manual_seed(2)
    sign = torch.randn(32, 2, 64, generator=g).sign()
    dout = (sign * (1 + 0.1 * torch.randn(32, 2, 64, generator=g))).half()
    dout[6:8, :, 5] = 0.0
    dout[6:8, :, 6] = -0.0
    dout[8:10] = 0
    dout[8:10, :, 3], dout[8:10, :, 9] = 1e-3, -1e-3  # two entries hold the row
    out = (sign * (mag + torch.randn(32, 2, 64, generator=g))).half()  # signs as dout's: no cancelling
    out[8:10, :, 3], out[8:10, :, 9] = mag, -mag
    out[:4] = torch.randn(4, 2, 64, generator=g).half()  # rows in range
    delta = row_dot(dout, out)
    x = stand_in(dout, delta)
    assert torch.isfinite(x).all()
    got = (dout.double() * x.double()).sum(-1)
    top2 = dout.double().abs().topk(2, dim=-1).values
    over = (delta / top2[..., 0]).half().isinf()
    assert over[4:8].all() and over[8:10].all() == (mag > 32752) and not over[:4].any()
    share = delta.double() / dout.double().abs().sum(-1)
    bound = 2.0**-11 * share.abs() * top2[..., 1]  # a rounding of the second entry's value
    assert ((got - delta.double()).abs() <= bound)[over].all()
    scale = (dout.double() * out.double()).abs().sum(-1)
    assert ((got - delta.double()).abs() / scale)[~over].max() <= PRECISION[torch.float16]
    assert ((x != 0).sum(-1) <= 2)[~over].all()
    assert torch.equal(x[6:8, :, 5:7], torch.zeros_like(x[6:8, :, 5:7]))  # sign(+-0) * share


@pytest.mark.parametrize("dv", [64, 128])
def test_stand_in_of_rows_at_the_fp16_maximum(dv):
    """Outputs at fp16's largest values (65472 and 65504) under a flat ``dout``: the share,
    rounded down, leaves more than the top entry can take; the two entries saturate at 65504
    instead of overflowing (they did: dq and dk NaN again), and the term misses by at most a
    rounding of the share (2^-11 of the row's magnitude)."""
    g = torch.Generator().manual_seed(4)
    sign = torch.randn(64, 1, dv, generator=g).sign()
    dout = (sign * (1 + 0.01 * torch.randn(64, 1, dv, generator=g))).half()
    out = sign * torch.where(torch.rand(64, 1, dv, generator=g) < 0.5, 65472.0, 65504.0)
    delta = row_dot(dout, out.half())
    x = stand_in(dout, delta)
    assert torch.isfinite(x).all()
    got = (dout.double() * x.double()).sum(-1)
    scale = (dout.double() * out.double()).abs().sum(-1)
    assert ((got - delta.double()).abs() / scale).max() <= 2.0**-11


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gradients_match_the_moved_output(dtype):
    """Values almost alike over the keys make ``dout . v`` nearly constant, so the backward's
    ``dP - delta`` cancels: an error of the 16-bit rounding in delta would show there (one
    entry does, by 20-30 %); the stand-in's gradients are as far from fp64 as the output's."""
    g = torch.Generator().manual_seed(1)
    t, h, d = 384, 4, 64
    cu = torch.tensor([0, 250, t], dtype=torch.int32)
    q, k, dout = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    v = 1.0 + 0.05 * torch.randn(t, h, d, generator=g, dtype=torch.float64)
    args = (cu, cu, 250, 250, True, (-1, -1), d**-0.5)
    o64, lse64 = reference.attn_fwd(q, k, v, *args)
    want = reference.attn_bwd(dout, q, k, v, o64, lse64, *args)
    qb, kb, vb, db = (x.to(dtype) for x in (q, k, v, dout))
    out, lse = reference.attn_fwd(qb, kb, vb, *args)
    out = out.to(dtype)
    moved = reference.attn_bwd(db, qb, kb, vb, out, lse, *args)
    standin = reference.attn_bwd(db, qb, kb, vb, stand_in(db, row_dot(db, out)), lse, *args)
    for a, b, w in zip(moved, standin, want):
        err_moved = (a.double() - w).norm() / w.norm()
        err_stand = (b.double() - w).norm() / w.norm()
        assert err_stand <= 1.01 * err_moved, (err_stand, err_moved)


_SENT = threading.local()


def _counting(orig):
    def a2a_flat(flat, send_sizes, recv_sizes, group):
        me = dist.get_rank(group)
        _SENT.bytes = getattr(_SENT, "bytes", 0) + (sum(send_sizes) - send_sizes[me]) * flat.element_size()
        return orig(flat, send_sizes, recv_sizes, group)

    return a2a_flat


def _counting_runs(orig):
    def exchange(group, sends, recvs, *device):
        _SENT.bytes = getattr(_SENT, "bytes", 0) + sum(m.tensor.numel() * m.tensor.element_size() for m in sends)
        return orig(group, sends, recvs, *device)

    return exchange


def _backward_bytes(rank, world, cu, hq, hkv, dtype, comm="a2a"):
    sharding = mcx.shard_sequences(cu, world)
    t = sharding.num_tokens(rank)
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(t, hq, 16, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(t, hkv, 16, generator=g).to(dtype) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding)
    _SENT.bytes = 0
    out.backward(dout)
    return _SENT.bytes


@pytest.mark.parametrize("groups", [None, 2], ids=["chosen", "two-groups"])
@pytest.mark.parametrize("hq,hkv,dtype", [(8, 4, torch.bfloat16), (4, 1, torch.bfloat16), (8, 2, torch.float32)])
def test_backward_sends_what_inspect_counts(monkeypatch, hq, hkv, dtype, groups):
    """No output-sized all-to-all: dout and the row terms out, dq and dK/dV home (replicated KV
    heads also move the saved k and v again, and send dK/dV home in fp32) — the bytes the plan
    report and the ``auto`` estimate price."""
    monkeypatch.setattr(heads, "_a2a_flat", _counting(heads._a2a_flat))
    monkeypatch.setattr(route, "_exchange", _counting_runs(route._exchange))
    monkeypatch.setattr(a2a_groups, "GROUPS", groups)
    cu = np.cumsum([0, 200, 37, 0, 90, 185]).tolist()
    world = 4
    got = run_threads(world, _backward_bytes, cu, hq, hkv, dtype, timeout=120)
    rep = mcx.inspect_plan(
        mcx.shard_sequences(cu, world), "a2a", num_heads=hq, num_kv_heads=hkv, head_dim=16, dtype=dtype
    )
    assert got == [rep.ranks[r].bytes_sent["backward"] for r in range(world)]


@pytest.mark.parametrize("groups", [None, 2], ids=["chosen", "two-groups"])
@pytest.mark.parametrize("hq,hkv,dtype", [(8, 4, torch.bfloat16), (4, 1, torch.float32)])
def test_hierarchical_all_to_alls_send_what_inspect_counts(monkeypatch, hq, hkv, dtype, groups):
    """a2a+p2p (a2a groups of 2 at cp 4): its all-to-alls' backward bytes equal the plan
    report's a2a step (the ring's messages are counted apart, by its ring steps)."""
    monkeypatch.setattr(heads, "_a2a_flat", _counting(heads._a2a_flat))
    monkeypatch.setattr(route, "_exchange", _counting_runs(route._exchange))
    monkeypatch.setattr(a2a_groups, "GROUPS", groups)
    cu = np.cumsum([0, 200, 37, 0, 90, 185]).tolist()
    got = run_threads(4, _backward_bytes, cu, hq, hkv, dtype, "a2a+p2p", timeout=120)
    rep = mcx.inspect_plan(
        mcx.shard_sequences(cu, 4), "a2a+p2p", a2a_size=2, num_heads=hq, num_kv_heads=hkv, head_dim=16, dtype=dtype
    )
    want = [sum(s.bytes_sent["backward"] for s in rep.ranks[r].steps if s.kind == "a2a") for r in range(4)]
    assert got == want
