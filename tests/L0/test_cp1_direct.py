"""CP 1 costs what the kernel costs: one forward and one backward kernel call and nothing else
of the tensors' size (no packed KV, no widened copies, no zero-filled gradients, no rounding
back), with the kernel's results bit for bit."""

import pytest
import torch

import megatron_cp_ext as mcx
from megatron_cp_ext.backends import reference
from megatron_cp_ext.testing.accounting import Tracker, flash_stub

LENS = [0, 37, 1, 90, 64]


def _case(causal: bool, dtype, seed: int = 0):
    """cu_seqlens, the CP 1 sharding, and q, k, v, dout."""
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(seed)
    qkvd = [torch.randn(cu[-1], h, 16, generator=g).to(dtype) for h in (4, 2, 2, 4)]
    return cu, mcx.shard_sequences(cu, 1, causal=causal), qkvd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_cp1_runs_the_kernel_alone(dtype, causal):
    _, sh, (q, k, v, dout) = _case(causal, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, causal=causal, backend="reference")  # plan built
    with flash_stub(), Tracker() as tr:
        out = mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, causal=causal, backend="reference")
        torch.autograd.grad(out, (q, k, v), dout)
    assert tr.kernels == 2
    big = {name: n for name, n in tr.ops.items() if not name.startswith("aten::_local_scalar")}
    # nothing but the kernels touches q/k/v/out-sized data: no cat, copy, to, zeros, add
    for op in ("aten::cat", "aten::_to_copy", "aten::copy_", "aten::zeros", "aten::zero_", "aten::add_"):
        assert op not in big, (op, big)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_cp1_equals_the_kernel(dtype, causal):
    cu, sh, (q, k, v, dout) = _case(causal, dtype, seed=3)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = (cu_t, cu_t, max(LENS), max(LENS), causal, (-1, 0 if causal else -1), 16**-0.5)
    o_ref, lse = reference.attn_fwd(q, k, v, *args)
    grads_ref = reference.attn_bwd(dout, q, k, v, o_ref, lse, *args)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = mcx.cp_attention(q, k, v, cp_group=None, sharding=sh, causal=causal, backend="reference")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.dtype == dtype and torch.equal(out, o_ref.to(dtype))
    for g, r in zip(grads, grads_ref, strict=True):
        assert g.dtype == dtype and torch.equal(g, r.to(dtype))
