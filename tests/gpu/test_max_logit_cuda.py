"""Max logits on CUDA: the flash backend's per-call ``max_logit`` on device offsets (one group
padded to ``max_seqlen``, computed in tiles), and ``cp_attention(return_max_logit=True)`` with
the flash backend on one rank, against a dense float64 computation. Skipped without CUDA."""

import math

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import flash
from megatron_cp_ext.testing.reference import visibility_matrix

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def dense_max_logit(q, k, cu, scale, **mask) -> torch.Tensor:
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    vis = visibility_matrix(cu, **mask).to(q.device)
    return s.masked_fill(~vis[None], float("-inf")).amax(dim=(1, 2))


@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False, window_size=(300, 40))])
def test_cp_attention_max_logit_on_cuda(mask):
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    lengths = [2500, 1, 700, 97]  # longer than one 1024 tile
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
    want = dense_max_logit(q, k, cu, 1 / math.sqrt(64), **mask)
    torch.testing.assert_close(max_logit.double(), want, rtol=1e-5, atol=1e-5)
    assert flash.max_logit is not None
