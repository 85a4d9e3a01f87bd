"""CUDA kernels of ``megatron_cp_ext._C`` against the pure-torch fallbacks, on the GPU.

Gathers must match bit for bit; merges agree to 1e-6 (in practice exactly: the kernel
repeats the fallback's arithmetic without fused multiply-adds). Skipped without CUDA or
without the built extension (``MCX_BUILD_CUDA=1 pip install -e .``).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_cp_ext.runtime import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.HAS_CUDA_EXT, reason="CUDA extension not built"),
]

NEG_INF = float("-inf")
DEV = "cuda"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# --- gather_rows: one case per copy width (16/8/4/2/1 bytes) plus misaligned bases ---


@pytest.mark.parametrize(
    ("dtype", "row_shape", "offset"),
    [
        (torch.bfloat16, (8, 128), 0),  # 16-byte words
        (torch.float32, (2,), 0),  # 8
        (torch.float32, (1,), 0),  # 4
        (torch.bfloat16, (3,), 0),  # 2
        (torch.uint8, (3,), 0),  # 1
        (torch.int64, (5, 3), 0),
        (torch.bool, (7,), 0),
        (torch.float16, (4, 64), 1),  # 16-byte rows, base only 2-byte aligned
        (torch.uint8, (16,), 3),
    ],
)
def test_gather_rows_bitwise(dtype: torch.dtype, row_shape: tuple[int, ...], offset: int) -> None:
    rows, row_numel = 1025, math.prod(row_shape)
    flat = torch.randn(offset + rows * row_numel, device=DEV, generator=_gen(0)) * 50
    x = flat.to(dtype)[offset:].view(rows, *row_shape)  # element offset: a misaligned base
    idx = torch.randint(0, rows, (997,), device=DEV, generator=_gen(1))
    got = torch.ops.megatron_cp_ext.gather_rows(x, idx)
    assert torch.equal(got, ops.gather_rows_torch(x, idx))
    assert torch.equal(ops.gather_rows(x, idx), got)


def test_gather_rows_empty() -> None:
    x = torch.randn(4, 3, device=DEV)
    got = torch.ops.megatron_cp_ext.gather_rows(x, torch.empty(0, dtype=torch.long, device=DEV))
    assert got.shape == (0, 3)


# --- index_add_rows ---


@pytest.mark.parametrize(
    ("acc_dtype", "src_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float64, torch.float64),
    ],
)
@pytest.mark.parametrize("distinct", [True, False])
def test_index_add_rows(acc_dtype: torch.dtype, src_dtype: torch.dtype, distinct: bool) -> None:
    g = _gen(2)
    t, n = 1025, 997
    acc = torch.randn(t, 4, 33, device=DEV, generator=g).to(acc_dtype)
    if distinct:
        idx = torch.randperm(t, device=DEV, generator=g)[:n]
    else:
        idx = torch.randint(0, 97, (n,), device=DEV, generator=g)
    src = torch.randn(n, 4, 33, device=DEV, generator=g).to(src_dtype)
    expected = acc.clone()
    ops.index_add_rows_torch(expected, idx, src)
    torch.ops.megatron_cp_ext.index_add_rows_(acc, idx, src)
    if distinct:  # one add per element: no ordering freedom
        assert torch.equal(acc, expected)
    else:  # atomics add in any order
        wide = acc_dtype in (torch.float32, torch.float64)
        rtol, atol = (1e-5, 1e-5) if wide else (5e-2, 0.25)  # ~10 adds per row, rounding each
        torch.testing.assert_close(acc, expected, rtol=rtol, atol=atol)


def test_index_add_rows_deterministic_mode() -> None:
    """Under ``torch.use_deterministic_algorithms`` repeated indices sum in one fixed order: the
    public op leaves the atomic kernel for torch's deterministic path, run after run."""
    g = _gen(4)
    idx = torch.randint(0, 7, (4000,), device=DEV, generator=g)
    src = torch.randn(4000, 4, 33, device=DEV, generator=g).to(torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(5):
            acc = torch.zeros(7, 4, 33, device=DEV)
            ops.index_add_rows(acc, idx, src)
            runs.append(acc)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])


# --- merge_partial ---


def _merge_case(t: int, n: int, h: int, d: int, part_dtype: torch.dtype):
    g = _gen(3)
    lse = torch.randn(t, h, device=DEV, generator=g) * 4
    part_lse = torch.randn(n, h, device=DEV, generator=g) * 4
    lse[: t // 3] = NEG_INF
    part_lse[n // 4 : n // 2] = NEG_INF
    out = torch.randn(t, h, d, device=DEV, generator=g)
    out[torch.isneginf(lse)] = 0.0
    part_out = torch.randn(n, h, d, device=DEV, generator=g).to(part_dtype)
    part_out[torch.isneginf(part_lse)] = 0.0
    return out, lse, part_out, part_lse


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 97, 4, 256])  # 97: scalar path; 256: two vector steps
@pytest.mark.parametrize("with_idx", [False, True])
def test_merge_partial(part_dtype: torch.dtype, d: int, with_idx: bool) -> None:
    t, h = 1025, 5
    idx = torch.randperm(t, device=DEV, generator=_gen(4))[:997] if with_idx else None
    n = t if idx is None else idx.numel()
    out, lse, part_out, part_lse = _merge_case(t, n, h, d, part_dtype)
    ref_out, ref_lse = out.clone(), lse.clone()
    ops.merge_partial_torch(ref_out, ref_lse, part_out, part_lse, idx)
    torch.ops.megatron_cp_ext.merge_partial_(out, lse, part_out, part_lse, idx)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def test_merge_partial_nan_rows_like_the_fallback() -> None:
    """A NaN lse on either side leaves the row NaN in the kernel as in the fallback, also the
    schedules' ``acc_finite`` fallback (accumulators at ``LSE_FLOOR``, never -inf); rows
    empty on both sides keep the accumulator."""
    out, lse, part_out, part_lse = _merge_case(64, 64, 3, 128, torch.bfloat16)
    lse[5, 1] = part_lse[9, 2] = float("nan")
    lse[40:44] = part_lse[40:44] = NEG_INF
    lse[50, 0] = part_lse[50, 0] = float("inf")  # outside the contract (kernels write -inf): alike all the same
    lse[51, 0], part_lse[51, 0] = NEG_INF, float("inf")
    for acc_finite in (False, True):
        acc_lse = lse.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=ops.LSE_FLOOR) if acc_finite else lse
        ref_out, ref_lse = out.clone(), acc_lse.clone()
        ops.merge_partial_torch(ref_out, ref_lse, part_out, part_lse, None, acc_finite=acc_finite)
        got_out, got_lse = out.clone(), acc_lse.clone()
        torch.ops.megatron_cp_ext.merge_partial_(got_out, got_lse, part_out, part_lse, None)
        torch.testing.assert_close(got_out, ref_out, rtol=0, atol=0, equal_nan=True)  # bit for bit
        torch.testing.assert_close(got_lse, ref_lse, rtol=0, atol=0, equal_nan=True)
        assert got_out[5, 1].isnan().all() and got_out[9, 2].isnan().all()
        assert torch.equal(got_out[40:44], out[40:44])


