"""a2a (Ulysses) and a2a+p2p (hierarchical) against the dense fp64 reference, thd/bshd/sbhd,
plus bshd/sbhd on p2p and all_gather, and the comm-type specific errors."""

import pytest
import torch
import torch.distributed as dist

import megatron_cp_ext as mcx
from megatron_cp_ext.testing import coverage
from megatron_cp_ext.testing.cases import AttnCase, check_case, cp_group_for, run_case
from megatron_cp_ext.testing.pool import run_on_ranks
from megatron_cp_ext.testing.reference import dense_attention

SEQLENS = (13, 0, 1, 30, 7, 2)
# (hq, hkv, dv): MHA; GQA with hkv < cp (KV heads replicated); MLA (dv != d)
HEADS = {"mha": (4, 4, 8), "gqa": (4, 1, 8), "mla": (8, 2, 6)}
# (world, comm_type, a2a_size): a2a over the world, hierarchical 2x2, 4x1, 1x4, 2x1, 1x2
TOPOLOGIES = [(2, "a2a", 0), (4, "a2a", 0), (4, "a2a+p2p", 2), (4, "a2a+p2p", 4), (4, "a2a+p2p", 1),
              (2, "a2a+p2p", 2), (2, "a2a+p2p", 1)]  # fmt: skip


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"w{t[0]}-{t[1]}-a{t[2]}")
def test_thd_matches_dense(topo, causal, heads):
    world, comm, a2a_size = topo
    hq, hkv, dv = HEADS[heads]
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, a2a_size=a2a_size, causal=causal, hq=hq, hkv=hkv, dv=dv)
    check_case(run_on_ranks(world, run_case, case), case)


@pytest.mark.parametrize("topo", [(4, "a2a", 0), (4, "a2a+p2p", 2)], ids=["a2a", "a2a+p2p"])
def test_bf16(topo):
    world, comm, a2a_size = topo
    case = AttnCase(seqlens=SEQLENS, comm_type=comm, a2a_size=a2a_size, hkv=2, dtype="bfloat16")
    check_case(run_on_ranks(world, run_case, case), case)


def _zigzag(x: torch.Tensor, rank: int, cp: int, dim: int) -> torch.Tensor:
    """Megatron's split of the sequence dim: 2cp equal chunks, rank r keeps r and 2cp-1-r."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def _seq_format_worker(rank, world, fmt, comm, a2a_size, causal, b, s, hq, hkv, d, dv):
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(b, s, h, e, generator=g) for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    seq_dim = 1 if fmt == "bshd" else 0
    local = [_zigzag(x if fmt == "bshd" else x.transpose(0, 1), rank, world, seq_dim) for x in (q, k, v, dout)]
    ql, kl, vl = (x.contiguous().requires_grad_() for x in local[:3])
    group = cp_group_for(AttnCase(seqlens=(), comm_type=comm, a2a_size=a2a_size), world)
    out = mcx.cp_attention(ql, kl, vl, cp_group=group, comm_type=comm, qkv_format=fmt, causal=causal)
    out.backward(local[3])
    return out.detach(), ql.grad, kl.grad, vl.grad


def _unzigzag(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    cp = len(parts)
    chunks = [None] * (2 * cp)
    for r, p in enumerate(parts):
        lo, hi = p.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = lo, hi
    return torch.cat(chunks, dim=dim)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
@pytest.mark.parametrize(
    "topo",
    [(2, "p2p", 0), (4, "all_gather", 0), (4, "a2a", 0), (4, "a2a+p2p", 2), (2, "a2a+p2p", 1)],
    ids=lambda t: f"w{t[0]}-{t[1]}-a{t[2]}",
)
def test_seq_formats_match_dense(topo, causal, fmt):
    world, comm, a2a_size = topo
    b, s, hq, hkv, d, dv = 2, 24, 4, 2, 8, 6
    res = run_on_ranks(world, _seq_format_worker, fmt, comm, a2a_size, causal, b, s, hq, hkv, d, dv)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(b, s, h, e, generator=g) for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    flat = lambda x: x.reshape(b * s, *x.shape[2:])  # noqa: E731
    ref = dense_attention(flat(q), flat(k), flat(v), [i * s for i in range(b + 1)], causal=causal)
    ref.backward(flat(dout).double())
    want = [ref.detach().view(b, s, hq, dv), q.grad, k.grad, v.grad]
    for i, w in enumerate(want):
        got = _unzigzag([r[i] for r in res], 1 if fmt == "bshd" else 0)
        if fmt == "sbhd":
            got = got.transpose(0, 1)
        assert got.shape == w.shape
        assert (got.double() - w).abs().max().item() < 1e-4, (i, fmt, comm)
    coverage.record(comm, fmt, coverage.features_of(causal=causal, hq=hq, hkv=hkv, d=d, dv=dv))


def _error_worker(rank, world, fault):
    sh = mcx.shard_sequences(torch.tensor([0, 9, 20]), world)
    hq, hkv = 4, 4
    q = torch.randn(sh.num_tokens(rank), hq, 8)
    k = torch.randn(sh.num_tokens(rank), hkv, 8)
    comm, group = "a2a", dist.group.WORLD
    if fault == "group_list":
        comm, group = "a2a+p2p", [dist.group.WORLD]
    if fault == "group_not_list":
        comm = "a2a+p2p"
    if fault == "seq_len":  # bshd with s = 3 * 4 = 12 tokens per sequence: 12 % (2 * 4) != 0
        x = torch.randn(2, 3, 4, 8)
        try:
            mcx.cp_attention(x, x, x, cp_group=group, comm_type="a2a", qkv_format="bshd")
        except ValueError as e:
            return str(e)
        return None
    try:
        mcx.cp_attention(q, k, k, cp_group=group, comm_type=comm, sharding=sh)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "fault, match",
    [("group_list", "a2a_group, p2p_group"), ("group_not_list", "a2a_group, p2p_group"),
     ("seq_len", "divisible by 2*cp")],
)  # fmt: skip
def test_errors(fault, match):
    msgs = run_on_ranks(4, _error_worker, fault, timeout=60)
    assert all(m is not None and match in m for m in msgs), msgs


def _groups_worker(rank, world, a2a_size):
    a2a, p2p = mcx.hierarchical_cp_groups(a2a_size)
    return dist.get_process_group_ranks(a2a), dist.get_process_group_ranks(p2p)


def test_hierarchical_groups_layout():
    res = run_on_ranks(4, _groups_worker, 2)
    assert res[0] == ([0, 1], [0, 2]) and res[3] == ([2, 3], [1, 3])


def test_bf16_replicated_kv_heads_as_accurate_as_p2p():
    """MQA over a2a at CP 4 replicates the KV head 4x; the replicas' dK/dV are summed in fp32
    and rounded once, so the error is p2p's (it was ~1.5x when each replica was rounded)."""
    errors = {}
    for comm in ("p2p", "a2a"):
        case = AttnCase(seqlens=(200, 57, 1, 90), comm_type=comm, hq=8, hkv=1, d=16, dv=16, dtype="bfloat16", seed=1)
        errors[comm] = check_case(run_on_ranks(4, run_case, case), case)
    for grad in ("dk", "dv"):
        assert errors["a2a"][grad] <= 1.1 * errors["p2p"][grad], (grad, errors)


