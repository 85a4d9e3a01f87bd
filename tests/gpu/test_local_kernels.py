"""Every local kernel candidate against the exact reference backend, call by call, on the calls
real plans emit (CP 1 and the ring steps of CP 2 through the in-process runner): causal, no
mask, windows incl. bidirectional, chunked; GQA, MQA, MLA (Dv != D); bf16/fp16; documents of
length 0, 1 and odd lengths."""

import dataclasses

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import flash, pick, reference
from megatron_cp_ext.testing.inproc import run_threads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CU = [0, 0, 1, 98, 611, 612, 745]  # lengths 0, 1, 97, 513, 1, 133
MASKS = {
    "causal": dict(causal=True),
    "nomask": dict(causal=False),
    "left": dict(causal=True, window_size=(50, -1)),
    "bidir": dict(causal=False, window_size=(33, 20)),
    "right": dict(causal=False, window_size=(-1, 9)),
    "chunked": dict(causal=True, chunk_size=64),
}
HEADS = {"gqa": (8, 2, 64, 64), "mqa": (8, 1, 64, 64), "mla": (8, 2, 96, 64)}


def _candidates() -> dict:
    """``flash`` (what ``backend="flash"`` runs) and every GPU candidate of the pick table here."""
    dev = torch.device("cuda")
    out = {"flash": pick.Kernel(name="flash", fwd=flash.attn_fwd, bwd=flash.attn_bwd, available=lambda d: True,
                                supports=pick.KERNELS["aten_flash"].supports)}  # fmt: skip
    return {**out, **{n: k for n, k in pick.KERNELS.items() if n != "reference" and k.available(dev)}}


def _record(monkeypatch) -> list:
    """Every call the schedules make to the flash backend (args as passed)."""
    calls = []
    f0, b0 = flash.attn_fwd, flash.attn_bwd

    def fwd(*a):
        calls.append(("fwd", a))
        return f0(*a)

    def bwd(*a):
        calls.append(("bwd", a))
        return b0(*a)

    monkeypatch.setattr(flash, "attn_fwd", fwd)
    monkeypatch.setattr(flash, "attn_bwd", bwd)
    return calls


def _layer(rank: int, world: int, mask: dict, heads: tuple, dtype: torch.dtype) -> None:
    import torch.distributed as dist

    hq, hkv, d, dv = heads
    sh = mcx.shard_sequences(CU, world, **mask)
    g = torch.Generator(device="cuda").manual_seed(rank)
    n = sh.num_tokens(rank)
    q, k = (torch.randn(n, h, d, device="cuda", generator=g, dtype=dtype) for h in (hq, hkv))
    v = torch.randn(n, hkv, dv, device="cuda", generator=g, dtype=dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    group = dist.group.WORLD if world > 1 else None
    out = mcx.cp_attention(q, k, v, cp_group=group, comm_type="p2p", sharding=sh, backend="flash", **mask)
    out.backward(torch.randn_like(out))


def _check(name, kern, kind, a) -> None:
    up = lambda x: x.float() if x.is_floating_point() else x  # noqa: E731 - the reference in fp32
    if kind == "fwd":
        q, k, v, *rest = a
        if not kern.supports(pick.call_shape(q, k, v, rest[3], rest[4], rest[5])):
            return  # the pick never sends it this call
        out, lse = kern.fwd(*a)
        # the contract's lse: fp32 [N, H], row-major (the merges' kernel takes nothing else)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2] and lse.is_contiguous(), name
        ref_out, ref_lse = reference.attn_fwd(up(q), up(k), up(v), *rest)
        torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=0)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        assert (lse[~seen] == float("-inf")).all(), "rows that see no key must carry lse -inf"
        if seen.any():
            tol = 1e-3 * max(1.0, ref_lse[seen].abs().max().item())
            torch.testing.assert_close(lse[seen], ref_lse[seen], atol=tol, rtol=0)
    else:
        dout, q, k, v, out, lse, *rest = a
        if not kern.supports(pick.call_shape(q, k, v, rest[3], rest[4], rest[5])):
            return
        got = kern.bwd(*a)
        want = reference.attn_bwd(*(up(x) for x in (dout, q, k, v, out)), lse, *rest)
        for x, w in zip(got, want):
            scale = max(1.0, w.abs().max().item())
            torch.testing.assert_close(x.float(), w, atol=5e-2 * scale, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)  # fp16: test_cp_on_gpu.py, every mask at CP 1
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_candidates_match_reference_call_by_call(monkeypatch, mask, heads, dtype, world):
    calls = _record(monkeypatch)
    if world == 1:
        _layer(0, 1, MASKS[mask], HEADS[heads], dtype)
    else:
        run_threads(world, _layer, MASKS[mask], HEADS[heads], dtype, device="cuda", timeout=120)
    assert any(k == "fwd" for k, _ in calls) and any(k == "bwd" for k, _ in calls)
    monkeypatch.undo()  # replay on the real kernels
    for name, kern in _candidates().items():
        for kind, a in calls:
            _check(name, kern, kind, a)


@pytest.mark.parametrize("mask", ["nomask", "causal", "bidir"])
def test_auto_runs_the_table_pick(tmp_path, monkeypatch, mask):
    """``backend="auto"`` with a table naming cuDNN for every call: cuDNN runs them all (it
    expresses every mask), and the layer matches ``backend="flash"``."""
    if not pick.KERNELS["cudnn"].available(torch.device("cuda")):
        pytest.skip("cudnn-frontend not installed")
    cls = pick.device_class(torch.device("cuda"))
    table = tmp_path / "table.json"
    pick.write_entry(cls, {"source": "test", "rules": [{"kernel": "cudnn"}]}, str(table))
    monkeypatch.setenv("MCX_KERNEL_TABLE", str(table))
    ran = []
    for name in ("cudnn", "aten_flash", "flash_attn"):
        k = pick.KERNELS[name]
        rec = lambda *a, _f=k.fwd, _n=name: (ran.append(_n), _f(*a))[1]  # noqa: E731
        monkeypatch.setitem(pick.KERNELS, name, dataclasses.replace(k, fwd=rec))
    sh = mcx.shard_sequences(CU, 1, **MASKS[mask])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(CU[-1], h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 2, 2))
    outs = {
        b: mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, backend=b, **MASKS[mask]) for b in ("auto", "flash")
    }
    torch.testing.assert_close(outs["auto"].float(), outs["flash"].float(), atol=2e-2, rtol=0)
    assert ran and set(ran) == {"cudnn"}, ran
