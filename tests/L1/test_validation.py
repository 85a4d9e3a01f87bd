"""Bad input raises a clear ValueError on every rank, before or instead of any hang."""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.pool import run_on_ranks


def _attempt(rank, world, fault, comm_type):
    """Run one attention call where ``fault`` breaks one rank's (or every rank's) input."""
    cu = [0, 11, 17, 40]
    if fault == "cu_seqlens_one_rank" and rank == 1:
        cu = [0, 11, 18, 40]
    sh = mcx.shard_sequences(torch.tensor(cu), world)
    n = sh.num_tokens(rank) + (1 if fault == "tokens_one_rank" and rank == world - 1 else 0)
    dtype = torch.bfloat16 if fault == "dtype_one_rank" and rank == 0 else torch.float32
    q, k, v = (torch.randn(n, 4, 8, dtype=dtype) for _ in range(3))
    kw = dict(cp_group=dist.group.WORLD, comm_type=comm_type, sharding=sh)
    if fault == "group_size":
        kw["sharding"] = mcx.shard_sequences(torch.tensor(cu), world * 2)
    if fault == "heads":
        k, v = k[:, :3], v[:, :3]
    try:
        mcx.cp_attention(q, k, v, **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize(
    "fault, match",
    [
        ("tokens_one_rank", "tokens"),
        ("cu_seqlens_one_rank", "cu_seqlens differs"),
        ("dtype_one_rank", "dtype differs"),
        ("group_size", "cp_size"),
        ("heads", "multiple"),
    ],
)
def test_every_rank_raises_same_error(fault, match, comm_type):
    msgs = run_on_ranks(2, _attempt, fault, comm_type, timeout=60)
    assert all(m is not None and match in m for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs


def test_local_argument_errors():
    sh = mcx.shard_sequences([0, 8], 1)
    q = torch.randn(8, 2, 4)
    cases = [
        (dict(comm_type="ring"), "comm_type"),
        (dict(qkv_format="bhsd"), "qkv_format"),
        (dict(sharding=None), "sharding"),
        (dict(window_size=(-5, 0)), "window_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(cp_group=[None, None]), "cp_group"),
    ]
    for kw, match in cases:
        args = dict(cp_group=None, sharding=sh) | kw
        with pytest.raises(ValueError, match=match):
            mcx.cp_attention(q, q, q, **args)
    with pytest.raises(ValueError, match="head dims"):
        mcx.cp_attention(q, q[..., :3], q, cp_group=None, sharding=sh)
    with pytest.raises(ValueError, match="tokens"):
        mcx.cp_attention(q[:7], q[:7], q[:7], cp_group=None, sharding=sh)
    with pytest.raises(ValueError, match="4-D"):
        mcx.cp_attention(q, q, q, cp_group=None, qkv_format="bshd")
