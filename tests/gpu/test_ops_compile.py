"""csrc ops vs the torch fallbacks on plan-like random offsets, empty ranges included, and the
fake impls under ``torch.compile`` (the ops trace, and the compiled graph gives the eager result)."""

import pytest
import torch

from megatron_cp_ext.runtime import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.HAS_CUDA_EXT, reason="CUDA extension not built"),
]


def _ranges(n_rows: int, seed: int) -> list[torch.Tensor]:
    """Row indices of random ranges (as plans cut them), some empty, distinct rows."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, n_rows + 1, (9,), generator=g)).values.tolist()
    out = [torch.arange(a, b) for a, b in zip([0, *cuts], [*cuts, n_rows])]
    out.insert(2, torch.arange(0))
    return [x.cuda() for x in out]


@pytest.mark.parametrize("seed", range(4))
def test_ops_bitwise_on_random_ranges(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(777, 4, 40, device="cuda", generator=g).to(torch.bfloat16)
    for idx in _ranges(777, seed):
        assert torch.equal(torch.ops.megatron_cp_ext.gather_rows(x, idx), ops.gather_rows_torch(x, idx))
        src = torch.randn(idx.numel(), 4, 40, device="cuda", generator=g)
        a = torch.randn(777, 4, 40, device="cuda", generator=g)
        b = a.clone()
        torch.ops.megatron_cp_ext.index_add_rows_(a, idx, src)
        ops.index_add_rows_torch(b, idx, src)
        assert torch.equal(a, b)
        out = torch.randn(777, 4, 40, device="cuda", generator=g)
        lse = torch.randn(777, 4, device="cuda", generator=g)
        lse[::7] = float("-inf")
        po, pl = torch.randn(idx.numel(), 4, 40, device="cuda", generator=g), torch.randn(idx.numel(), 4, device="cuda")
        o2, l2 = out.clone(), lse.clone()
        torch.ops.megatron_cp_ext.merge_partial_(out, lse, po, pl, idx)
        ops.merge_partial_torch(o2, l2, po, pl, idx)
        assert torch.equal(out, o2) and torch.equal(lse, l2)


def test_ops_trace_under_compile():
    def step(x, idx, acc, out, lse, po, pl):
        y = torch.ops.megatron_cp_ext.gather_rows(x, idx)
        torch.ops.megatron_cp_ext.index_add_rows_(acc, idx, y.float())
        torch.ops.megatron_cp_ext.merge_partial_(out, lse, po, pl, idx)
        return y * 2

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 2, 16, device="cuda", generator=g)
    idx = torch.randperm(300, device="cuda", generator=g)[:111]
    args = [x, idx, torch.zeros(300, 2, 16, device="cuda"), torch.zeros(300, 2, 16, device="cuda"),
            torch.full((300, 2), float("-inf"), device="cuda"), torch.randn(111, 2, 16, device="cuda", generator=g),
            torch.randn(111, 2, device="cuda", generator=g)]  # fmt: skip
    eager = [a.clone() for a in args]
    want = step(*eager)
    got = torch.compile(step, fullgraph=True)(*args)
    assert torch.equal(got, want)
    for a, b in zip(args, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1000, 8, 128), (37, 3, 72), (5, 2, 7), (0, 4, 64), (6, 2, 0)])
def test_row_dot_kernel_against_fp64(dtype, shape):
    """The 16-bit row dot kernel (a2a's dout . out) against fp64: the products are exact in
    fp32, so only the fp32 sum rounds (bound: d ulps of the sum of |products|); the torch
    form it replaces agrees to the same bound."""
    from megatron_cp_ext.schedules.delta import row_dot

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(shape, generator=g, device="cuda").to(dtype) for _ in range(2))
    got = ops.row_dot16(a, b)
    assert got is not None and got.dtype == torch.float32 and got.shape == shape[:-1]
    want = (a.double() * b.double()).sum(-1)
    bound = (a.double() * b.double()).abs().sum(-1) * shape[-1] * 2.0**-23
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(row_dot(a, b), got)  # the schedules' entry takes the kernel
    chunked = (a.float() * b.float()).sum(-1)
    assert ((chunked.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1000, 8, 128), (37, 3, 72), (5, 2, 2), (0, 4, 64), (9, 1, 33)])
def test_stand_in_kernel_is_the_torch_form(dtype, shape):
    """The 16-bit stand-in kernel (a2a's backward) against its torch form, to the bit: the
    same two entries per row (ties to the lower index: rows of zeros, repeated values, a
    signed zero; NaN above every number) and the same roundings; the row terms of rows with
    a NaN stay NaN. The schedules' entry takes the kernel."""
    from megatron_cp_ext.schedules.delta import stand_in, stand_in_torch

    g = torch.Generator(device="cuda").manual_seed(shape[0])
    dout = torch.randn(shape, generator=g, device="cuda").to(dtype)
    delta = torch.randn(shape[:-1], generator=g, device="cuda") * 3
    if shape[0] >= 5:
        dout[0] = 0  # ties everywhere: the first two entries
        dout[1, :, 3:] = dout[1, :, :1]  # a repeated largest value
        dout[2] = -0.0
        dout[3, :, 1] = float("nan")
        delta[4] = 0
    got = ops.stand_in16(dout, delta)
    want = stand_in_torch(dout, delta)
    assert got is not None and got.dtype == dtype and got.shape == dout.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(stand_in(dout, delta).isnan(), want.isnan())
    assert ops.stand_in16(dout.float(), delta) is None and ops.stand_in16(dout[..., :1], delta) is None


@pytest.mark.parametrize("mag", [2000.0, 40000.0, 65400.0])
def test_stand_in_kernel_spreads_rows_past_the_fp16_range(mag):
    """fp16 rows whose ``delta / dout_k`` overflows (|out| ~ 2000 and ~ 40000, Dv 128, mixed
    signs): the kernel spreads the term like the torch form; finite, within a rounding of the
    second entry's value of the row term, the shares the torch form's but for a rounding
    (another summation order), rows in range to the bit."""
    from megatron_cp_ext.schedules.delta import row_dot, stand_in_torch

    g = torch.Generator(device="cuda").manual_seed(3)
    sign = torch.randn(300, 4, 128, generator=g, device="cuda").sign()
    dout = (sign * (1 + 0.1 * torch.randn(300, 4, 128, generator=g, device="cuda"))).half()
    out = (sign * (mag + torch.randn(300, 4, 128, generator=g, device="cuda"))).half()
    out[:50] = torch.randn(50, 4, 128, generator=g, device="cuda").half()
    delta = row_dot(dout, out)
    got, want = ops.stand_in16(dout, delta), stand_in_torch(dout, delta)
    assert torch.isfinite(got).all() and torch.equal(got[:50], want[:50])
    off = ~torch.isclose(got.float(), want.float(), rtol=2e-3, atol=0)  # a share one rounding apart
    assert (off.sum(-1) <= 2).all()  # the top two carry what the share misses: they may differ more
    top2 = dout.double().abs().topk(2, dim=-1).values
    share = delta.double() / dout.double().abs().sum(-1)
    term = (dout.double() * got.double()).sum(-1)
    near_max = mag > 60000  # the top two may saturate there: the term misses by a rounding of the share
    bound = 2.0**-11 * share.abs() * (dout.double().abs().sum(-1) if near_max else top2[..., 1])
    assert ((term - delta.double()).abs() <= bound)[50:].all()
