"""The cuDNN candidate (``backends/cudnn.py``, cudnn-frontend graphs) against the exact reference:
every mask of the contract, bf16 and fp16, GQA/MQA/MLA, documents of length 0 and 1, query
entries longer than their key entries (rows that see no key), equal entries given as one tensor
(the band anchored top-left) or two (bottom-right); every comm type with cuDNN as
the picked kernel against dense fp64; no host sync; graphs reused across calls; a refused
graph falls back to the flash kernels."""

import dataclasses
import logging

import pytest
import torch

from megatron_cp_ext import backends
from megatron_cp_ext.backends import cudnn, pick, reference
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not cudnn.available(), reason="cudnn-frontend (>= cuDNN 9.10.2) not installed"),
]

SAME = ([0, 1, 97, 513, 1, 133, 0], [0, 1, 97, 513, 1, 133, 0])  # lengths 0 and 1 included
RING = ([50, 0, 7, 1, 64], [13, 5, 7, 0, 200])  # more queries than keys, keys with no query, none
CALLS = {  # contract (causal, window)
    "causal": (True, (-1, 0)),
    "nomask": (False, (-1, -1)),
    "left": (True, (50, 0)),
    "bidir": (False, (33, 20)),
    "right": (False, (-1, 9)),
    "diag": (False, (0, 0)),
    "left-open": (False, (5, -1)),
}
HEADS = {"gqa": (8, 2, 64, 64), "mqa": (8, 1, 128, 128), "mla": (8, 2, 192, 128), "mha": (4, 4, 64, 64)}


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)


def _inputs(lens_q, lens_k, heads, dtype, seed=0):
    hq, hk, d, dv = heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, dv, device="cuda", generator=g).to(dtype)
    return q, k, v


def _args(lens_q, lens_k, call, shared=False):
    """``shared``: one tensor for both sides (the plans' way of saying equal entries: top-left)."""
    causal, window = CALLS[call]
    cu_q = _cu(lens_q)
    return (cu_q, cu_q if shared else _cu(lens_k), max(lens_q), max(lens_k), causal, window, 0.125)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)


def _cases():
    """Every mask on both layouts with GQA bf16; every head layout and fp16 on causal, unmasked
    and a two-sided window (a graph per geometry: the matrix stays within a few dozen)."""
    for call in CALLS:
        for lens in ("same", "shared", "ring"):
            yield call, torch.bfloat16, "gqa", lens
    for call in ("causal", "nomask", "bidir"):
        for heads in ("mqa", "mla", "mha"):
            yield call, torch.bfloat16, heads, "ring"
        yield call, torch.float16, "gqa", "ring"


def check_candidate(mod, call, dtype, heads, lens) -> None:
    """A candidate module's forward and backward against the reference on one case (also the
    FA4 candidate's test)."""
    lens_q, lens_k = RING if lens == "ring" else SAME
    q, k, v = _inputs(lens_q, lens_k, HEADS[heads], dtype)
    args = _args(lens_q, lens_k, call, shared=lens == "shared")
    up = [x.float() for x in (q, k, v)]
    ref_out, ref_lse = reference.attn_fwd(*up, *args)
    out, lse = mod.attn_fwd(q, k, v, *args)
    assert out.shape == ref_out.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "rows that see no key must read 0, never NaN"
    _close(out, ref_out, 2e-2)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key carry lse -inf, the others a finite lse"
    assert (lse[~seen] == float("-inf")).all()
    if seen.any():
        _close(lse[seen], ref_lse[seen], 1e-3)
    dout = torch.randn_like(ref_out).to(dtype)
    want = reference.attn_bwd(dout.float(), *up, ref_out, ref_lse, *args)
    got = mod.attn_bwd(dout, q, k, v, ref_out.to(dtype), ref_lse, *args)
    for x, w, name in zip(got, want, ("dq", "dk", "dv")):
        assert x.shape == w.shape and torch.isfinite(x).all(), name
        _close(x, w, 5e-2)


@pytest.mark.parametrize("call,dtype,heads,lens", list(_cases()), ids=str)
def test_matches_reference(call, dtype, heads, lens):
    check_candidate(cudnn, call, dtype, heads, lens)


