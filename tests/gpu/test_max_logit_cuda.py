"""Max logits on CUDA: ``cp_attention(return_max_logit=True)`` with the flash backend on one
rank (the per-call ``max_logit`` grouped by the plan's host entries, in tiles), against a dense
float64 computation; on a batch of one long document among a thousand short ones, within a
memory bound (one batch padded to the longest document would need tens of GiB). Skipped
without CUDA."""

import math

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import flash
from megatron_cp_ext.testing.reference import visibility_matrix

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def dense_max_logit(q, k, cu, scale, **mask) -> torch.Tensor:
    """Document by document (documents see only themselves), in float64."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    best = torch.full((q.shape[1],), float("-inf"), dtype=torch.float64, device=q.device)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b]) * scale
        vis = visibility_matrix([0, b - a], **mask).to(q.device)
        best = torch.maximum(best, s.masked_fill(~vis[None], float("-inf")).amax(dim=(1, 2)))
    return best


@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window_size=(300, 40))])
@pytest.mark.parametrize("lengths", [[2500, 1, 700, 97], [3] * 500 + [8000] + [3] * 500], ids=["4docs", "1001docs"])
def test_cp_attention_max_logit_on_cuda(mask, lengths):
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 8, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(cu[-1], 2, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn(cu[-1], 2, 64, device=dev, dtype=torch.bfloat16)
    sharding = mcx.shard_sequences(torch.tensor(cu), 1, **mask)
    out, max_logit = mcx.cp_attention(
        q, k, v, cp_group=None, sharding=sharding, backend="flash", return_max_logit=True, **mask
    )
    assert max_logit.device == dev and max_logit.dtype == torch.float32
    # inputs and outputs are ~20 MiB, a score tile at most 2**26 fp32 (padded to the longest
    # document, one batch would hold 1001 x 8000 query rows: 16 GiB for q alone)
    assert torch.cuda.max_memory_allocated(dev) - base < 2 << 30
    want = dense_max_logit(q, k, cu, 1 / math.sqrt(64), **mask)
    torch.testing.assert_close(max_logit.double(), want, rtol=1e-5, atol=1e-5)
    assert flash.max_logit is not None
