"""What the FlashAttention-4 candidate (``backends/fa4.py``) hands ``flash_attn.cute``, checked on CPU.

FA4's documented varlen semantics are emulated here, independently of the reference: its
resolution of ``causal`` and the window sides (a side is an int or None; both sides negative
read as no window, one negative side is taken literally), its bottom-right mask per entry
(query ``i`` of ``sq`` over ``sk`` keys sees ``i + sk - sq - left`` to ``i + sk - sq + right``),
output 0 and lse ``-inf`` for a row that sees no key, lse ``(H, total_q)`` fp32, and a backward
from the given out and lse. The wrapper runs on this emulation in place of the CUDA kernels and
must give the reference backend's outputs, lse and gradients on random calls: any lengths, 0
and 1 included, queries without keys and keys without queries, every window, GQA/MQA/MLA.
Kernel configurations: none new after the first of 50 random micro-batches. A refused call
falls back with one logged line; the pick passes over an absent or unfit candidate.
"""

import logging
import random
import types

import pytest
import torch

from megatron_cp_ext.backends import fa4, pick, reference
from megatron_cp_ext.backends import fa4_args as fa
from megatron_cp_ext.testing.reference import ENTRY_WINDOWS, entry_band, random_call

WINDOWS = ENTRY_WINDOWS