def test_no_sync_and_graphs_reused():
    """A second call of the same geometry builds nothing and never syncs; a call whose entries
    and lengths fall in the same buckets reuses the graphs too."""
    lens = [300, 0, 1, 97, 513, 2, 130]
    q, k, v = _inputs(lens, lens, HEADS["gqa"], torch.bfloat16)
    args = _args(lens, lens, "causal")
    out, lse = cudnn.attn_fwd(q, k, v, *args)
    cudnn.attn_bwd(out, q, k, v, out, lse, *args)
    torch.cuda.synchronize()
    before = cudnn.graph_counts()
    lens2 = [290, 5, 1, 97, 520, 2, 128]  # same buckets: 7 entries -> 8, longest -> 640, tokens -> 1280
    q2, k2, v2 = _inputs(lens2, lens2, HEADS["gqa"], torch.bfloat16, seed=1)
    args2 = _args(lens2, lens2, "causal")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in ((q, k, v, args), (q2, k2, v2, args2)):
            out, lse = cudnn.attn_fwd(*x[:3], *x[3])
            cudnn.attn_bwd(out, *x[:3], out, lse, *x[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = cudnn.graph_counts()
    assert (after["fwd"], after["bwd"]) == (before["fwd"], before["bwd"]), (before, after)


def test_refused_graph_falls_back(monkeypatch, caplog):
    """A geometry cuDNN refuses runs on the flash kernels, logged once."""
    lens = [40, 3, 77]
    q, k, v = _inputs(lens, lens, HEADS["gqa"], torch.bfloat16)
    args = _args(lens, lens, "bidir")

    def refuse(*a, **kw):
        raise RuntimeError("not supported (test)")

    monkeypatch.setattr(cudnn, "_build", refuse)
    monkeypatch.setattr(cudnn, "_GRAPHS", {})
    with caplog.at_level(logging.WARNING, logger="megatron_cp_ext.kernels"):
        out, lse = cudnn.attn_fwd(q, k, v, *args)
        cudnn.attn_fwd(q, k, v, *args)
    assert sum("graph refused" in r.getMessage() for r in caplog.records) == 1
    ref_out, _ = reference.attn_fwd(q.float(), k.float(), v.float(), *args)
    _close(out, ref_out, 2e-2)


COMMS = [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)]
MASKS = [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(64, -1)),
         dict(causal=False, window_size=(40, 17)), dict(causal=True, chunk_size=128)]  # fmt: skip


def _comm_cases():
    for mask in MASKS:
        yield "p2p", 0, 1, mask
    for comm_type, a2a_size in COMMS:
        for world in (2, 4):
            for mask in (MASKS[0], MASKS[3]):
                yield comm_type, a2a_size, world, mask


def run_with_picked(monkeypatch, name: str, comm_type, a2a_size, world, mask) -> None:
    """``backend="auto"`` with candidate ``name`` picked for every call, vs dense fp64 (also
    the FA4 candidate's test)."""
    monkeypatch.setenv("MCX_KERNEL", name)
    monkeypatch.setattr(backends, "_PICKERS", {})
    ran = []
    kern = pick.KERNELS[name]
    rec = lambda *a: (ran.append(1), kern.fwd(*a))[1]  # noqa: E731
    monkeypatch.setitem(pick.KERNELS, name, dataclasses.replace(kern, fwd=rec))
    case = AttnCase(seqlens=(300, 0, 1, 97, 513, 2, 130), comm_type=comm_type, a2a_size=a2a_size, hq=8, hkv=2,
                    d=64, dv=64, dtype="bfloat16", device="cuda", balance="workload", **mask)  # fmt: skip
    runs = [run_case(0, 1, case)] if world == 1 else run_threads(world, run_case, case, device="cuda", timeout=120)
    check_case(runs, case)
    assert ran, f"{name} never ran"


@pytest.mark.parametrize("comm_type,a2a_size,world,mask", list(_comm_cases()), ids=str)
def test_every_comm_type_with_cudnn_picked(monkeypatch, comm_type, a2a_size, world, mask):
    """CP 1: every mask; CP 2 and 4 of every comm type: causal and a two-sided window."""
    run_with_picked(monkeypatch, "cudnn", comm_type, a2a_size, world, mask)
