"""``cp_attention`` called inside ``torch.autocast`` computes in the dtype of q, k, v: fp32
inputs give fp32 results at fp32 accuracy against the dense fp64 reference, forward and
backward (backward also run inside the region), for every comm type; the max logits stay
exact, and so does a prepared call. Without the guard the exact kernel's matmuls ran in bf16
and backward recomputed in fp32 against a bf16 lse (errors ~2e-2)."""

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import reference
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads


def _autocast_case(rank: int, world: int, case: AttnCase) -> dict:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = run_case(rank, world, case)  # forward and backward in the region
    assert all(t.dtype == torch.float32 for t in res.values()), {n: t.dtype for n, t in res.items()}
    return res


@pytest.mark.parametrize("comm_type,a2a", [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)])
def test_fp32_inside_autocast_stays_fp32(comm_type: str, a2a: int) -> None:
    world = 4 if a2a else 2
    case = AttnCase(seqlens=(13, 0, 1, 30, 7), comm_type=comm_type, a2a_size=a2a, hq=4, hkv=2, dtype="float32")
    errors = check_case(run_threads(world, _autocast_case, case, timeout=120), case)
    assert max(errors.values()) < 1e-5, errors  # fp32 accuracy, not bf16's ~1e-2


def test_kernel_lse_and_max_logit_inside_autocast() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    sharding = mcx.shard_sequences(cu, 1)
    plain, plain_max = mcx.cp_attention(q, k, v, cp_group=None, sharding=sharding, return_max_logit=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, top = mcx.cp_attention(q, k, v, cp_group=None, sharding=sharding, return_max_logit=True)
        prepared = mcx.plan_cp_attention(q, k, v, cp_group=None, sharding=sharding)
        again = prepared(q, k, v)
        _, lse = reference.attn_fwd(q, k, v, cu, cu, 5, 5, True, (-1, -1), 0.3)
    assert out.dtype == again.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(out, plain) and torch.equal(again, plain) and torch.equal(top, plain_max)


def test_meta_tensors_pass_through() -> None:
    """Meta tensors (shape-only model builds) have no autocast: the guard lets them through."""
    q = torch.empty(8, 2, 4, device="meta")
    out = mcx.cp_attention(q, q, q, cp_group=None, sharding=mcx.shard_sequences([0, 8], 1))
    assert out.device.type == "meta" and out.shape == (8, 2, 4)