def test_merge_partial_into_a_row_slice() -> None:
    """The schedules merge into ``out[a:b]``: a view with a storage offset."""
    out, lse, part_out, part_lse = _merge_case(64, 63, 3, 4, torch.bfloat16)
    ref_out, ref_lse = out.clone(), lse.clone()
    ops.merge_partial_torch(ref_out[1:], ref_lse[1:], part_out, part_lse, None)
    ops.merge_partial(out[1:], lse[1:], part_out, part_lse, None)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


# --- the torch.library contract: schemas, fake impls, boundary checks ---


def test_opcheck() -> None:
    g = _gen(5)
    x = torch.randn(37, 3, 8, device=DEV, generator=g)
    idx = torch.randperm(37, device=DEV, generator=g)[:20]
    src = torch.randn(20, 3, 8, device=DEV, generator=g)
    lse = torch.randn(37, 3, device=DEV, generator=g)
    part_lse = torch.randn(20, 3, device=DEV, generator=g)
    torch.library.opcheck(torch.ops.megatron_cp_ext.gather_rows.default, (x, idx))
    torch.library.opcheck(torch.ops.megatron_cp_ext.index_add_rows_.default, (x.clone(), idx, src))
    torch.library.opcheck(
        torch.ops.megatron_cp_ext.merge_partial_.default,
        (x.clone(), lse.clone(), src.bfloat16(), part_lse, idx),
    )


def test_boundary_checks() -> None:
    x = torch.randn(8, 4, device=DEV)
    idx = torch.arange(4, device=DEV)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.megatron_cp_ext.gather_rows(x, idx.int())
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        torch.ops.megatron_cp_ext.gather_rows(x, idx.cpu())
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.megatron_cp_ext.gather_rows(x.t(), idx)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.megatron_cp_ext.index_add_rows_(x.bfloat16(), idx, x[:4])
    out, lse = torch.zeros(8, 2, 4, device=DEV), torch.zeros(8, 2, device=DEV)
    with pytest.raises(RuntimeError, match="cover all"):
        torch.ops.megatron_cp_ext.merge_partial_(out, lse, out[:4], lse[:4], None)


def test_public_functions_route_to_the_kernels() -> None:
    assert ops._use_kernel(torch.zeros(3, device=DEV), torch.zeros(3, device=DEV).long())
    grad_in = torch.zeros(3, device=DEV, requires_grad=True)
    assert not ops._use_kernel(grad_in)  # the differentiable fallback keeps autograd


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_cp_layer_merges_take_the_kernel(monkeypatch, backend: str) -> None:
    """A p2p layer at CP 2 merges its partials with the CUDA kernel, never the fallback: the
    kernel takes contiguous tensors only, so a backend whose lse comes back as a transposed
    view would send every merge of every layer to the 4-5 op fallback, silently."""
    import megatron_cp_ext as mcx
    from megatron_cp_ext.schedules import common
    from megatron_cp_ext.testing.inproc import run_threads

    merges, fallbacks = [], []
    merge, torch_merge = common.merge_partial, ops.merge_partial_torch
    monkeypatch.setattr(common, "merge_partial", lambda *a, **kw: (merges.append(1), merge(*a, **kw)))
    monkeypatch.setattr(ops, "merge_partial_torch", lambda *a, **kw: (fallbacks.append(1), torch_merge(*a, **kw)))
    cu = [0, 700, 1500, 3000]
    sh = mcx.shard_sequences(cu, 2, causal=True)

    def layer(rank: int, world: int) -> None:
        import torch.distributed as dist

        g = torch.Generator(device=DEV).manual_seed(rank)
        n = sh.num_tokens(rank)
        q, k, v = (torch.randn(n, h, 64, device=DEV, generator=g, dtype=torch.bfloat16) for h in (8, 2, 2))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = mcx.cp_attention(q, k, v, cp_group=dist.group.WORLD, comm_type="p2p", sharding=sh, backend=backend,
                               causal=True)  # fmt: skip
        out.backward(torch.randn_like(out))

    run_threads(2, layer, device=DEV, timeout=120)
    assert merges, "the layer merged nothing: the check would be empty"
    assert not fallbacks, f"{len(fallbacks)} of {len(merges)} merges fell back to torch"