def _resolve(causal, left, right):
    """FA4's own resolution of the mask arguments (as its interface documents and does)."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right is None:
        return False, None, None
    if left is None and right == 0:
        return True, None, None
    return False, left, right


def _visible(sq, sk, causal, left, right):
    causal, left, right = _resolve(causal, left, right)
    d = torch.arange(sk)[None] - (torch.arange(sq)[:, None] + sk - sq)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= d <= 0
    if left is not None:
        vis &= d >= -left
    if right is not None:
        vis &= d <= right
    return vis


def test_mask_is_the_contract_mask():
    for (sq, sk), causal, window in [
        (s, c, w) for s in [(50, 13), (13, 50), (1, 7), (7, 1), (30, 30)] for c in (True, False) for w in WINDOWS
    ]:
        if causal and window[1] not in (-1, 0):
            continue
        m = fa.mask(causal, window)
        assert torch.equal(_visible(sq, sk, m.causal, m.left, m.right), entry_band(sq, sk, causal, window))
    # the contract's -1 passed as is would be taken literally by FA4: one-sided windows differ
    assert not torch.equal(_visible(20, 20, False, -1, 3), entry_band(20, 20, False, (-1, 3)))
    assert fa.mask(False, (-1, 3)) == fa.Mask(causal=False, left=None, right=3)
    assert fa.mask(True, (7, 0)) == fa.Mask(causal=True, left=7, right=0)


def _scores(q, k, qs, ks, causal, left, right, scale):
    g = q.shape[1] // k.shape[1]
    qh = q[qs].double().transpose(0, 1)
    kh = k[ks].double().repeat_interleave(g, 1).transpose(0, 1)
    vis = _visible(qh.shape[1], kh.shape[1], causal, left, right)
    return torch.where(vis, scale * qh @ kh.transpose(1, 2), float("-inf"))


def _entries(cu_q, cu_k):
    for b in range(cu_q.numel() - 1):
        yield slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def _fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
         window_size_left, window_size_right, return_lse):  # fmt: skip
    assert return_lse and q.dtype == k.dtype == v.dtype and cu_seqlens_q.dtype == torch.int32
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    g = q.shape[1] // k.shape[1]
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    for qs, ks in _entries(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start:
            continue
        s = _scores(q, k, qs, ks, causal, window_size_left, window_size_right, softmax_scale)
        m = torch.logsumexp(s, -1)  # [H, lq]; -inf where a row sees nothing
        p = torch.exp(s - torch.where(torch.isfinite(m), m, 0)[..., None])
        vh = v[ks].double().repeat_interleave(g, 1).transpose(0, 1)
        out[qs] = (p @ vh).transpose(0, 1).to(q.dtype)  # 0 where a row sees nothing
        lse[:, qs] = m.float()
    return out, lse, None, None, None


def _bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, window_size_left, window_size_right, cu_seqlens_q,
         cu_seqlens_k, max_seqlen_q, max_seqlen_k):  # fmt: skip
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.dtype == dout.dtype == q.dtype
    g, hk = q.shape[1] // k.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks in _entries(cu_seqlens_q, cu_seqlens_k):
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        s = _scores(q, k, qs, ks, causal, window_size_left, window_size_right, softmax_scale)
        row = lse[:, qs].double()
        p = torch.exp(s - torch.where(torch.isfinite(row), row, 0)[..., None])  # -inf rows: all masked
        do, o = dout[qs].double().transpose(0, 1), out[qs].double().transpose(0, 1)
        vh = v[ks].double().repeat_interleave(g, 1).transpose(0, 1)
        kh = k[ks].double().repeat_interleave(g, 1).transpose(0, 1)
        ds = p * (do @ vh.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        dq[qs] = (softmax_scale * ds @ kh).transpose(0, 1).to(q.dtype)
        fold = lambda x: x.unflatten(0, (hk, g)).sum(1).transpose(0, 1)  # noqa: E731 - GQA heads add up
        dk[ks] = fold(softmax_scale * ds.transpose(1, 2) @ q[qs].double().transpose(0, 1)).to(k.dtype)
        dv[ks] = fold(p.transpose(1, 2) @ do).to(v.dtype)
    return dq, dk, dv


@pytest.fixture
def emulated(monkeypatch):
    """``fa4`` running on the emulation instead of ``flash_attn.cute``."""
    monkeypatch.setattr(fa4, "_interface", lambda: types.SimpleNamespace(_flash_attn_fwd=_fwd, _flash_attn_bwd=_bwd))
    monkeypatch.setattr(fa4, "_SEEN", set())
    monkeypatch.setattr(fa4, "_REFUSED", set())


def _call(rng: random.Random):
    heads = [(4, 2, 16, 16), (4, 1, 24, 24), (2, 2, 24, 16), (2, 2, 8, 8)]  # MLA without GQA: Hopper's rule
    lens_q, lens_k, _, causal, window, heads = random_call(rng, heads)
    return lens_q, lens_k, causal, window, heads


def test_emulated_fa4_matches_reference(emulated):
    rng, scale = random.Random(11), 0.3
    for trial in range(40):
        lens_q, lens_k, causal, window, (hq, hk, d, dv) = _call(rng)
        g = torch.Generator().manual_seed(trial)
        q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
        k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64)
        v = torch.randn(sum(lens_k), hk, dv, generator=g, dtype=torch.float64)
        cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
        args = (cu_q, cu_k, max(max(lens_q), 1), max(max(lens_k), 1), causal, window, scale)
        ref_out, ref_lse = reference.attn_fwd(q, k, v, *args)
        out, lse = fa4.attn_fwd(q, k, v, *args)
        assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
        torch.testing.assert_close(out, ref_out, atol=1e-9, rtol=0, msg=f"trial {trial}: out")
        assert torch.equal(lse == float("-inf"), ref_lse == float("-inf")), f"trial {trial}: empty rows"
        seen = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=1e-5, rtol=0)
        dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
        want = reference.attn_bwd(dout, q, k, v, ref_out, ref_lse, *args)
        got = fa4.attn_bwd(dout, q, k, v, ref_out, ref_lse.float(), *args)
        for x, w, name in zip(got, want, ("dq", "dk", "dv"), strict=True):
            assert x.shape == w.shape, name
            torch.testing.assert_close(x.double(), w.double(), atol=1e-4, rtol=0, msg=f"trial {trial}: {name}")
    assert fa4.compile_counts()["refused"] == 0


def test_contract_lse_maps_infinities():
    lse_HT = torch.tensor([[1.0, float("inf"), float("-inf")], [float("nan"), -2.0, 3.0]])
    got = fa.contract_lse(lse_HT)
    assert got.shape == (3, 2) and got[0, 0] == 1 and got[1, 0] == got[2, 0] == float("-inf")
    assert torch.isnan(got[0, 1]) and got[2, 1] == 3
    assert got.is_contiguous() and got.dtype == torch.float32  # what the merges' CUDA kernel takes
    back = fa.kernel_lse(got)
    assert back.is_contiguous() and back.shape == (2, 3) and back[0, 2] == float("-inf")


def test_configs_do_not_follow_lengths():
    """What a compile depends on holds no length or window size: 50 random micro-batches of
    whole-batch and ring-step calls meet their configurations in the first one."""
    rng, seen, new = random.Random(3), set(), []
    for _ in range(50):
        before = len(seen)
        for bwd in (False, True):
            for causal, window in ((True, (-1, 0)), (False, (-1, -1)), (True, (rng.randrange(1, 4000), 0))):
                seen.add(fa.compile_config(bwd=bwd, dtype=torch.bfloat16, d=128, dv=128, gqa=4, causal=causal,
                                           window=window))  # fmt: skip
        new.append(len(seen) - before)
    assert new[0] == 6 and sum(new[1:]) == 0, new


def test_supports_and_pick():
    assert fa.supports(torch.bfloat16, 128, 128, 4) and fa.supports(torch.float16, 192, 128, 1)
    assert not fa.supports(torch.bfloat16, 192, 128, 4)  # Hopper's GQA backward needs d == dv
    assert fa.supports(torch.bfloat16, 192, 128, 4, hopper=False)
    assert not fa.supports(torch.float32, 64, 64, 1) and not fa.supports(torch.bfloat16, 264, 264, 1)
    assert not fa.supports(torch.bfloat16, 60, 60, 1)
    shape = pick.CallShape(dtype="bf16", d=128, dv=128, mask="causal", gqa=4, tokens=4096, max_seqlen=1024)
    table = {"devices": {"H100": {"rules": [{"kernel": "fa4"}]}}}
    assert pick.pick("H100", shape, {"fa4", "aten_flash"}, table) == "fa4"
    name, why = pick.pick_why("H100", shape, {"aten_flash"}, table)  # fa4 absent
    assert name == "aten_flash" and "fa4" in why and "not available" in why
    mla = pick.CallShape(dtype="bf16", d=192, dv=128, mask="causal", gqa=4, tokens=4096, max_seqlen=1024)
    name, why = pick.pick_why("H100", mla, {"fa4", "cudnn"}, {"devices": {"H100": {"rules": [{"kernel": "fa4"}]}}},
                              first="fa4")  # fmt: skip
    assert name != "fa4" and "cannot express" in why


@pytest.mark.parametrize("error", [AssertionError, TypeError])
def test_refused_call_falls_back_once(emulated, monkeypatch, caplog, error):
    """FA4 refusing a configuration (an assertion in its interface, or an installed release
    whose interface takes other arguments) sends the call, and every later call of that
    configuration, to the fallback with one logged line."""

    def refuse(*a, **kw):
        raise error("not supported here")

    monkeypatch.setattr(
        fa4, "_interface", lambda: types.SimpleNamespace(_flash_attn_fwd=refuse, _flash_attn_bwd=refuse)
    )
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 6, 12], dtype=torch.int32)
    args = (cu_q, cu_k, 6, 6, True, (-1, 0), 0.3)
    with caplog.at_level(logging.WARNING, logger="megatron_cp_ext.kernels"):
        for _ in range(3):
            out, lse = fa4.attn_fwd(q, k, v, *args)
    want, want_lse = reference.attn_fwd(q, k, v, *args)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())
    assert sum("fa4 candidate: call refused" in r.message for r in caplog.records) == 1
    assert fa4.compile_counts() == {"fwd": 1, "bwd": 0, "refused": 1}


def test_deterministic_backward(emulated, monkeypatch, caplog):
    """Under ``torch.use_deterministic_algorithms`` the backward asks FA4 for its deterministic
    kernel; an FA4 without one sends only those calls to the fallback (one logged line), and
    the same configuration without the flag still runs on FA4."""
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 6, 12], dtype=torch.int32)
    args = (cu_q, cu_k, 6, 6, True, (-1, 0), 0.3)
    out, lse = reference.attn_fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    want = reference.attn_bwd(dout, q, k, v, out, lse, *args)
    calls = []

    def fa4_bwd(*a, deterministic: bool = False, **kw):
        calls.append(deterministic)
        return _bwd(*a, **kw)

    def old_bwd(*a, **kw):
        calls.append("old")
        return _bwd(*a, **kw)

    was = torch.are_deterministic_algorithms_enabled()
    try:
        for bwd in (fa4_bwd, old_bwd):
            monkeypatch.setattr(fa4, "_interface", lambda b=bwd: types.SimpleNamespace(_flash_attn_bwd=b))
            monkeypatch.setattr(fa4, "_REFUSED", set())
            calls.clear()
            with caplog.at_level(logging.WARNING, logger="megatron_cp_ext.kernels"):
                caplog.clear()
                torch.use_deterministic_algorithms(True)
                for _ in range(2):
                    got = fa4.attn_bwd(dout, q, k, v, out, lse, *args)
                    for x, w in zip(got, want, strict=True):
                        torch.testing.assert_close(x, w, atol=1e-5, rtol=0)
                torch.use_deterministic_algorithms(False)
                fa4.attn_bwd(dout, q, k, v, out, lse, *args)
            refused = [r for r in caplog.records if "fa4 candidate: call refused" in r.message]
            if bwd is fa4_bwd:
                assert calls == [True, True, False] and not refused
            else:  # no deterministic mode: both deterministic calls fell back, logged once
                assert calls == ["old"] and len(refused) == 1 and "deterministic" in refused[0].message
    finally:
        torch.use_deterministic_algorithms(was)