ANY_HEADS = [  # (world, comm, a2a size, hq, hkv): counts the a2a size does not divide
    (4, "a2a", 0, 6, 6), (4, "a2a", 0, 6, 3), (4, "a2a", 0, 3, 1), (4, "a2a", 0, 5, 1), (4, "a2a", 0, 2, 2),
    (4, "a2a+p2p", 2, 3, 3), (4, "a2a+p2p", 2, 6, 3), (2, "a2a", 0, 3, 3), (3, "a2a", 0, 4, 2),
]  # fmt: skip


@pytest.mark.parametrize("world, comm, a2a, hq, hkv", ANY_HEADS, ids=lambda x: str(x))
def test_any_head_count(world, comm, a2a, hq, hkv):
    """Uneven head shards (members may even hold none) are exact, forward and backward."""
    case = AttnCase(seqlens=(300, 9, 0, 1, 44), comm_type=comm, a2a_size=a2a, hq=hq, hkv=hkv)
    check_case(run_on_ranks(world, run_case, case), case)


def test_mqa_at_cp8():
    case = AttnCase(seqlens=(130, 7, 61, 1), comm_type="a2a", hq=4, hkv=1, d=8, dv=6)
    check_case(run_on_ranks(8, run_case, case, timeout=120), case)


def _gathered_case(rank, world, case):
    """``run_case`` with no head move by route: the all-to-all and its plan-index gathers, which
    a GPU takes where a move's messages would be small (``schedules/route.py``)."""
    from megatron_cp_ext.schedules import route

    floor, route.CPU_MIN_BYTES = route.CPU_MIN_BYTES, 1 << 62
    try:
        return run_case(rank, world, case)
    finally:
        route.CPU_MIN_BYTES = floor


@pytest.mark.parametrize(
    "world, comm, a2a, hq, hkv, dv",
    [(4, "a2a", 0, 4, 4, 8), (4, "a2a", 0, 4, 1, 8), (4, "a2a", 0, 8, 2, 6), (4, "a2a", 0, 5, 1, 8),
     (4, "a2a+p2p", 2, 6, 3, 8), (2, "a2a", 0, 3, 3, 8)],
    ids=lambda x: str(x),
)  # fmt: skip
def test_all_to_all_path_matches_dense(world, comm, a2a, hq, hkv, dv):
    """The moves the route replaces (all-to-all, then a gather into group order; the output's
    gather back, then all-to-all) stay exact: MHA, replicated KV heads, MLA, uneven shards."""
    case = AttnCase(seqlens=SEQLENS + (44,), comm_type=comm, a2a_size=a2a, hq=hq, hkv=hkv, dv=dv)
    check_case(run_on_ranks(world, _gathered_case, case), case)
