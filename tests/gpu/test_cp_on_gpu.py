"""``cp_attention`` on one GPU: CP 1 directly and every comm type at CP 2/4 through the
in-process runner (all ranks on this GPU, the real schedules), forward and backward against
the dense fp64 reference; and no host-device sync once the plan is built."""

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.testing.cases import AttnCase, check_case, run_case
from megatron_cp_ext.testing.inproc import run_threads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEQLENS = (300, 0, 1, 97, 513, 2, 130)
COMMS = [("p2p", 0), ("all_gather", 0), ("a2a", 0), ("a2a+p2p", 2)]
MASKS = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window_size=(64, -1)),
    dict(causal=False, window_size=(40, 17)),
    dict(causal=True, chunk_size=128),
]


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads", [(8, 2, 64, 64), (8, 1, 64, 32)], ids=["gqa", "mqa-mla"])
def test_cp1_matches_dense(mask, dtype, heads):
    hq, hkv, d, dv = heads
    case = AttnCase(seqlens=SEQLENS, comm_type="p2p", hq=hq, hkv=hkv, d=d, dv=dv, dtype=dtype, device="cuda",
                    balance="workload", **mask)  # fmt: skip
    check_case([run_case(0, 1, case)], case)


@pytest.mark.parametrize("mask", MASKS[:4], ids=str)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type,a2a_size", COMMS)
def test_runner_matches_dense(comm_type, a2a_size, world, mask):
    case = AttnCase(seqlens=SEQLENS, comm_type=comm_type, a2a_size=a2a_size, hq=8, hkv=2, d=64, dv=64,
                    dtype="bfloat16", device="cuda", balance="workload", **mask)  # fmt: skip
    check_case(run_threads(world, run_case, case, device="cuda", timeout=120), case)


def _sync_free(rank: int, world: int, comm_type: str, a2a_size: int) -> int:
    import torch.distributed as dist

    cu = [0, 300, 300, 301, 398, 911]
    sh = mcx.shard_sequences(cu, world)
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v = (torch.randn(sh.num_tokens(rank), h, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (8, 2, 2))  # fmt: skip
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    group = mcx.hierarchical_cp_groups(a2a_size) if a2a_size else dist.group.WORLD

    def layer():
        out = mcx.cp_attention(q, k, v, cp_group=group, comm_type=comm_type, sharding=sh, causal=True)
        out.backward(torch.ones_like(out))

    layer()  # builds the plan, uploads its indices, agrees across ranks
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:  # process-wide: every rank's thread is checked from here on
        torch.cuda.set_sync_debug_mode("error")
    dist.barrier()
    try:
        layer()
    finally:
        dist.barrier()
        if rank == 0:
            torch.cuda.set_sync_debug_mode("default")
    return 0


def test_cp1_no_sync_after_plan():
    cu = [0, 300, 300, 301, 398, 911]
    sh = mcx.shard_sequences(cu, 1)
    q, k, v = (torch.randn(911, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    for mask in MASKS:
        sh_m = mcx.shard_sequences(cu, 1, **mask)
        for s in (sh, sh_m):
            out = mcx.cp_attention(q, k, v, cp_group=None, sharding=s, **mask)
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = mcx.cp_attention(q, k, v, cp_group=None, sharding=s, **mask)
                out.backward(torch.ones_like(out))
            finally:
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("comm_type,a2a_size", COMMS)
def test_runner_no_sync_after_plan(comm_type, a2a_size):
    """The runner's own collectives are device copies, so a sync here is the package's."""
    run_threads(4, _sync_free, comm_type, a2a_size, device="cuda", timeout=120)


# ---- above CP 1: formats, chunks, sinks, fp16, max logits ---------------------------------------
FEATURES = {
    "sbhd": dict(qkv_format="sbhd", seqlens=(64, 64), causal=True),
    "bshd-window": dict(qkv_format="bshd", seqlens=(64, 64), causal=True, window_size=(9, 0)),
    "thd-chunk": dict(causal=True, chunk_size=48),
    "thd-chunk-window": dict(causal=True, chunk_size=64, window_size=(20, 0)),
    "thd-sink": dict(causal=True, sink=(0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 1.0)),
    "thd-fp16-window": dict(causal=False, window_size=(40, 17), dtype="float16"),
    "thd-fp16": dict(causal=True, dtype="float16"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type,a2a_size", COMMS)
def test_runner_features_match_dense(comm_type, a2a_size, world, feature):
    """Every comm type at CP 2 and 4 on sbhd/bshd, chunks (with a window), sinks and fp16, with
    the kernel ``auto`` picks here, against dense fp64 (forward and backward)."""
    kw = {"seqlens": SEQLENS, "dtype": "bfloat16", **FEATURES[feature]}
    case = AttnCase(comm_type=comm_type, a2a_size=a2a_size, hq=8, hkv=2, d=64, dv=64, device="cuda",
                    balance="dualchunk" if kw.get("qkv_format", "thd") != "thd" else "workload", **kw)  # fmt: skip
    check_case(run_threads(world, run_case, case, device="cuda", timeout=120), case)


def _max_logit_rank(rank: int, world: int, comm_type: str, a2a_size: int) -> torch.Tensor:
    import torch.distributed as dist

    cu = [0, 300, 300, 301, 398, 911]
    sh = mcx.shard_sequences(cu, world)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(911, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 2, 2))
    group = mcx.hierarchical_cp_groups(a2a_size) if a2a_size else dist.group.WORLD
    local = [sh.shard(x, rank) for x in (q, k, v)]
    _, ml = mcx.cp_attention(*local, cp_group=group, comm_type=comm_type, sharding=sh, causal=True,
                             return_max_logit=True)  # fmt: skip
    return ml


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type,a2a_size", COMMS)
def test_runner_max_logits_match_dense(comm_type, a2a_size, world):
    """Max logits of every comm type at CP 2 and 4: the same on every rank, equal to dense fp64."""
    from megatron_cp_ext.testing.reference import visibility_matrix

    got = run_threads(world, _max_logit_rank, comm_type, a2a_size, device="cuda", timeout=120)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, _ = (torch.randn(911, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 2, 2))
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(4, dim=1)) / 8.0
    vis = visibility_matrix([0, 300, 300, 301, 398, 911], causal=True).to(s.device)
    want = s.masked_fill(~vis[None], float("-inf")).amax(dim=(1, 2))
    for ml in got:
        torch.testing.assert_close(ml.double(), want, rtol=1e-5, atol=1e-5)
