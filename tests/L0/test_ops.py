"""The row primitives of ``megatron_cp_ext.runtime.ops`` against naive per-row formulas (CPU).

On CPU the public functions always take the pure-torch path, so these tests pin down the
contract that the CUDA kernels are later compared against (tests/gpu/test_ops_cuda.py).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_cp_ext.runtime import ops

NEG_INF = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_extension_flag_is_a_bool() -> None:
    assert isinstance(ops.HAS_CUDA_EXT, bool)
    assert ops.HAS_CUDA_EXT == (ops._EXT_IMPORT_ERROR is None)


# --- gather_rows ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("row_shape", [(), (3,), (4, 5)])
def test_gather_rows_matches_row_loop(dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
    g = _gen(0)
    x = (torch.randn((97, *row_shape), generator=g) * 10).to(dtype)
    idx = torch.randint(0, 97, (131,), generator=g)  # repeats and any order
    out = ops.gather_rows(x, idx)
    assert out.shape == (131, *row_shape) and out.dtype == dtype
    assert torch.equal(out, torch.stack([x[i] for i in idx.tolist()]))


def test_gather_rows_empty_index() -> None:
    x = torch.randn(7, 2, 3)
    out = ops.gather_rows(x, torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 2, 3)


def test_gather_rows_is_differentiable_on_the_fallback() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    ops.gather_rows(x, torch.tensor([4, 4, 0])).sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 2.0]


# --- index_add_rows ---


@pytest.mark.parametrize(
    ("acc_dtype", "src_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_index_add_rows_accumulates_repeats(acc_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    g = _gen(1)
    # Small integers: every partial sum is exact in all dtypes, so any order gives one answer.
    acc = torch.randint(-8, 8, (11, 2, 3), generator=g).to(acc_dtype)
    idx = torch.tensor([3, 0, 3, 10, 3, 7, 0])
    src = torch.randint(-8, 8, (7, 2, 3), generator=g).to(src_dtype)
    expected = acc.double().clone()
    for n, t in enumerate(idx.tolist()):
        expected[t] += src[n].double()
    ops.index_add_rows(acc, idx, src)
    assert acc.dtype == acc_dtype
    assert torch.equal(acc.double(), expected)


def test_index_add_rows_leaves_the_atomic_kernel_when_deterministic(monkeypatch) -> None:
    """The CUDA kernel adds with atomics (repeated indices in no fixed order): under
    ``torch.use_deterministic_algorithms`` the op takes torch's path, whatever the device."""
    monkeypatch.setattr(ops, "HAS_CUDA_EXT", True)
    monkeypatch.setattr(ops, "_use_kernel", lambda *t: True)
    idx, src = torch.tensor([1, 1]), torch.ones(2, 2)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, dim=lambda: 2)
    assert ops._add_kernel(on_cuda, idx, src)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not ops._add_kernel(on_cuda, idx, src)
    finally:
        torch.use_deterministic_algorithms(was)


# --- merge_partial ---


def _naive_merge(out, lse, part_out, part_lse, idx):
    """Per (row, head) in float64 with math: the formula of design §2, -inf safe."""
    out, lse = out.double().clone(), lse.double().clone()
    rows = range(part_out.shape[0]) if idx is None else idx.tolist()
    for n, t in enumerate(rows):
        for h in range(lse.shape[1]):
            a, b = lse[t, h].item(), part_lse[n, h].item()
            m = max(a, b)
            if m == NEG_INF:
                continue  # nothing visible on either side: row stays 0 / -inf
            new = m + math.log(math.exp(a - m) + math.exp(b - m))
            p = part_out[n, h].double()
            out[t, h] = out[t, h] * math.exp(a - new) + p * math.exp(b - new)
            lse[t, h] = new
    return out, lse


