"""The FlashAttention-4 candidate (``backends/fa4.py``, ``flash_attn.cute``) against the exact
reference: every mask of the contract, bf16 and fp16, GQA/MQA/MLA (MLA with GQA falls back on
Hopper), documents of length 0 and 1, query entries longer than their key entries (rows that
see no key); every comm type with FA4 as the picked kernel against dense fp64; no host sync;
kernel configurations met once, not per micro-batch. The cases are the cuDNN candidate's."""

import dataclasses
import random

import pytest
import torch

from megatron_cp_ext import backends
from megatron_cp_ext.backends import fa4, pick, reference
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fa4.available(), reason="flash-attn-4 not installed (or not a Hopper/Blackwell GPU)"),
]

from test_cudnn_backend import HEADS, RING, SAME, _args, _cases, _close, _comm_cases, _inputs  # noqa: E402


@pytest.mark.parametrize("call,dtype,heads,lens", list(_cases()), ids=str)
def test_matches_reference(call, dtype, heads, lens):
    lens_q, lens_k = RING if lens == "ring" else SAME
    q, k, v = _inputs(lens_q, lens_k, HEADS[heads], dtype)
    args = _args(lens_q, lens_k, call, shared=lens == "shared")
    up = [x.float() for x in (q, k, v)]
    ref_out, ref_lse = reference.attn_fwd(*up, *args)
    out, lse = fa4.attn_fwd(q, k, v, *args)
    assert out.shape == ref_out.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "rows that see no key must read 0, never NaN"
    _close(out, ref_out, 2e-2)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key carry lse -inf, the others a finite lse"
    if seen.any():
        _close(lse[seen], ref_lse[seen], 1e-3)
    dout = torch.randn_like(ref_out).to(dtype)
    want = reference.attn_bwd(dout.float(), *up, ref_out, ref_lse, *args)
    got = fa4.attn_bwd(dout, q, k, v, ref_out.to(dtype), ref_lse, *args)
    for x, w, name in zip(got, want, ("dq", "dk", "dv"), strict=True):
        assert x.shape == w.shape and torch.isfinite(x).all(), name
        _close(x, w, 5e-2)


def test_no_sync_and_configs_reused():
    """Calls after the first of each configuration: no host sync, no new configuration over 20
    random micro-batches of whole-batch calls."""
    rng = random.Random(0)
    shape = HEADS["gqa"]
    q, k, v = _inputs([4096], [4096], shape, torch.bfloat16)
    for lens in ([4096], [1000, 3096]):
        args = _args(lens, lens, "causal")
        o, lse = fa4.attn_fwd(q, k, v, *args)
        fa4.attn_bwd(o, q, k, v, o, lse, *args)
    batches = []
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 4096), 5))
        batches.append(_args([b - a for a, b in zip([0, *cuts], [*cuts, 4096], strict=True)], [4096], "causal"))
    before = fa4.compile_counts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for cu_q, _, mq, _, causal, window, sc in batches:  # cu_seqlens built before: a host copy
            o, lse = fa4.attn_fwd(q, k, v, cu_q, cu_q, mq, mq, causal, window, sc)
            fa4.attn_bwd(o, q, k, v, o, lse, cu_q, cu_q, mq, mq, causal, window, sc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fa4.compile_counts() == before


@pytest.mark.parametrize("comm_type,a2a_size,world,mask", list(_comm_cases()), ids=str)
def test_every_comm_type_with_fa4_picked(monkeypatch, comm_type, a2a_size, world, mask):
    """``backend="auto"`` with FA4 picked for every call (CP 1: every mask; CP 2 and 4 of every
    comm type: causal and a two-sided window), vs dense fp64."""
    monkeypatch.setenv("MCX_KERNEL", "fa4")
    monkeypatch.setattr(backends, "_PICKERS", {})
    ran = []
    kern = pick.KERNELS["fa4"]
    rec = lambda *a: (ran.append(1), kern.fwd(*a))[1]  # noqa: E731
    monkeypatch.setitem(pick.KERNELS, "fa4", dataclasses.replace(kern, fwd=rec))
    case = AttnCase(seqlens=(300, 0, 1, 97, 513, 2, 130), comm_type=comm_type, a2a_size=a2a_size, hq=8, hkv=2,
                    d=64, dv=64, dtype="bfloat16", device="cuda", balance="workload", **mask)  # fmt: skip
    runs = [run_case(0, 1, case)] if world == 1 else run_threads(world, run_case, case, device="cuda", timeout=120)
    check_case(runs, case)
    assert ran, "FA4 never ran"
