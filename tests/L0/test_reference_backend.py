"""The CPU reference backend against dense softmax attention, forward and backward."""

import math

import pytest
import torch

from megatron_cp_ext.backends import get_backend, reference
from megatron_cp_ext.testing.reference import dense_attention


def _dense_entrywise(q, k, v, cu_q, cu_k, causal, window, scale):
    """Per entry, plain softmax with an explicit bottom-right aligned mask (float64)."""
    outs = []
    g = q.shape[1] // k.shape[1]
    for e in range(len(cu_q) - 1):
        qe, ke, ve = q[cu_q[e] : cu_q[e + 1]], k[cu_k[e] : cu_k[e + 1]], v[cu_k[e] : cu_k[e + 1]]
        sq, sk = qe.shape[0], ke.shape[0]
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        m = torch.ones(sq, sk, dtype=torch.bool)
        right = 0 if causal else window[1]
        if right >= 0:
            m &= j <= i + sk - sq + right
        if window[0] >= 0:
            m &= j >= i + sk - sq - window[0]
        s = torch.einsum("nhd,mhd->hnm", qe, ke.repeat_interleave(g, 1)) * scale
        p = torch.softmax(s.masked_fill(~m, float("-inf")), -1)
        outs.append(torch.einsum("hnm,mhd->nhd", p, ve.repeat_interleave(g, 1)))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 4)), (False, (5, -1))]
)
@pytest.mark.parametrize("hq, hkv, d, dv", [(4, 4, 16, 16), (6, 2, 8, 8), (4, 1, 12, 5)])
def test_reference_matches_dense(causal, window, hq, hkv, d, dv):
    torch.manual_seed(0)
    cu_q, cu_k = [0, 5, 6, 17], [0, 9, 10, 30]  # sk >= sq per entry, odd sizes
    q = torch.randn(cu_q[-1], hq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, dv, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(d)
    args = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 11, 20, causal, window, scale)
    out, lse = reference.attn_fwd(q.detach(), k.detach(), v.detach(), *args)
    want = _dense_entrywise(q, k, v, cu_q, cu_k, causal, window, scale)
    torch.testing.assert_close(out, want.detach(), atol=1e-10, rtol=0)
    assert lse.dtype == torch.float64 and lse.shape == (cu_q[-1], hq)  # fp64 in, fp64 lse
    dout = torch.randn_like(want)
    gq, gk, gv = torch.autograd.grad(want, (q, k, v), dout)
    dq, dk, dv_ = reference.attn_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, *args)
    for got, ref in ((dq, gq), (dk, gk), (dv_, gv)):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)  # computed in fp64 end to end


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_reference_dtypes(dtype, tol):
    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, 2, 8) for _ in range(3))
    out, lse = reference.attn_fwd(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, 13, 13, True, (-1, -1), 0.3)
    want = dense_attention(q.to(dtype), k.to(dtype), v.to(dtype), [0, 7, 20], causal=True, softmax_scale=0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)


def test_reference_refuses_inexpressible_calls():
    x = torch.randn(4, 1, 2)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(AssertionError):
        reference.attn_fwd(x, x, x, cu, cu, 4, 4, False, (-3, -1), 1.0)
    with pytest.raises(AssertionError):
        reference.attn_fwd(x, x, x, cu, cu, 4, 4, True, (-1, 2), 1.0)


def test_backend_selection():
    assert get_backend(torch.device("cpu")) is reference
    with pytest.raises(ValueError, match="backend"):
        get_backend(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="CUDA"):
        get_backend(torch.device("cpu"), "flash")
