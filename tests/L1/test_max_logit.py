"""``cp_attention(..., return_max_logit=True)``: the per-query-head max of the scaled logits over
the whole batch, against the dense fp64 reference, on every rank, for every comm type, format,
mask, head layout (GQA, MQA, MLA, uneven a2a heads), dtype and with a sink."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.cases import AttnCase, cp_group_for, local_shard
from megatron_cp_ext.testing.pool import run_on_ranks
from megatron_cp_ext.testing.reference import visibility_matrix

SEQLENS = (13, 0, 1, 30, 7, 2)
TOL = {"float64": 1e-7, "float32": 1e-5, "bfloat16": 1e-5}  # vs fp64 on the rounded inputs; the result is fp32


def reference_max_logit(case: AttnCase) -> torch.Tensor:
    """Dense fp64 ``[hq]``: max over every visible (query, key) pair of ``scale * q.k``."""
    dtype = getattr(torch, case.dtype)
    q, k, _, _ = (x.to(dtype).double() for x in case.inputs())
    k = k.repeat_interleave(case.hq // case.hkv, dim=1)
    scale = case.extra.get("softmax_scale", 1.0 / math.sqrt(case.d))
    vis = visibility_matrix(
        case.cu_seqlens, causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size
    )
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = torch.cat([s.masked_fill(~vis[None], float("-inf")).flatten(1), s.new_full((case.hq, 1), float("-inf"))], 1)
    return s.amax(dim=1)  # the extra -inf column: a batch without pairs


def max_logit_case(rank: int, world: int, case: AttnCase) -> dict:
    """Worker: (max_logit, whether out equals the call without max logits, all_reduce calls)."""
    dtype = getattr(torch, case.dtype)
    sharding = case.sharding(world) if case.qkv_format == "thd" else None
    q, k, v, _ = (local_shard(case, world, rank, x, sharding).to(dtype) for x in case.inputs())
    extra = dict(case.extra)
    if case.sink is not None:
        sink_dtype = torch.float64 if case.dtype == "float64" else torch.float32
        extra["softmax_offset"] = torch.tensor(case.sink, dtype=sink_dtype)
    kw = dict(
        cp_group=cp_group_for(case, world), comm_type=case.comm_type, qkv_format=case.qkv_format, sharding=sharding,
        causal=case.causal, window_size=case.window_size, chunk_size=case.chunk_size, **extra,
    )  # fmt: skip
    plain = mcx.cp_attention(q, k, v, **kw)
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k_: calls.append(1) or all_reduce(*a, **k_)
    try:
        out, max_logit = mcx.cp_attention(q, k, v, return_max_logit=True, **kw)
    finally:
        dist.all_reduce = all_reduce
    return {"max": max_logit, "same_out": torch.equal(out, plain), "all_reduces": len(calls)}


def check(case: AttnCase, world: int) -> None:
    results = run_on_ranks(world, max_logit_case, case)
    ref = reference_max_logit(case)
    for r in results:
        assert r["same_out"]
        assert r["max"].dtype == torch.float32 and r["max"].shape == (case.hq,)
        assert torch.equal(r["max"], results[0]["max"]), "ranks disagree"
        assert torch.isinf(r["max"]).equal(torch.isinf(ref))
        assert torch.allclose(r["max"].double(), ref, rtol=TOL[case.dtype], atol=TOL[case.dtype]), (r["max"], ref)
    expected = 0 if world == 1 else (2 if case.comm_type == "a2a+p2p" and world == 1 else 1)
    assert {r["all_reduces"] for r in results} == {expected}


BASE = AttnCase(seqlens=SEQLENS, hq=4, hkv=2)
CASES = {
    "p2p_causal": dict(comm_type="p2p"),
    "p2p_nomask_mla_bf16": dict(comm_type="p2p", causal=False, dv=6, dtype="bfloat16"),
    "p2p_window_fp64": dict(comm_type="p2p", causal=False, window_size=(2, 5), dtype="float64"),
    "p2p_chunk_workload": dict(comm_type="p2p", chunk_size=3, balance="workload"),
    "p2p_sink_scale": dict(comm_type="p2p", sink=(0.5, -1.0, 9.0, 0.0), extra={"softmax_scale": 0.7}),
    "all_gather_window": dict(comm_type="all_gather", window_size=(3, -1)),
    "all_gather_mqa_bshd": dict(comm_type="all_gather", hkv=1, seqlens=(16, 16), qkv_format="bshd"),
    "a2a_gqa": dict(comm_type="a2a"),
    "a2a_uneven_heads_sink": dict(comm_type="a2a", hq=6, hkv=3, sink=(1, 2, 3, 4, 5, 6)),
    "a2a_fewer_heads_than_ranks": dict(comm_type="a2a", hq=3, hkv=1, causal=False),
    "a2a_p2p_sbhd": dict(comm_type="a2a+p2p", a2a_size=2, seqlens=(16, 16, 16), qkv_format="sbhd"),
    "a2a_p2p_thd_chunk_fp64": dict(comm_type="a2a+p2p", a2a_size=2, chunk_size=4, dtype="float64"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_max_logit_matches_dense_reference_world4(name: str) -> None:
    check(dataclasses.replace(BASE, **CASES[name]), 4)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_max_logit_world2_and_single_rank(comm_type: str) -> None:
    case = dataclasses.replace(BASE, comm_type=comm_type, causal=False, window_size=(4, 1))
    check(case, 2)
    check(dataclasses.replace(case, comm_type="p2p"), 1)


def test_a_sequence_free_batch_gives_minus_inf() -> None:
    check(dataclasses.replace(BASE, seqlens=(0, 0, 0, 0, 0, 0, 0, 0)), 2)


CU_NAN = [0, 13, 13, 14, 40, 47, 49]


def nan_case(rank: int, world: int, token: int, comm_type: str) -> tuple[int, list[float]]:
    """Worker: q holds one NaN (head 0) at global ``token``; returns its owner and the max logits."""
    sharding = mcx.shard_sequences(CU_NAN, world, "dualchunk")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(CU_NAN[-1], 2, 8, generator=g) for _ in range(3))
    q[token, 0, 0] = float("nan")
    owner = next(r for r in range(world) if (sharding.global_index(r) == token).any())
    local = [sharding.shard(x, rank) for x in (q, k, v)]
    _, ml = mcx.cp_attention(
        *local, cp_group=dist.group.WORLD, sharding=sharding, comm_type=comm_type, return_max_logit=True
    )
    return owner, ml.tolist()


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_a_nan_logit_is_nan_on_every_rank_wherever_it_is(comm_type: str) -> None:
    """gloo's MAX keeps a NaN only from its first operand: a NaN logit computed on CP rank 1
    came back finite (2.52) on both ranks, one on rank 0 as NaN. QK-clip would miss it."""
    owners = set()
    for token in (2, 20, 45):
        results = run_on_ranks(2, nan_case, token, comm_type, timeout=60)
        owners.add(results[0][0])
        for _, ml in results:
            assert math.isnan(ml[0]) and math.isfinite(ml[1]), results
    assert owners == {0, 1}  # the NaN sat on each rank at least once
