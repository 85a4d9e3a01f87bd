"""Logits far from 0 against answers known in closed form (no reference code involved):

- a row whose logits all lie below -1e30 (``softmax_scale=1e31``) merges like any other: the
  merge's start value was -1e30, and such partials got weight 0 (output 0 on p2p at CP 4);
- equal logits of -8e7 in fp32 average the values in one call: the CPU kernel formed its
  probabilities as ``exp(s - lse)``, and an fp32 lse of -8e7 cannot hold log(n) (it returned
  the sum of v).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.pool import run_on_ranks

SEQLENS = [0, 1, 17, 5, 33, 0, 2]
COMMS = ["p2p", "all_gather", "a2a", "a2a+p2p"]


def _one_hot_batch():
    """Key j of a document has logit -8 (j + 1) * scale for every query: the softmax of each
    causal row is one-hot on its document's first key, so every output is v[0] = 10."""
    pos = torch.cat([torch.arange(n) for n in SEQLENS]).double()
    t = len(pos)
    q = torch.ones(t, 1, 8, dtype=torch.float64)
    k = -(pos + 1).view(t, 1, 1).expand(t, 1, 8).contiguous()
    v = (10 + pos).view(t, 1, 1).expand(t, 1, 8).contiguous()
    return q, k, v


def _one_hot_case(rank: int, world: int, comm: str, dtype: str) -> torch.Tensor:
    cu = [0, *torch.tensor(SEQLENS).cumsum(0).tolist()]
    sharding = mcx.shard_sequences(cu, world)
    group = mcx.hierarchical_cp_groups(2) if comm == "a2a+p2p" else dist.group.WORLD
    local = [sharding.shard(x, rank).to(getattr(torch, dtype)) for x in _one_hot_batch()]
    return mcx.cp_attention(*local, cp_group=group, comm_type=comm, sharding=sharding, softmax_scale=1e31)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_logits_below_minus_1e30_merge_like_any_other(dtype):
    for comm in COMMS:
        for rank, out in enumerate(run_on_ranks(4, _one_hot_case, comm, dtype)):
            assert torch.equal(out, torch.full_like(out, 10.0)), (comm, rank, out[:, 0, 0])


def test_equal_large_logits_average_the_values():
    """Every logit -8e7 (fp32), no mask, one call (CP 1): each output is the mean of its
    document's values. Above CP 1 the fp32 lse of each partial carries the same rounding
    (docs/algorithms.md, "Precision and autocast")."""
    lens = [8, 24]
    q = torch.ones(32, 2, 4)
    k = torch.full((32, 1, 4), -2e7)  # logit -8e7 with softmax_scale 1
    v = torch.cat([torch.arange(n, dtype=torch.float32) for n in lens]).view(32, 1, 1).expand(32, 1, 4)
    want = torch.tensor([(n - 1) / 2 for n in lens for _ in range(n)]).view(32, 1, 1).expand(32, 2, 4)
    sharding = mcx.shard_sequences([0, 8, 32], 1, causal=False)
    out = mcx.cp_attention(q, k, v, cp_group=None, sharding=sharding, causal=False, softmax_scale=1.0)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
