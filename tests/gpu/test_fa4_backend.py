"""The FlashAttention-4 candidate (``backends/fa4.py``, ``flash_attn.cute``) against the exact
reference: every mask of the contract, bf16 and fp16, GQA/MQA/MLA (MLA with GQA falls back on
Hopper), documents of length 0 and 1, query entries longer than their key entries (rows that
see no key); every comm type with FA4 as the picked kernel against dense fp64; no host sync;
kernel configurations met once, not per micro-batch. The cases are the cuDNN candidate's."""

import random

import pytest
import torch

from megatron_cp_ext.backends import fa4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fa4.available(), reason="flash-attn-4 not installed (or not a Hopper/Blackwell GPU)"),
]

from test_cudnn_backend import HEADS, _args, _cases, _comm_cases, _inputs, check_candidate, run_with_picked  # noqa: E402


@pytest.mark.parametrize("call,dtype,heads,lens", list(_cases()), ids=str)
def test_matches_reference(call, dtype, heads, lens):
    check_candidate(fa4, call, dtype, heads, lens)


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
    run_with_picked(monkeypatch, "fa4", comm_type, a2a_size, world, mask)
