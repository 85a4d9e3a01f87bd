"""On the CP path, every merge, row gather and row scatter-add gets the tensors the ``csrc``
CUDA kernels take (contiguous, int64 indices), so that a GPU runs them as one kernel each.

The kernels' entries (``runtime/ops.py``) send anything else to the 2–5 op torch fallback
without a word: a backend handing back its lse as a transposed view once did that to every
merge of every layer. The local kernel here is the reference with the lse in the layout the
flash backend gets from FlashAttention (``[H, N]``, converted by ``flash._lse_nh``); bf16
inputs as on a GPU. The GPU counterpart: ``tests/gpu/test_ops_cuda.py``."""

from __future__ import annotations

import collections

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext import schedules
from megatron_cp_ext.backends import flash, reference
from megatron_cp_ext.schedules import all_gather, common, p2p, staged
from megatron_cp_ext.testing import reference_kernels
from megatron_cp_ext.testing.inproc import run_threads

CU = [0, 300, 301, 700, 1333, 1500]


def _flash_layout_fwd(fwd):
    def run(q, k, v, *args):
        out, lse = fwd(q, k, v, *args)
        return out, flash._lse_nh(lse.t().contiguous())

    return run


def _watch(monkeypatch, module, name: str, tensors, odd: collections.Counter, seen: collections.Counter) -> None:
    op = getattr(module, name)

    def checked(*a, **kw):
        seen[name] += 1
        ts = [t for t in tensors(a) if t is not None]
        if not all(t.is_contiguous() for t in ts):
            odd[(name, tuple((tuple(t.shape), t.stride()) for t in ts))] += 1
        return op(*a, **kw)

    monkeypatch.setattr(module, name, checked)


def _layer(rank: int, world: int, comm: str, sharding) -> None:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    n = sharding.num_tokens(rank)
    q, k, v = (torch.randn(n, h, 32, generator=g).bfloat16().requires_grad_() for h in (8, 2, 2))
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm, sharding=sharding, causal=True)
    out.backward(torch.randn_like(out))


@pytest.mark.parametrize(
    ("comm", "world", "schedule"),
    # the paths that merge, gather or scatter-add rows on this batch (staged p2p and plain
    # a2a run none of them here: one kernel call per rank, rows moved by the transfers)
    [("p2p", 4, "ring"), ("a2a+p2p", 4, "ring"), ("all_gather", 4, "ring")],
)
def test_cp_path_ops_are_kernel_shaped(monkeypatch, comm: str, world: int, schedule: str) -> None:
    monkeypatch.setattr(schedules, "P2P_SCHEDULE", schedule)
    odd, seen = collections.Counter(), collections.Counter()
    _watch(monkeypatch, common, "merge_partial", lambda a: a[:5], odd, seen)
    for module in (common, staged, p2p, all_gather):  # every schedule module that imports them
        for name, tensors in (("gather_rows", lambda a: a[:2]), ("index_add_rows", lambda a: a[:3])):
            if hasattr(module, name):
                _watch(monkeypatch, module, name, tensors, odd, seen)
    sharding = mcx.shard_sequences(CU, world, causal=True)
    with reference_kernels(_flash_layout_fwd(reference.attn_fwd), reference.attn_bwd):
        run_threads(world, _layer, comm, sharding, timeout=120)
    if comm != "all_gather":  # one call per rank here: nothing to merge
        assert seen["merge_partial"], f"no merge ran: {dict(seen)}"
    assert sum(seen.values()), "nothing was checked"
    assert not odd, f"ops the CUDA kernels cannot take (they fall back to torch): {odd}"