def _case(seed: int, t: int, n: int, h: int, d: int, part_dtype: torch.dtype):
    g = _gen(seed)
    lse = torch.randn(t, h, generator=g) * 3
    part_lse = torch.randn(n, h, generator=g) * 3
    # -inf on the accumulator side, on the partial side, and on both.
    lse[: t // 3] = NEG_INF
    part_lse[n // 4 : n // 2] = NEG_INF
    out = torch.randn(t, h, d, generator=g)
    out[torch.isneginf(lse)] = 0.0  # an accumulator that saw nothing holds zeros
    part_out = torch.randn(n, h, d, generator=g).to(part_dtype)
    part_out[torch.isneginf(part_lse)] = 0.0
    return out, lse, part_out, part_lse


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_idx", [False, True])
def test_merge_partial_matches_naive(part_dtype: torch.dtype, with_idx: bool) -> None:
    t, h, d = 37, 3, 5
    idx = torch.randperm(t, generator=_gen(7))[:23] if with_idx else None
    n = t if idx is None else idx.numel()
    out, lse, part_out, part_lse = _case(2, t, n, h, d, part_dtype)
    expected_out, expected_lse = _naive_merge(out, lse, part_out, part_lse, idx)
    untouched = torch.zeros(t, dtype=torch.bool)
    if idx is not None:
        untouched[:] = True
        untouched[idx] = False
    before_out, before_lse = out[untouched].clone(), lse[untouched].clone()

    ops.merge_partial(out, lse, part_out, part_lse, idx)

    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[untouched], before_out) and torch.equal(lse[untouched], before_lse)


def test_merge_partial_both_sides_empty_stays_zero() -> None:
    out, lse = torch.zeros(4, 2, 3), torch.full((4, 2), NEG_INF)
    part_out, part_lse = torch.zeros(2, 2, 3, dtype=torch.bfloat16), torch.full((2, 2), NEG_INF)
    ops.merge_partial(out, lse, part_out, part_lse, torch.tensor([2, 0]))
    assert torch.equal(out, torch.zeros(4, 2, 3))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("acc_finite", [False, True])
def test_merge_partial_keeps_a_nan_row_nan(acc_finite: bool) -> None:
    """A NaN lse on either side (NaN input in a document) makes that row's output NaN, with
    or without the accumulator's finiteness promise, and leaves the other rows alone: the
    CUDA kernel does the same (tests/gpu/test_ops_cuda.py)."""
    floor = -1e30 if acc_finite else NEG_INF
    out, lse = torch.zeros(4, 1, 2), torch.tensor([[0.5], [float("nan")], [floor], [floor]])
    part_out, part_lse = torch.ones(4, 1, 2), torch.tensor([[float("nan")], [0.0], [NEG_INF], [1.0]])
    ops.merge_partial(out, lse, part_out, part_lse, None, acc_finite=acc_finite)
    assert out[:2].isnan().all() and lse[:2].isnan().all()
    assert torch.equal(out[2:], torch.tensor([[[0.0, 0.0]], [[1.0, 1.0]]]))
    assert lse[2, 0] == floor and lse[3, 0] == 1.0


def test_merging_key_blocks_equals_attention_over_all_keys() -> None:
    """Online softmax: merging per-block (out, lse) in any order gives full attention."""
    g = _gen(3)
    t, s, h, d = 6, 29, 2, 4
    q, k, v = (torch.randn(x, h, d, generator=g, dtype=torch.float64) for x in (t, s, s))
    scores = torch.einsum("thd,shd->hts", q, k)
    full_out = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    out, lse = torch.zeros(t, h, d), torch.full((t, h), NEG_INF)
    for lo, hi in [(20, 29), (0, 7), (7, 20)]:
        block = scores[..., lo:hi]
        part_out = torch.einsum("hts,shd->thd", block.softmax(-1), v[lo:hi])
        ops.merge_partial(out, lse, part_out.float(), block.logsumexp(-1).T.float(), None)
    torch.testing.assert_close(out.double(), full_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).T, rtol=1e-6, atol=1e-6)


def test_cpu_tensors_never_reach_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "HAS_CUDA_EXT", True)
    assert not ops._use_kernel(torch.zeros(2), torch.zeros(2, dtype=torch.long))


def test_row_dot16_falls_back_on_cpu():
    """Off CUDA the kernel does not apply (None) and the schedules' row dot takes its torch
    form: products exact in fp32, against fp64 within the fp32 sum's rounding."""
    from megatron_cp_ext.schedules.delta import row_dot

    a, b = (torch.randn(50, 3, 72, generator=_gen(s)).to(torch.bfloat16) for s in (1, 2))
    assert ops.row_dot16(a, b) is None
    want = (a.double() * b.double()).sum(-1)
    bound = (a.double() * b.double()).abs().sum(-1) * 72 * 2.0**-23
    got = row_dot(a, b)
    assert got.dtype == torch.float32 and ((got.double() - want).abs() <= bound).all()


def test_stand_in16_falls_back_on_cpu():
    """Off CUDA the kernel does not apply (None) and the schedules' stand-in takes its torch
    form, whose row dot with ``dout`` gives each row's term back."""
    from megatron_cp_ext.schedules.delta import stand_in, stand_in_torch

    dout = torch.randn(50, 3, 72, generator=_gen(3)).to(torch.bfloat16)
    delta = torch.randn(50, 3, generator=_gen(4))
    assert ops.stand_in16(dout, delta) is None
    x = stand_in(dout, delta)
    assert torch.equal(x, stand_in_torch(dout, delta)) and ((x != 0).sum(-1) <= 2).all()
    back = (dout.double() * x.double()).sum(-1)
    assert ((back - delta.double()).abs() <= (dout.double() * x.double()).abs().sum(-1) * 2.0**-14).all()
