"""The GPU varlen backend against the exact reference backend, on the calls plans emit.

Needs a CUDA device (skipped elsewhere). Exercises causal, full and windowed calls with
bottom-right alignment (sk >= sq), GQA and MLA (padded V), forward and backward.
"""

import math

import pytest
import torch

from megatron_cp_ext.backends import flash, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


WINDOWS = [(True, (-1, 0)), (False, (-1, -1)), (True, (7, 0)), (False, (5, -1)), (False, (-1, 6)), (False, (3, 4))]


@pytest.mark.parametrize("causal, window", WINDOWS)
@pytest.mark.parametrize("hq, hkv, d, dv", [(8, 8, 64, 64), (8, 2, 128, 128), (8, 1, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_matches_reference(causal, window, hq, hkv, d, dv, dtype):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lq, lk = [97, 1, 256, 33], [97, 5, 300, 33]  # sk >= sq per entry, odd sizes
    cu_q = torch.tensor([0, *lq], device=dev).cumsum(0).int()
    cu_k = torch.tensor([0, *lk], device=dev).cumsum(0).int()
    q = torch.randn(sum(lq), hq, d, device=dev, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, device=dev, dtype=dtype)
    v = torch.randn(sum(lk), hkv, dv, device=dev, dtype=dtype)
    args = (cu_q, cu_k, max(lq), max(lk), causal, window, 1 / math.sqrt(d))
    out, lse = flash.attn_fwd(q, k, v, *args)
    ref_out, ref_lse = reference.attn_fwd(q, k, v, *args)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    dout = torch.randn_like(out)
    got = flash.attn_bwd(dout, q, k, v, out, lse, *args)
    want = reference.attn_bwd(dout, q, k, v, ref_out, ref_lse, *args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=0)


@pytest.mark.parametrize("tensor", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("causal, window", [(True, (-1, 0)), (False, (5, -1))])
def test_flash_nan_stays_in_its_entry(tensor, causal, window):
    """As tests/L0/test_nan_isolation.py for the reference backend: a NaN row in one entry
    changes nothing in the others (flash kernels compute entries separately)."""
    dev = torch.device("cuda")
    lq, lk = [97, 1, 256, 33], [97, 5, 300, 33]
    cu_q = torch.tensor([0, *lq], device=dev).cumsum(0).int()
    cu_k = torch.tensor([0, *lk], device=dev).cumsum(0).int()
    args = (cu_q, cu_k, max(lq), max(lk), causal, window, 0.125)
    results = []
    for poison in (False, True):
        g = torch.Generator(device=dev).manual_seed(0)
        x = {
            "q": torch.randn(sum(lq), 8, 64, device=dev, generator=g),
            "k": torch.randn(sum(lk), 2, 64, device=dev, generator=g),
            "v": torch.randn(sum(lk), 2, 32, device=dev, generator=g),
            "dout": torch.randn(sum(lq), 8, 32, device=dev, generator=g),
        }
        x = {n: t.to(torch.bfloat16) for n, t in x.items()}
        if poison:  # entry 2, one row in its middle
            cu = cu_q if tensor in ("q", "dout") else cu_k
            x[tensor][int(cu[2]) + 50] = float("nan")
        out, lse = flash.attn_fwd(x["q"], x["k"], x["v"], *args)
        results.append((out, lse, *flash.attn_bwd(x["dout"], x["q"], x["k"], x["v"], out, lse, *args)))
    keep_q = torch.ones(sum(lq), dtype=torch.bool, device=dev)
    keep_q[int(cu_q[2]) : int(cu_q[3])] = False
    keep_k = torch.ones(sum(lk), dtype=torch.bool, device=dev)
    keep_k[int(cu_k[2]) : int(cu_k[3])] = False
    for i, rows in enumerate((keep_q, keep_q, keep_q, keep_k, keep_k)):
        clean, poisoned = results[0][i][rows].float(), results[1][i][rows].float()
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, atol=1e-2, rtol=0)  # dq may use atomics
