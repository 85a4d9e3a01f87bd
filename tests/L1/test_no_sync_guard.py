"""The CPU no-sync guard (``megatron_cp_ext.testing.syncguard``) sees what a GPU would.

Every comm type's cached forward+backward runs with every host read of tensor data refused and
the local kernel replaced by a sync-free stand-in (nothing exempt). The guard itself is shown to
fail: a sync of each kind (``item``, ``int``, ``float``, ``bool``, ``tolist``, ``numpy``,
``nonzero``, a boolean index, ``torch.equal``, ``cpu``) injected into the hot path raises; and
the stand-in kernel equals the exact reference."""

from __future__ import annotations

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import reference
from megatron_cp_ext.testing import syncguard
from megatron_cp_ext.testing.cases import AttnCase
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = (13, 0, 1, 45, 7, 2)
MASKS = {"causal": dict(causal=True), "window": dict(causal=False, window_size=(4, 6)),
         "chunk": dict(causal=True, chunk_size=8)}  # fmt: skip


def _guarded(rank: int, world: int, comm: str, mask: str) -> bool:
    import torch.distributed as dist

    case = AttnCase(seqlens=SEQLENS, comm_type=comm, hkv=2, a2a_size=2 if comm == "a2a+p2p" else 0, **MASKS[mask])
    sharding = case.sharding(world)
    q, k, v = (sharding.shard(x, rank).float().requires_grad_() for x in case.inputs()[:3])
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    kw = dict(cp_group=group, comm_type=comm, sharding=sharding, **MASKS[mask])
    mcx.cp_attention(q, k, v, **kw).sum().backward()  # builds the plan and agrees on it
    with syncguard.sync_free_kernel(), syncguard.no_host_reads():
        mcx.cp_attention(q, k, v, **kw).sum().backward()
    return True


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a", "a2a+p2p"])
def test_every_comm_type_reads_nothing_on_the_host(comm, mask):
    assert run_on_ranks(4, _guarded, comm, mask) == [True] * 4


INJECTED = {
    "item": lambda x: x.sum().item(),
    "int": lambda x: int(x.sum()),
    "float": lambda x: float(x.sum()),
    "bool": lambda x: bool(x.sum() > 0),
    "tolist": lambda x: x[:1].tolist(),
    "numpy": lambda x: x.detach().numpy(),
    "nonzero": lambda x: torch.nonzero(x > 0),
    "bool-index": lambda x: x[x > 0],
    "equal": lambda x: torch.equal(x, x),
    "cpu": lambda x: x.cpu(),
}


SH1 = mcx.shard_sequences([0, *torch.tensor(SEQLENS).cumsum(0).tolist()], 1)


def _cp1(q, k, v):
    return mcx.cp_attention(q, k, v, cp_group=None, sharding=SH1, causal=True)


@pytest.mark.parametrize("kind", list(INJECTED))
def test_guard_fails_on_an_injected_sync(kind):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(68, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    _cp1(q, k, v).sum().backward()
    with syncguard.sync_free_kernel(), syncguard.no_host_reads():
        _cp1(q, k, v).sum().backward()  # clean: passes
    fwd = reference.attn_fwd

    def with_sync(q_, *a):  # a sync inside the kernel call: nothing on the path is exempt
        INJECTED[kind](q_)
        return fwd(q_, *a)

    real = reference.attn_fwd
    with syncguard.sync_free_kernel():
        fwd = reference.attn_fwd
        # set and restored inside the block: a monkeypatch would record the stand-in kernel as
        # the original and put it back at teardown, for every later test of the session
        reference.attn_fwd = with_sync
        try:
            with pytest.raises(syncguard.HostReadError, match="host read"), syncguard.no_host_reads():
                _cp1(q, k, v)
        finally:
            reference.attn_fwd = fwd
    assert torch.Tensor.tolist(torch.ones(1)) == [1.0]  # the methods are restored
    assert reference.attn_fwd is real


@pytest.mark.parametrize("causal,window", [(True, (-1, 0)), (False, (-1, -1)), (False, (3, 2)), (True, (5, 0))])
def test_sync_free_kernel_equals_the_reference(causal, window):
    g = torch.Generator().manual_seed(1)
    cu_q, cu_k = torch.tensor([0, 5, 5, 17, 18], dtype=torch.int32), torch.tensor([0, 3, 9, 21, 21], dtype=torch.int32)
    q = torch.randn(18, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(21, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    args = (cu_q, cu_k, 12, 12, causal, window, 0.3)
    want = reference.attn_fwd(q, k, v, *args)
    dout = torch.randn(18, 4, 8, generator=g, dtype=torch.float64)
    want_g = reference.attn_bwd(dout, q, k, v, want[0], want[1], *args)
    with syncguard.sync_free_kernel(), syncguard.no_host_reads():
        got = reference.attn_fwd(q, k, v, *args)
        got_g = reference.attn_bwd(dout, q, k, v, want[0], want[1], *args)
    for x, w in zip((*got, *got_g), (*want, *want_g)):
        torch.testing.assert_close(x, w, atol=1e-12, rtol=0, equal_nan=False)
